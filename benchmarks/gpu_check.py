"""The one prepared run for a lent GPU: polyamp against native AMP, ``polyamp tune`` and ``polyamp compare``,
within one time budget, figures written to JSON and to a markdown section for docs/BENCHMARKS.md.

    python benchmarks/gpu_check.py [--budget 540] [--out gpu-check] [--device auto|cpu|cuda]
                                   [--parts overhead-torch,overhead-tf,overhead-jax,compare,tune]

Run from anywhere with the Python that holds the frameworks; polyamp is used from ``src/`` (no install).
A probe (a subprocess) reads the versions and devices; then each part runs as a subprocess with its own
time cap: the budget left, shared out over the parts still to run by their weights (``PARTS``, off the
GPU ``CPU_WEIGHTS``), so time a part skips or leaves goes to the next ones; a part past its cap is
stopped and keeps what it printed (status ``partial``). Parts, in this order:

- ``overhead-torch`` / ``overhead-tf`` / ``overhead-jax``: ``overhead_torch.py`` (on CUDA with
  ``--device cuda --batch-mult 16 --repeats 15 --fp16-repeats 15``, the earlier H200 run's options),
  ``overhead_tensorflow.py`` and ``overhead_jax.py`` (on the framework's default device, 15 repeats),
  their printed rows collected: native and polyamp steps for bf16 and fp16, paired in one process.
  Without jmp, JAX's fp16 row (against jmp's ``DynamicLossScale``) is skipped and the bf16 rows run from
  ``overhead_jax``'s own functions (``--jax-bf16-rows``).
- ``compare``: ``python -m polyamp compare --workloads mlp,charlm --budget 1`` (every framework and
  policy), its verdict and paired speed-ups; torch's compare trainer runs on the CPU, JAX's on its
  default device.
- ``tune``: ``python -m polyamp tune --workloads mlp,charlm --json`` for each framework tune is built for;
  the best configuration and the tuned bf16 / tuned float32 ratio (``speedup_over_tuned_float32``). On
  CUDA it passes ``--device cuda`` when the CLI has that option, else torch tunes on the CPU (said so).

Without CUDA every part runs small (one model, 3 repeats; compare and tune on torch's charlm: CPU smoke
figures, docs/BENCHMARKS.md's CPU sections hold the measured ones) and the files say what needs
CUDA; torch's fp16 autocast row is skipped there (no fp16 units: ~100x slower than fp32). Writes
``gpu_check.json`` (device facts, versions, each part's status, reason, command and figures),
``gpu_check.md``, ``gpu_check.log`` and compare's report as ``compare-report.md`` into ``--out``: four
files (the device tool brings back at most eight).

``benchmarks/gpu_checks.sh`` keeps the CUDA tests and the doctor, proof and quantize benchmarks; its part
``check`` runs this script, which supersedes its ``overhead`` part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# the parts in the order they run, with their weights (seconds of the default budget); compare comes
# before tune because a compare stopped at its cap writes no report, a tune keeps each model's
PARTS = {"overhead-torch": 90, "overhead-tf": 60, "overhead-jax": 60, "compare": 180, "tune": 150}
CPU_WEIGHTS = {"overhead-torch": 35, "overhead-tf": 45, "overhead-jax": 50, "compare": 35, "tune": 75}
MIN_CAP_S = 15.0  # a part with less time than this left is skipped, not started
FP16_CPU = ("this CPU has no fp16 units: torch's fp16 autocast runs ~100x slower than fp32 here (34 s a "
            "step on the MLP, docs/BENCHMARKS.md), so the CPU run leaves it out; it needs CUDA")  # fmt: skip
# a row the overhead scripts print: model, case, native ms, polyamp ms, ratio[, paired]
_NUM = r"\s+(-?\d+\.\d+)"
ROW = re.compile(rf"^(mlp|transformer|charlm)\s+(.+?){_NUM}{_NUM}{_NUM}(?:{_NUM})?$")
PROBE = r"""
import importlib, json, os, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "machine": platform.machine(),
       "cores": os.cpu_count(), "versions": {}, "errors": {}}
