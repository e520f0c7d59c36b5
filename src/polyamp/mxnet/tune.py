"""``polyamp.tune`` on MXNet Gluon: every configuration runs in a worker process of its policy.

contrib.amp is process-wide (``amp.init`` patches MXNet's operators in one dtype for the whole
process), so a float32 step and a bf16-mixed step cannot share a process. The model is therefore given
as a *maker*, ``"package.module:function"`` or ``"path/to/file.py:function"`` (with keyword arguments),
that returns ``(net, batch, loss_fn, optimizer)``: a Gluon network with the same initial weights at
every call, ``batch(i) -> (inputs, target)`` (``inputs`` a tuple of NDArrays), ``loss_fn(out, target)``
-> a scalar NDArray, and ``optimizer`` as ``(name, params)`` or an ``mx.optimizer.Optimizer``, what
``gluon.Trainer`` takes. One worker process per (policy, threads) (``python -m polyamp.mxnet.tune``)
creates the policy's ``MixedPrecision`` (``amp.init`` before any network), then builds each
configuration there: ``maker(**kwargs)``, the network hybridized as the knob says, watched, its trainer
made by ``mp.trainer``; a step is ``autograd.record`` / ``mp.scale_loss`` / ``mp.step``.

Knobs: ``hybridize`` (off, on, static: ``static_alloc`` and ``static_shape``) and ``threads`` (the
machine's cores, half of them: ``OMP_NUM_THREADS`` and ``MXNET_CPU_WORKER_NTHREADS`` of the worker
process, which MXNet reads only as it starts). The search times each step from this process: a pipe
round trip, well under a millisecond, in every configuration's time alike.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import PolyampError
from ..tune import search
from ..tune.space import Candidate, Knob

HYBRIDIZE = ("off", "on", "static")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def knobs() -> dict[str, Knob]:
    n = _cores()
    out = {"hybridize": Knob(HYBRIDIZE, "Gluon's hybridize {value} (static: static_alloc and static_shape)")}
    if n > 1:
        out["threads"] = Knob((n, n // 2), "{value} OpenMP threads in the step's process")
    return out


def load_maker(maker: str):
    """The function a maker string names: ``module:function`` or ``file.py:function``."""
    if not isinstance(maker, str) or maker.count(":") != 1:
        raise PolyampError("an MXNet tune maker is 'package.module:function' or 'file.py:function'; "
                           f"received {maker!r}")  # fmt: skip
    where, name = maker.split(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise PolyampError(f"the maker's file {where!r} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise PolyampError(f"{maker}: {where} has no function {name!r}")
    return fn


class _Worker:
    """A ``python -m polyamp.mxnet.tune`` process: one policy, one thread count."""

    def __init__(self, policy: str, threads: int | None):
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if threads is not None:
            env.update(OMP_NUM_THREADS=str(threads), MXNET_CPU_WORKER_NTHREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, "-m", "polyamp.mxnet.tune", policy], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip

    def call(self, **command) -> Any:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the MXNet tune worker exited with code {self.proc.returncode}")
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the MXNet tune worker died (exit code {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["value"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


class _RemoteStep:
    def __init__(self, worker: _Worker, key: int):
        self.worker, self.key = worker, key

    def step(self, i: int) -> float:
        return float(self.worker.call(op="step", key=self.key, i=i))

    def close(self) -> None:
        if self.worker.proc.poll() is None:
            self.worker.call(op="close", key=self.key)


class Tunable:
    """The search's view of an MXNet model given as a maker (module docstring)."""

    framework = "mxnet"

    def __init__(self, maker: str, kwargs: dict | None = None, name: str | None = None):
        load_maker(maker)  # a bad maker fails here, not in a worker
        self.maker, self.kwargs, self.name = maker, dict(kwargs or {}), name or maker
        self.knobs = knobs()
        self._workers: dict[tuple, _Worker] = {}
        self._built = 0
        atexit.register(self.close)

    def build(self, candidate: Candidate) -> _RemoteStep:
        settings = dict(candidate.settings)
        hybridize = settings.get("hybridize", "off")
        if hybridize not in HYBRIDIZE:
            raise PolyampError(f"hybridize is one of {', '.join(HYBRIDIZE)}; received {hybridize!r}")
        key = (candidate.policy, settings.get("threads"))
        if key not in self._workers or self._workers[key].proc.poll() is not None:
            self._workers[key] = _Worker(*key)
        self._built += 1
        worker = self._workers[key]
        worker.call(op="build", key=self._built, maker=self.maker, kwargs=self.kwargs, hybridize=hybridize)
        return _RemoteStep(worker, self._built)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()


