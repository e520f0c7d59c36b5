"""Runs compare cases in this process and appends each record to a JSON-lines file.

    python -m polyamp.compare.worker --case torch mlp float32 --case torch mlp bf16-mixed --out cases.jsonl
    python -m polyamp.compare.worker --serve   # one MXNet policy, stepped by the runner over a pipe

Consecutive cases of one (framework, workload) are a pair group: every policy's trainer is built
here from the workload's shared weights, takes one warm-up step, then the policies step in
interleaved rounds (``pairing.py``, ``timing.py``), and each record carries its speed-up over float32 as the
median of per-round ratios, with a 95 % interval and its number of rounds (``paired``). A step is
timed from batch to the loss value on the host and, for MXNet, to the end of its queued work
(``queued_work_waiter``), so each step's time holds its whole work.
``--budget`` caps each policy's seconds of steps (its warm-up included, except in a smoke check,
``--quick``, whose warm-up is mostly tracing and compiling; before 5 rounds, up to 3 budgets: see
``timing.py``); a capped policy leaves the rounds and is not evaluated (it stopped at another step
count than float32); the others go on. A policy that spent its budget on its warm-up has that step
as its only measurement. ``wall_s`` is the group's,
``loadavg_1min`` the machine's 1-minute load average as the group started and ended (other
programs' load: more than the cores means the rounds competed for them).
Peak memory is the process's peak resident set size, so it is shared by the group's policies (and
by earlier cases of the process: ``process_case`` > 0). A case that raises (building, stepping or
evaluating) becomes a record with its error (``unsupported`` when the framework refuses the request
here); the others go on. ``--roofline FILE`` first measures the framework's matmul peaks into FILE.

After the training rounds, each policy whose training is ``ok`` records ``memory`` (its trainer's
``memory()``; a probe that raises leaves ``memory`` None and ``memory_error`` its text, never the
case failed), then the policies' ``infer`` calls are paired in rounds the same way (``inference``):
call k runs on held-out input k (cycling), timed to its float32 numpy result on the host (MXNet:
to the end of its queued work); one warm-up call each, never counted against the inference budget
(``--infer-budget``, default a quarter of ``--budget``, at least 0.5 s: it is mostly tracing or
compiling the forward pass), at most ``min(steps, INFER_MAX_CALLS)`` calls. A policy whose training
was not capped is then evaluated through ``infer``. Its ``status`` is that of the inference calls:
one that raises leaves the training fields as they are.

``--serve`` (MXNet, whose AMP is process-wide, so each policy has its own process; and every row of
``compare --tuned``): answers one JSON command a line on stdin (``roofline``, ``build``, ``build_tuned``
(``tuned_run.TunedRun``), ``step``, ``result``, ``memory``,
``inference_info``, ``infer``, ``infer_eval``, ``exit``) with one JSON line on stdout: what the
:class:`PolicyRun` method of that name returns; the runner pairs the processes' steps and inference
calls in rounds (``lockstep.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable

import numpy as np

from .pairing import NOT_MEASURED, error_fields, infer_budget_for, pair_group, pair_groups
from .workloads import get_workload


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PolicyRun:
    """One policy's trainer (``step(i)``, ``evaluate()``, ``mp``, ``last``) and what its steps gave."""

    def __init__(self, trainer, metric: tuple[str, bool], clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], object] | None = None):  # fmt: skip
        self.trainer, self.metric, self.clock, self.sync = trainer, metric, clock, sync
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.skipped = 0
        self._memory: dict | None = None  # what memory() measured: inference_info() reads its weights
        self._heldout: list | None = None  # the held-out inputs infer() cycles through

    def step(self, i: int) -> float:
        """Run step ``i``; returns its seconds."""
        t0 = self.clock()
        loss = self.trainer.step(i)
        if self.sync is not None:
            self.sync()
        seconds = self.clock() - t0
        self.losses.append(loss)
        self.scales.append(self.trainer.mp.current_scale)
        self.skipped += not self.trainer.last.stepped
        return seconds

    def result(self, evaluate: bool) -> dict:
        """The record's training fields; the metric only with ``evaluate``."""
        value = self.trainer.evaluate() if evaluate else math.nan
        name, higher = self.metric
        return {
            "steps": len(self.losses),
            "losses": [x if math.isfinite(x) else None for x in self.losses],
            "scales": self.scales,
            "skipped_steps": self.skipped,
            "eval": {"metric": name, "value": value if math.isfinite(value) else None,
                     "higher_is_better": higher},  # fmt: skip
            "peak_rss_mb": _peak_rss_mb(),
        }

    def memory(self) -> dict:
        """The ``memory`` and ``memory_error`` fields: the trainer's ``memory()``, or None and why."""
        try:
            self._memory = dict(self.trainer.memory())
        except Exception as err:
            return {"memory": None, "memory_error": f"{type(err).__name__}: {err}"}
        return {"memory": self._memory, "memory_error": None}

    def _inputs(self) -> list:
        if self._heldout is None:
            self._heldout = [x for x, _ in self.trainer.wl.heldout()]
        return self._heldout

    def inference_info(self) -> dict:
        """What the inference calls run: the trainer's form, rows per batch, bytes of the weights
        ``infer`` reads (``memory()``'s ``inference_weights``; None when that probe failed)."""
        memory = self._memory
        return {"how": self.trainer.inference_form, "batch": int(len(self._inputs()[0])),
                "weights_bytes": memory["inference_weights"] if memory else None}  # fmt: skip

    def infer(self, k: int) -> float:
        """Inference call ``k`` on held-out input ``k`` (cycling); returns its seconds."""
        inputs = self._inputs()
        x = inputs[k % len(inputs)]
        t0 = self.clock()
        np.asarray(self.trainer.infer(x), np.float32)
        if self.sync is not None:
            self.sync()
        return self.clock() - t0

    def infer_eval(self) -> dict:
        """The held-out metric of the network as ``infer`` runs it."""
        value = self.trainer.wl.evaluate(self.trainer.infer)
        name, higher = self.metric
        return {"metric": name, "value": value if math.isfinite(value) else None, "higher_is_better": higher}