for name in ("numpy", "torch", "jax", "optax", "jmp", "tensorflow", "keras", "polyamp"):
    try:
        out["versions"][name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as err:
        out["errors"][name] = f"{type(err).__name__}: {err}"
if "torch" in out["versions"]:
    import torch
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": torch.cuda.get_device_name(0), "torch_cuda": torch.version.cuda,
                      "capability": list(torch.cuda.get_device_capability(0)),
                      "memory_gib": round(p.total_memory / 2**30, 1)}
if "jax" in out["versions"]:
    import jax
    out["jax_backend"] = jax.default_backend()
if "tensorflow" in out["versions"]:
    import tensorflow as tf
    out["tf_gpus"] = len(tf.config.list_physical_devices("GPU"))
print("PROBE " + json.dumps(out))
"""


class Clock:
    """The budget: seconds since the start, the time left, a part's share of it."""

    def __init__(self, budget: float):
        self.start, self.budget, self.weights = time.monotonic(), budget, PARTS

    def now(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.now()

    def cap(self, part: str, parts_left: list[str]) -> float:
        return self.left() * self.weights[part] / sum(self.weights[p] for p in parts_left)


def say(clock: Clock, text: str, log: list[str]) -> None:
    line = f"[gpu_check {clock.now():6.1f} s] {text}"
    print(line, flush=True)
    log.append(line)


def run(cmd: list[str], cap: float, env: dict, log: list[str], echo: bool = True) -> dict:
    """Run ``cmd``, echoing its lines (``echo``), stopped after ``cap`` seconds: exit code, wall time, its
    output."""
    start, lines = time.monotonic(), []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=HERE, start_new_session=True)  # fmt: skip

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                print("    | " + lines[-1], flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(cap, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    except KeyboardInterrupt:
        _stop(proc)
        raise
    reader.join(timeout=5)
    log += ["    | " + x for x in lines]
    return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(time.monotonic() - start, 1),
            "output": lines}  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def status_of(result: dict, got_figures: bool) -> tuple[str, str]:
    if result["timed_out"]:
        return ("partial" if got_figures else "failed"), f"stopped at its cap after {result['wall_s']} s"
    if result["rc"] != 0:
        tail = " / ".join(result["output"][-3:])[-400:]
        return ("partial" if got_figures else "failed"), f"exit {result['rc']}: {tail}"
    return ("ok", "") if got_figures else ("failed", "it printed no figures")


def overhead_rows(output: list[str]) -> list[dict]:
    rows = []
    for line in output:
        m = ROW.match(line.strip())
        if m:
            paired = None if m[6] is None else float(m[6])
            rows.append({"model": m[1], "case": m[2], "native_ms": float(m[3]), "polyamp_ms": float(m[4]),
                         "ratio": float(m[5]), "paired": paired})  # fmt: skip
    return rows


def overhead_plan(part: str, probe: dict, cuda: bool, py: str) -> dict:
    """The command of one overhead part, the device it measures, the cases it leaves out and why. Off
    the GPU each runs one model (the cheaper one) with 3 repeats: a smoke check of the pipeline."""
    versions, errors = probe["versions"], probe["errors"]
    framework = {"overhead-torch": "torch", "overhead-tf": "tensorflow", "overhead-jax": "jax"}[part]
    if framework not in versions:
        return {"skip": f"{framework} is not importable in this Python ({errors.get(framework)})"}
    small = "left out off the GPU, to fit the budget (docs/BENCHMARKS.md has its CPU figures)"
    if part == "overhead-torch":
        if cuda:
            args = ["--device", "cuda", "--batch-mult", "16", "--repeats", "15", "--fp16-repeats", "15"]
            return {"cmd": [py, "overhead_torch.py", *args], "device": "cuda", "left_out": {}}
        args = ["--device", "cpu", "--models", "transformer", "--repeats", "3", "--fp16-repeats", "0"]
        return {"cmd": [py, "overhead_torch.py", *args], "device": "cpu",
                "left_out": {"fp16 (autocast fp16)": FP16_CPU, "mlp": small}}  # fmt: skip
    if part == "overhead-tf":
        gpu = probe.get("tf_gpus", 0) > 0
        args = ["--repeats", "15", "--fp16-repeats", "15"]
        left = {} if gpu or not cuda else {"GPU": "this TensorFlow sees no GPU: the rows measure the CPU"}
        if not gpu:
            args = ["--models", "charlm", "--repeats", "3", "--fp16-repeats", "1"]
            left["mlp"] = small
        cmd = [py, "overhead_tensorflow.py", *args]
        return {"cmd": cmd, "device": "gpu" if gpu else "cpu", "left_out": left}
    gpu = probe.get("jax_backend") == "gpu"
    args, left = ["--repeats", "15"], {}
    if not gpu:
        args, left = ["--models", "charlm", "--repeats", "3"], {"mlp": small}
    cmd = [py, "overhead_jax.py", *args]
    if "jmp" not in versions:
        cmd = [py, "gpu_check.py", "--jax-bf16-rows", *args]  # the parts run in HERE
        left["fp16 vs jmp DynamicLossScale"] = (f"jmp is not installed ({errors.get('jmp')}): this row times "
                                                "jmp's DynamicLossScale idiom")  # fmt: skip
    return {"cmd": cmd, "device": probe.get("jax_backend"), "left_out": left}


def jax_bf16_rows(repeats: int, models: str) -> None:
    """``overhead_jax.py``'s bf16 rows, from its own functions, where jmp (its fp16 row's peer) is missing."""
    sys.modules.setdefault("jmp", types.ModuleType("jmp"))  # overhead_jax imports it at the top
    sys.path.insert(0, str(HERE))
    import jax
    import overhead_jax as oj
    from _timing import ratio_row, run_paired

    print(f"jax {jax.__version__} ({jax.default_backend()}), no jmp: bf16 rows only, median step time")
    for name in models.split(","):
        contenders = {"native": oj.native_bf16(name), "guarded": oj.polyamp_step(name, "bf16-mixed"),
                      "guard=False": oj.polyamp_step(name, "bf16-mixed", guard=False)}  # fmt: skip
        t = run_paired(contenders, repeats)
        print(ratio_row(name, "bf16 guarded vs native", t["native"], t["guarded"]), flush=True)
        print(ratio_row(name, "bf16 guard=False vs native", t["native"], t["guard=False"]), flush=True)


def tune_reports(stdout: list[str], folder: Path) -> list[dict]:
    """The reports from ``--json``'s output, else (stopped early) the per-model files written so far."""
    text = "\n".join(stdout)
    start = text.find("[\n")
    if start >= 0:
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            pass
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def tune_figures(report: dict) -> dict:
    best = report.get("best") or {}
    settings = (best.get("settings") or {}).items()
    label = " ".join([best.get("policy", "none"), *(f"{k}={v}" for k, v in settings)])
    final = [{"key": f["key"], "label": f["label"], "error": f["error"],
              "step_ms": None if f["step_s"] is None else f["step_s"] * 1e3,
              "speedup_over_float32_default": f["speedup"]} for f in report["final"]]  # fmt: skip
    statuses: dict[str, int] = {}
    for t in report["trials"]:
        statuses[t["status"]] = statuses.get(t["status"], 0) + 1
    return {"framework": report["framework"], "workload": report["name"], "best": label,
            "speedup_over_tuned_float32": report["speedup_over_tuned_float32"], "final": final,
            "reasons": report["reasons"], "trials": statuses, "budget_s": report["budget_s"],
            "spent_s": report["spent_s"], "parity_steps": report["parity_steps"], "rtol": report["rtol"],
            "report": report}  # fmt: skip


def built_on() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT / "src"))
    from polyamp.tune import BUILT_ON  # imports no framework

    return BUILT_ON