def tune(maker: str, kwargs: dict | None = None, policies=("bf16-mixed",), budget_s: float = 120.0,
         parity_steps: int = 6, rtol: float = 0.05, name: str | None = None, progress=None):  # fmt: skip
    """``polyamp.tune`` for MXNet: the search (``tune/search.py``) over this front end's knobs."""
    tunable = Tunable(maker, kwargs, name)
    try:
        return search.tune(tunable, policies, budget_s, parity_steps, rtol, progress=progress)
    finally:
        tunable.close()


def build_step(mp, net, batch, loss_fn, optimizer, hybridize: str = "off"):
    """The training step of ``net`` under ``mp``: ``step(i)`` returns batch ``i``'s loss (a float, its
    work finished); also ``report.apply``'s."""
    from mxnet import autograd, gluon

    if hybridize != "off":
        net.hybridize(**({"static_alloc": True, "static_shape": True} if hybridize == "static" else {}))
    mp.watch(net)
    name, params = optimizer if isinstance(optimizer, tuple) else (optimizer, None)
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), name, params))

    def step(i: int) -> float:
        inputs, target = batch(i)
        with autograd.record():
            loss = loss_fn(net(*inputs), target)
            with mp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        mp.step(trainer, batch_size=1)
        return float(loss.asscalar())

    return step, trainer


def apply(report, make, kwargs: dict | None = None):
    """``(mp, net, step)`` configured as ``report.best`` in this process: the policy's
    ``MixedPrecision`` (``amp.init`` first), then ``make`` (a maker string or function) builds the
    network, hybridized as chosen, and ``step(i)`` trains on its batch ``i``. A chosen thread count
    is for the next process (``OMP_NUM_THREADS``): said in a warning when this one differs."""
    from . import MixedPrecision

    if report.framework != "mxnet":
        raise PolyampError(f"this report tuned {report.framework}, not mxnet")
    mp = MixedPrecision(report.policy, framework="mxnet", device="cpu")
    fn = load_maker(make) if isinstance(make, str) else make
    net, batch, loss_fn, optimizer = fn(**(kwargs or {}))
    threads = report.settings.get("threads")
    if threads is not None and os.environ.get("OMP_NUM_THREADS", str(_cores())) != str(threads):
        import warnings

        warnings.warn(f"the report chose {threads} threads: start the process with OMP_NUM_THREADS={threads} "
                      "(MXNet reads it only at start)", stacklevel=2)  # fmt: skip
    step, _ = build_step(mp, net, batch, loss_fn, optimizer, report.settings.get("hybridize", "off"))
    return mp, net, step


def _serve(policy: str) -> None:
    """The worker: one JSON command a line on stdin (build, step, close, exit), one reply a line."""
    import traceback

    from . import MixedPrecision

    try:
        MixedPrecision(policy, framework="mxnet", device="cpu")  # amp.init before any network
        refused = None
    except PolyampError as err:  # e.g. bf16 on a CPU without AVX-512: each command gets the reason
        refused = f"{type(err).__name__}: {err}"
    steps: dict[int, Any] = {}
    out = sys.stdout
    sys.stdout = sys.stderr  # what the model prints must not reach the pipe
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if refused is not None:
            out.write(json.dumps({"error": refused}) + "\n")
            out.flush()
            continue
        try:
            if cmd["op"] == "build":
                net, batch, loss_fn, optimizer = load_maker(cmd["maker"])(**cmd["kwargs"])
                mp = MixedPrecision(policy, framework="mxnet", device="cpu")
                steps[cmd["key"]] = build_step(mp, net, batch, loss_fn, optimizer, cmd["hybridize"])[0]
                value = None
            elif cmd["op"] == "step":
                value = steps[cmd["key"]](cmd["i"])
            elif cmd["op"] == "close":
                steps.pop(cmd["key"], None)
                value = None
            else:
                raise ValueError(f"unknown command {cmd['op']!r}; accepted: build, step, close, exit")
            reply = {"value": value}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=6)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