def queued_work_waiter(framework: str) -> Callable[[], object] | None:
    """What waits for the work a framework still runs after a step returned its loss: MXNet's engine
    runs the backward pass and the optimizer update asynchronously (about 90 ms of the MLP's step on
    this CPU), which would spill into the next policy's step in a round. torch, TensorFlow and JAX
    have finished a step's work when its loss reaches the host."""
    if framework == "mxnet":
        import mxnet

        return mxnet.nd.waitall
    return None


def run_group(framework: str, workload: str, policies: list[str], quick: bool, steps: int | None,
              budget: float, seed: int = 0, infer_budget: float | None = None) -> list[dict]:  # fmt: skip
    """The records of one pair group, in the order of ``policies``."""
    start, load = time.perf_counter(), os.getloadavg()[0]
    common = [{"framework": framework, "workload": workload, "policy": p, "seed": seed} for p in policies]
    try:
        wl = get_workload(workload, quick=quick, steps=steps, seed=seed)  # refuses steps < 1
        module = importlib.import_module(f"polyamp.compare.{framework}")
        versions = module.versions()
    except Exception as err:
        return [{**c, **error_fields(err), **NOT_MEASURED} for c in common]
    runs, fields = {}, {}
    sync = queued_work_waiter(framework)
    for policy in policies:
        try:
            runs[policy] = PolicyRun(module.Trainer(wl, policy), wl.metric, sync=sync)
        except Exception as err:
            fields[policy] = {**error_fields(err), **NOT_MEASURED}
    fields.update(pair_group(runs, wl.steps, budget, quick, infer_budget=infer_budget))
    wall = time.perf_counter() - start
    shared = {"versions": versions, "framework_version": versions[framework], "steps_requested": wl.steps,
              "group_policies": list(policies), "loadavg_1min": [load, os.getloadavg()[0]]}  # fmt: skip
    return [{**c, **shared, **fields[c["policy"]], "wall_s": wall} for c in common]


def serve(commands, reply) -> None:
    """Answer ``commands`` (JSON lines) on ``reply`` until ``exit`` or their end (see the docstring)."""
    from .roofline import measure

    run = None
    for line in commands:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        try:
            if op == "roofline":
                out = {"roofline": measure(cmd["framework"], cmd["quick"]).to_json()}
            elif op == "build":
                wl = get_workload(cmd["workload"], quick=cmd["quick"], steps=cmd["steps"], seed=cmd["seed"])
                module = importlib.import_module(f"polyamp.compare.{cmd['framework']}")
                run = PolicyRun(module.Trainer(wl, cmd["policy"]), wl.metric,
                                sync=queued_work_waiter(cmd["framework"]))  # fmt: skip
                out = {"versions": module.versions(), "steps_requested": wl.steps}
            elif op == "build_tuned":
                from .tuned_run import TunedRun

                run = TunedRun(cmd["framework"], cmd["workload"], cmd["policy"], cmd["settings"],
                               cmd["quick"], cmd.get("env", ()))  # fmt: skip
                out = {"env": run.env}
            elif op == "step":
                out = {"seconds": run.step(cmd["i"])}
            elif op == "result":
                out = run.result(cmd["evaluate"])
            elif op == "memory":
                out = run.memory()
            elif op == "inference_info":
                out = run.inference_info()
            elif op == "infer":
                out = {"seconds": run.infer(cmd["k"])}
            elif op == "infer_eval":
                out = run.infer_eval()
            else:
                raise ValueError(f"unknown command {op!r}; accepted: roofline, build, build_tuned, step, "
                                 "result, memory, inference_info, infer, infer_eval, exit")  # fmt: skip
        except Exception as err:
            out = {"failure": error_fields(err)}
        reply.write(json.dumps(out) + "\n")
        reply.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, action="append", metavar=("FRAMEWORK", "WORKLOAD", "POLICY"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--budget", type=float, default=6.0)
    parser.add_argument("--infer-budget", type=float, default=None,
                        help="seconds of inference calls per policy (default: a quarter of --budget, >= 0.5)")
    parser.add_argument("--out")
    parser.add_argument("--roofline", metavar="FILE")
    parser.add_argument("--serve", action="store_true")
    args = parser.parse_args(argv)
    infer_budget_for(args.budget, args.infer_budget)  # refuses a bad --infer-budget before any case
    if args.serve:
        reply = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # what the frameworks print goes to stderr; stdout carries the replies only
        serve(sys.stdin, reply)
        return 0
    if not args.case or not args.out:
        parser.error("--case and --out are needed (or --serve)")
    if args.roofline:
        from .roofline import measure

        with open(args.roofline, "w", encoding="utf-8") as f:
            json.dump(measure(args.case[0][0], args.quick).to_json(), f)
    index = 0
    for group in pair_groups(args.case):
        framework, workload = args.case[group[0]][:2]
        policies = [args.case[i][2] for i in group]
        for record in run_group(framework, workload, policies, args.quick, args.steps, args.budget,
                                infer_budget=args.infer_budget):  # fmt: skip
            record.update(worker_pid=os.getpid(), process_case=index)
            index += 1
            with open(args.out, "a", encoding="utf-8") as f:  # one whole line per case: the runner reads them
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