def compare_figures(folder: Path) -> dict | None:
    path = folder / "report.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    keys = ("framework", "workload", "policy", "status", "median_step_s", "speedup", "speedup_ci95",
            "speedup_rounds", "parity", "steps", "capped", "error")  # fmt: skip
    rows = [{k: r.get(k) for k in keys} for r in doc["rows"]]
    return {"verdict": doc["verdict"], "rows": rows, "settings": doc["settings"]}


def _md_overhead(parts: dict) -> list[str]:
    out = ["### polyamp's step against native AMP", "",
           "Ratio polyamp / native of median step times (paired: the median of per-round ratios, where the "
           "script prints it); native step in ms.", ""]  # fmt: skip
    for name in ("overhead-torch", "overhead-tf", "overhead-jax"):
        p = parts.get(name)
        if p is None:
            continue
        why = f": {p['reason']}" if p["reason"] else ""
        out.append(f"- **{name}** ({p.get('device') or '-'}): {p['status']}{why}")
        if p.get("command"):
            out.append(f"  `{p['command']}`")
        for case, why in (p.get("left_out") or {}).items():
            out.append(f"  - left out: {case}: {why}")
    out += ["", "| script | model | case | native ms | polyamp ms | ratio | paired |",
            "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for name in ("overhead-torch", "overhead-tf", "overhead-jax"):
        for r in (parts.get(name) or {}).get("figures") or []:
            paired = "-" if r["paired"] is None else f"{r['paired']:.3f}"
            out.append(f"| {name} | {r['model']} | {r['case']} | {r['native_ms']:.1f} | "
                       f"{r['polyamp_ms']:.1f} | {r['ratio']:.3f} | {paired} |")  # fmt: skip
    return out + [""]


def _md_tune(p: dict) -> list[str]:
    out = ["### polyamp tune", "", f"{p['status']}" + (f": {p['reason']}" if p["reason"] else ""), ""]
    out += [f"- left out: {case}: {why}" for case, why in (p.get("left_out") or {}).items()]
    out += [f"- `{c}`" for c in p.get("commands") or []] + [""]
    out += ["| framework | workload | best | tuned bf16 / tuned float32 | best step ms | tune spent / "
            "budget s | trials |", "|---|---|---|---|---:|---:|---|"]  # fmt: skip
    for f in p.get("figures") or []:
        ratio = (f["speedup_over_tuned_float32"] or {}).get("bf16-mixed")
        ratio = "-" if not ratio else "{:.2f}x ({:.2f}-{:.2f})".format(ratio["speedup"], *ratio["ci95"])
        steps = [x["step_ms"] for x in f["final"] if x["step_ms"] is not None]
        best_ms = f"{min(steps):.1f}" if steps else "-"
        trials = ", ".join(f"{n} {status}" for status, n in f["trials"].items())
        out.append(f"| {f['framework']} | {f['workload']} | {f['best']} | {ratio} | {best_ms} | "
                   f"{f['spent_s']:.0f} / {f['budget_s']:.0f} | {trials} |")  # fmt: skip
    out.append("")
    for f in p.get("figures") or []:
        for x in f["final"]:
            ms = "-" if x["step_ms"] is None else f"{x['step_ms']:.1f} ms"
            sp = x["speedup_over_float32_default"]
            out.append(f"- {f['framework']} {f['workload']}, {x['key']}: {x['label']}: {ms}"
                       + ("" if sp is None else f", {sp:.2f}x the float32 default"))  # fmt: skip
        out += [f"- {f['framework']} {f['workload']}: {r}" for r in f["reasons"]]
    return out + [""]


def _md_compare(p: dict) -> list[str]:
    out = ["### polyamp compare", "", f"{p['status']}" + (f": {p['reason']}" if p["reason"] else ""), ""]
    if p.get("command"):
        out += [f"`{p['command']}`", ""]
    fig = p.get("figures")
    if not fig:
        return out
    out += [f"- {s}" for s in fig["verdict"]["sentences"]] + [""]
    out += ["| framework | workload | policy | ms/step | speed-up vs own fp32 (95 % CI, rounds) | parity | "
            "status |", "|---|---|---|---:|---|---|---|"]  # fmt: skip
    for r in fig["rows"]:
        ms = "-" if r["median_step_s"] is None else f"{r['median_step_s'] * 1e3:.1f}"
        sp = "baseline" if r["policy"] == "float32" else "-"
        if r["speedup"] is not None and r["policy"] != "float32":
            ci = r["speedup_ci95"]
            sp = f"{r['speedup']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f}, {r['speedup_rounds']})" if ci else "")
        out.append(f"| {r['framework']} | {r['workload']} | {r['policy']} | {ms} | {sp} | {r['parity']} | "
                   f"{r['status']} |")  # fmt: skip
    return out + [""]


def markdown(doc: dict) -> str:
    probe, parts = doc["probe"], doc["parts"]
    gpu = (probe.get("gpu") or {}).get("name")
    where = gpu or f"no CUDA device ({probe.get('cores')} CPU cores)"
    versions = ", ".join(f"{k} {v}" for k, v in probe["versions"].items())
    out = [f"## GPU run: `benchmarks/gpu_check.py` ({where}, {doc['date'][:10]})", "",
           f"`{doc['command']}`: {doc['wall_s']:.0f} s of a {doc['budget_s']:.0f} s budget, device "
           f"`{doc['device']}`. Python {probe['python']}, {versions}; polyamp from `src/`. One run: no "
           "run-to-run spread.", ""]  # fmt: skip
    if doc["device"] != "cuda":
        out += ["**No CUDA here: CPU smoke figures** (fewer repeats and models; docs/BENCHMARKS.md's CPU "
                "sections hold the measured ones). Needs CUDA: " + "; ".join(doc["needs_cuda"]) + ".",
                ""]  # fmt: skip
    out += ["| part | status | device | wall s | reason |", "|---|---|---|---:|---|"]
    for name, p in parts.items():
        out.append(f"| {name} | {p['status']} | {p.get('device') or '-'} | {p.get('wall_s') or 0:.0f} | "
                   f"{(p['reason'] or '').replace('|', '/')} |")  # fmt: skip
    out.append("")
    if any(n.startswith("overhead") for n in parts):
        out += _md_overhead(parts)
    if "tune" in parts:
        out += _md_tune(parts["tune"])
    if "compare" in parts:
        out += _md_compare(parts["compare"])
    return "\n".join(out).rstrip() + "\n"


@dataclass
class Run:
    """What every part needs: the Python, its environment, the probe's facts, where files go."""

    clock: Clock
    log: list[str]
    py: str
    env: dict
    probe: dict
    cuda: bool
    work: Path
    out: Path

    def say(self, text: str) -> None:
        say(self.clock, text, self.log)


def overhead_part(r: Run, name: str, plan: dict, cap: float) -> dict:
    part = {"device": plan["device"], "left_out": plan["left_out"], "command": " ".join(plan["cmd"][1:])}
    r.say(f"{name}: cap {cap:.0f} s: {part['command']}")
    result = run(plan["cmd"], cap, r.env, r.log)
    part["figures"] = overhead_rows(result["output"])
    part["status"], part["reason"] = status_of(result, bool(part["figures"]))
    return {**part, "wall_s": result["wall_s"], "output_tail": result["output"][-40:]}


def compare_part(r: Run, cap: float) -> dict:
    folder = r.work / "compare"
    if r.cuda:  # the default run (every framework and policy) on tune's two workloads
        opts = ["--workloads", "mlp,charlm", "--budget", "1", "--infer-budget", "0.5", "--timeout",
                f"{max(60, cap / 3):.0f}"]  # fmt: skip
    else:
        opts = ["--frameworks", "torch", "--workloads", "charlm", "--policies", "float32,bf16-mixed",
                "--budget", "1", "--infer-budget", "0.5", "--timeout", f"{max(30, cap / 2):.0f}"]  # fmt: skip
    cmd = [r.py, "-m", "polyamp", "compare", *opts, "--out", str(folder)]
    part = {"device": f"torch: cpu, jax: {r.probe.get('jax_backend')}" if r.cuda else "cpu",
            "command": "python " + " ".join(cmd[1:]).replace(str(folder), "OUT/compare")}  # fmt: skip
    reason = "" if r.cuda else "reduced off the GPU (torch, charlm, float32, bf16) to fit the budget"
    r.say(f"compare: cap {cap:.0f} s: {part['command']}")
    result = run(cmd, cap, r.env, r.log)
    part["figures"] = compare_figures(folder)
    status, why = status_of(result, part["figures"] is not None)
    if result["rc"] == 1 and part["figures"] is not None:  # compare's exit 1: a case crashed
        status, why = "partial", "a case crashed (compare-report.md has the error)"
    if (folder / "report.md").exists():
        shutil.copy(folder / "report.md", r.out / "compare-report.md")
    return {**part, "status": status, "reason": "; ".join(filter(None, [reason, why])),
            "wall_s": result["wall_s"], "output_tail": result["output"][-40:]}  # fmt: skip


def tune_part(r: Run, cap_now) -> dict:
    """``polyamp tune`` per framework, each given ``cap_now()`` shared over the frameworks left."""
    frameworks = [f for f in built_on() if f in r.probe["versions"]]
    if not frameworks:
        return {"status": "skipped", "reason": f"tune is built for {', '.join(built_on())}, none here"}
    helptext = subprocess.run([r.py, "-m", "polyamp", "tune", "--help"], capture_output=True, text=True,
                              env=r.env, timeout=60).stdout  # fmt: skip
    on_gpu = r.cuda and "--device" in helptext
    part: dict = {"status": "ok", "reason": "", "commands": [], "figures": [], "wall_s": 0.0,
                  "output_tail": []}  # fmt: skip
    workloads = "mlp,charlm" if r.cuda else "charlm"
    if not r.cuda:  # off the GPU: one framework's charlm, with time enough to reach bf16
        part["left_out"] = {w: "left out off the GPU, to fit the budget" for w in ["mlp", *frameworks[1:]]}
        frameworks = frameworks[:1]
    where = {"torch": "cuda" if on_gpu else "cpu", "jax": r.probe.get("jax_backend"),
             "tensorflow": "gpu" if r.probe.get("tf_gpus") else "cpu"}  # fmt: skip
    part["device"] = ", ".join(f"{f}: {where.get(f, '?')}" for f in frameworks)
    if r.cuda and not on_gpu:
        part["reason"] = "tune's CLI has no --device option yet: it tuned on the CPU"
    for j, fw in enumerate(frameworks):
        share = cap_now() / (len(frameworks) - j)
        # tune keeps to its --budget per model, beside its start-up (imports, first builds)
        per_model = max(10.0, round((share - 15) * 0.85 / len(workloads.split(","))))
        folder = r.work / f"tune-{fw}"
        cmd = [r.py, "-m", "polyamp", "tune", "--workloads", workloads, "--framework", fw,
               "--budget", f"{per_model:g}", "--json", "--out", str(folder)]  # fmt: skip
        cmd += ["--device", "cuda"] if on_gpu and fw == "torch" else []  # JAX and TF: their default
        part["commands"].append("python " + " ".join(cmd[1:]).replace(str(folder), f"OUT/tune-{fw}"))
        r.say(f"tune: cap {share:.0f} s: {part['commands'][-1]}")
        result = run(cmd, share, r.env, r.log, echo=False)  # its JSON: the summary below says it
        found = [tune_figures(rep) for rep in tune_reports(result["output"], folder)]
        for f in found:
            ratio = (f["speedup_over_tuned_float32"] or {}).get("bf16-mixed")
            ratio = f"{ratio['speedup']:.2f}x" if ratio else "not timed"
            r.say(f"tune: {fw} {f['workload']}: best {f['best']}; tuned bf16 / tuned float32 {ratio}; "
                  f"{f['spent_s']:.0f} s of a {f['budget_s']:.0f} s budget")  # fmt: skip
        status, why = status_of(result, bool(found))
        untimed = [f["workload"] for f in found if not any(f["speedup_over_tuned_float32"].values())]
        if status == "ok" and untimed:
            status, why = "partial", f"no low-precision step timed on {', '.join(untimed)} (budget)"
        if status != "ok":
            print("\n".join("    | " + x for x in result["output"][-10:]), flush=True)
            part["reason"] = "; ".join(filter(None, [part["reason"], f"{fw}: {status}: {why}"]))
            part["status"] = status if part["status"] == "ok" else part["status"]
        part["figures"] += found
        part["wall_s"] = round(part["wall_s"] + result["wall_s"], 1)
        part["output_tail"] += result["output"][-20:]
    return part


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for everything (default 540)")
    ap.add_argument("--out", default="gpu-check", help="output folder (default gpu-check)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--work", help="folder for the parts' own outputs (default: a temporary one)")
    ap.add_argument("--jax-bf16-rows", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--models", default="mlp,charlm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.jax_bf16_rows:
        jax_bf16_rows(args.repeats, args.models)
        return 0
    asked = [p for p in args.parts.split(",") if p]
    unknown = [p for p in asked if p not in PARTS]
    if unknown or args.budget <= 0:
        ap.error(f"--parts takes {', '.join(PARTS)} (received {', '.join(unknown)}); --budget > 0")
    clock, log = Clock(args.budget), []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check-")).resolve()  # the parts run in HERE
    py = sys.executable
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    say(clock, f"probe: versions and devices ({py})", log)
    probe_run = run([py, "-c", PROBE], min(120.0, max(45.0, clock.left() / 3)), env, log)
    line = next((x for x in probe_run["output"] if x.startswith("PROBE ")), None)
    if line is None:
        why = "stopped at its cap" if probe_run["timed_out"] else f"exit {probe_run['rc']}"
        say(clock, f"the probe failed ({why}): {' / '.join(probe_run['output'][-5:])}", log)
        (out / "gpu_check.json").write_text(json.dumps({"probe_failed": why, "output": probe_run["output"]}))
        (out / "gpu_check.log").write_text("\n".join(log) + "\n")
        return 1
    probe = json.loads(line[6:])
    cuda = probe.get("cuda", False) if args.device == "auto" else args.device == "cuda"
    if cuda and not probe.get("cuda"):
        ap.error("--device cuda, but torch sees no CUDA device here")
    clock.weights = PARTS if cuda else CPU_WEIGHTS
    r = Run(clock, log, py, env, probe, cuda, work, out)
    r.say(f"device {'cuda' if cuda else 'cpu'}: {(probe.get('gpu') or {}).get('name') or 'no CUDA device'}; "
          f"{probe['versions']}")  # fmt: skip
    parts: dict[str, dict] = {}
    plans = {p: overhead_plan(p, probe, cuda, py) for p in asked if p.startswith("overhead")}
    for name, plan in plans.items():
        if "skip" in plan:
            parts[name] = {"status": "skipped", "reason": plan["skip"]}
            r.say(f"{name}: skipped: {plan['skip']}")
    chosen = [p for p in PARTS if p in asked and p not in parts]  # the order of PARTS
    for i, name in enumerate(chosen):
        cap = clock.cap(name, chosen[i:])
        if cap < MIN_CAP_S:
            part = {"status": "skipped", "reason": f"the budget was spent ({cap:.0f} s left for it)"}
        elif name.startswith("overhead"):
            part = overhead_part(r, name, plans[name], cap)
        elif name == "compare":
            part = compare_part(r, cap)
        else:
            part = tune_part(r, lambda i=i, name=name: clock.cap(name, chosen[i:]))
        parts[name] = part
        r.say(f"{name}: {part['status']}" + (f": {part['reason']}" if part["reason"] else ""))
    needs_cuda = [] if cuda else [
        "torch's fp16 autocast row (skipped here)", "every step timed on the GPU (torch with --device cuda "
        "--batch-mult 16, JAX and TensorFlow on their GPU backends)", "tune on the GPU (once its CLI takes "
        "--device cuda)"]  # fmt: skip
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]), "budget_s": args.budget,
           "wall_s": round(clock.now(), 1), "device": "cuda" if cuda else "cpu", "needs_cuda": needs_cuda,
           "probe": probe, "parts": {p: parts[p] for p in PARTS if p in parts}}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(doc))
    r.say(f"wrote {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    (out / "gpu_check.log").write_text("\n".join(log) + "\n")
    return 0 if all(p["status"] in ("ok", "skipped") for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
