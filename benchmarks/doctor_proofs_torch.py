"""The doctor's predictions against real PyTorch runs (issue 14, must-show 2, 3, 4).

    python benchmarks/doctor_proofs_torch.py [--only overflow,loss_scale,lost_updates] [--quick] [--json]
                                             [--device cpu|cuda]

Each check builds a small model, asks ``polyamp.doctor`` (one float32 step), then trains as told and
compares. Prints each check's figures (``--json``: one JSON object instead); exits 1 if a claim fails.
``--quick`` is the tests' size (tests/test_doctor_proofs.py). fp16 runs use polyamp's torch front end
(``MixedPrecision("fp16-mixed", ...)``, autocast on the CPU) with Adam, kept small: torch's CPU fp16 matmuls
are slow. ``--device cuda`` runs every model and batch on a GPU (the same weights and data: both are made
on the CPU and moved), where fp16 autocast runs at speed.

overflow: an MLP ``fc1 -> act1 -> big -> norm -> act2 -> head`` whose ``big`` Linear has its weights
multiplied by ``BIG_GAIN``: its output runs far past fp16's 65504 while its weights fit, and the LayerNorm
brings it back. Claims: the doctor's fp16 check flags ``big`` first (``findings[0]``, ``worst(1)``,
``keep_fp32 == ("big",)``); fp16-mixed training without keep_fp32 (debug=True, mp.watch) skips every step
and polyamp's first-non-finite tracer names ``big``, in ``res.origin`` and in the NonFiniteError raised
after ``MAX_SKIPS`` skips; with ``keep_fp32=report.keep_fp32, loss_scale=report.loss_scale`` the same run
completes, skips no step in its second half (the skipped steps are listed with their origin: a dynamic
scale backs off once where a gradient grows past the doctor's 2x margin) and its loss falls.

loss_scale: a regression MLP with a sum-reduced MSE, so its largest gradient at init (printed) times 2^16
overflows fp16. fp16-mixed training from the doctor's initial scale, from 2^16 and from 2^24
(``DynamicLossScale(init_scale=...)``; same seed, data and model): skipped steps and the final loss (mean
of the last ``TAIL`` steps). The noise is the spread (max - min) of the recommended run's final loss over 3
seeds (model init and batch order). Claims: fewer skips at the recommended scale than at 2^16 and than at
2^24; the recommended run's final loss no worse than either's plus the noise. Whether each difference is
within the noise is printed: a run that skips its first k steps trails by k steps, which shows while the
loss still falls.

lost_updates: pure bf16 (``model.to(torch.bfloat16)``, no fp32 master copy), one SGD step (no momentum)
at each learning rate of ``LRS``, small to large. SGD because its bf16 update is the one the doctor models:
``p.add_(g, alpha=-lr)`` forms ``lr * g`` in bf16 arithmetic and adds it to ``w``, rounding to bf16, so an
update is lost when ``|lr * g| < ulp(w) / 2`` up to the bf16 rounding of ``lr * g`` (relative 2^-9); Adam's
first update is ~lr whatever the gradient (the lost share would only reflect the weights' binades) and its
bf16 moments add roundings of their own. Predicted: per layer,
``formats["bf16"]["lost"]`` of the ``update_ratio`` row from the float32 observation at the same lr.
Observed: the share of the layer's parameters that the real bf16 step (``torch.optim.SGD.step``) left
unchanged although their bf16 gradient was non-zero (a zero gradient is a zero update, which the doctor
counts apart as ``zero_update``). What makes the two differ, and how the comparison is kept fair:
- the weights' binades: fp32 weights rounded to bf16 can move up a binade (``2^b(w)`` sets the ulp), so
  both runs start from the same bf16-representable weights (and inputs);
- the gradient and update: the real step computes them in bf16 (each element off by ~2^-8 relative, more
  where a sum cancels), so updates within that of the threshold ``2^-8 * 2^b(w)`` fall the other way.
  Column "fp32 g" applies the float32 update to the bf16 weights (one rounding): the gap without this;
- updates lost in float32 itself: below half a float32 ulp, the fp32 step's update is exactly 0, which
  the doctor counts as a zero update, not a lost one; the bf16 step loses it. Column "fp32 0" is their
  share: at a small lr, predicted + fp32 0 = observed to 0.01 points;
- the model of a lost update: a weight exactly at a power of two whose update points toward zero has
  half the spacing below it (the doctor counts it lost, kept when ``r > 2^-9``); a tie ``r == 2^-8``
  depends on the weight's last bit. Both are rare.
The lost share falls only as ~1/lr (the density of small gradients near zero), so plain SGD keeps under
5% lost only at a learning rate far above what this model trains at: that is the doctor's point.
Claims: every layer within ``LOST_TOLERANCE`` (2 percentage points) at every lr;
``checks["bf16-mixed"].master_weights`` True at the smallest lr, False at the largest.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
import warnings
from collections import OrderedDict

import torch
from torch import nn

import polyamp

BIG_GAIN = 2.5e5  # big's weights stay below 2^15 (fp16 holds them), its output reaches ~3e5
MAX_SKIPS = 50  # consecutive skips before NonFiniteError in the run without keep_fp32
TAIL = 20  # final loss: the mean of the last TAIL steps
LOST_TOLERANCE = 0.02
SIZES = {  # full, quick: (steps, width, batch)
    "overflow": ((200, 64, 64), (60, 32, 32)),
    "loss_scale": ((200, 128, 64), (60, 64, 32)),
    "lost_updates": ((1, 256, 128), (1, 96, 64)),
}
LRS = ((1e-3, 1e-2, 1e-1, 1.0, 10.0), (1e-2, 10.0))  # SGD learning rates, full and quick, small to large


DEVICE = "cpu"  # --device


# -- helpers -----------------------------------------------------------------------------------------
def mlp(sizes, seed: int) -> nn.Sequential:
    """Linear layers of ``sizes`` with ReLU between them, named ``fc1, act1, fc2, ...``."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), 1):
        layers.append((f"fc{i}", nn.Linear(a, b)))
        if i < len(sizes) - 1:
            layers.append((f"act{i}", nn.ReLU()))
    return nn.Sequential(OrderedDict(layers)).to(DEVICE)


def batches(n: int, batch: int, d_in: int, seed: int, teacher: nn.Module, classes: bool):
    """``n`` batches (x, y): x standard normal, y the fixed ``teacher``'s output (class or value)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(batch, d_in, generator=g).to(DEVICE)
            y = teacher(x)
            out.append((x, y.argmax(-1) if classes else y))
    return out


def train_fp16(model, data, loss_fn, *, loss_scale=None, keep_fp32=(), lr=1e-3, debug=True) -> dict:
    """fp16-mixed training with Adam through polyamp's torch front end, one batch per step: the steps
    skipped, the loss per step, the first non-finite origin, the NonFiniteError message if one stopped it."""
    mp = polyamp.MixedPrecision(
        "fp16-mixed", framework="torch", device=DEVICE, loss_scale=loss_scale, keep_fp32=keep_fp32,
        debug=debug,
    )
    mp.watch(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    skipped, losses, origins, error, scales = [], [], [], None, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 autocast on CPU is slow: known
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            with mp.autocast():
                loss = loss_fn(model(x), y)
            losses.append(loss.detach().item())
            mp.backward(loss)
            scales.append(mp.current_scale)
            try:
                res = mp.step(opt)
            except polyamp.NonFiniteError as err:
                skipped.append(step)
                error = str(err)
                break
            if not res.stepped:
                skipped.append(step)
                origins.append(res.origin)
    return {"skipped": skipped, "losses": losses, "origins": origins, "error": error, "scales": scales}


def origin_layer(origin: str | None) -> str | None:
    """The layer a tracer origin names ("forward output of big" -> "big")."""
    found = re.search(r" of (\S+)$", origin or "")
    return found.group(1) if found else None


def pow2(scale: float) -> str:
    return f"2^{math.log2(scale):g}"


# -- 2. overflow -------------------------------------------------------------------------------------
def overflow(quick: bool = False) -> dict:
    """A layer whose output overflows fp16: flagged by the doctor, named by the tracer, fixed by keep_fp32."""
    steps, width, batch = SIZES["overflow"][quick]
    d_in, classes = 16, 8

    def model_at(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(d_in, width),
                act1=nn.ReLU(),
                big=nn.Linear(width, width),
                norm=nn.LayerNorm(width),
                act2=nn.ReLU(),
                head=nn.Linear(width, classes),
            )
        )
        with torch.no_grad():
            m.big.weight.mul_(BIG_GAIN)
        return m.to(DEVICE)

    model = model_at(0)
    data = batches(steps, batch, d_in, 1, mlp([d_in, 32, classes], seed=2), classes=True)
    loss_fn = nn.functional.cross_entropy
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # the proofs run fp16 on purpose, on a CPU too: the recommendation as where fp16 is fast
    report = polyamp.doctor(model, data[0], loss_fn, optimizer=opt, device="cuda")
    check = report.recommendation.checks["fp16-mixed"]
    first = check.findings[0] if check.findings else None
    out_row = next(r for r in report.rows if (r.layer, r.kind) == ("big", "output"))
    plain = train_fp16(
        model_at(0), data, loss_fn, loss_scale=polyamp.DynamicLossScale(max_consecutive_skips=MAX_SKIPS)
    )
    kept = train_fp16(model_at(0), data, loss_fn, loss_scale=report.loss_scale, keep_fp32=report.keep_fp32)
    late = [s for s in kept["skipped"] if s >= steps // 2]
    head, tail = mean(kept["losses"][:TAIL]), mean(kept["losses"][-TAIL:])
    figures = {
        "big_output_amax": out_row.amax,
        "big_output_fp16_overflow": out_row.formats["fp16"]["overflow"],
        "first_finding": None if first is None else [first.layer, first.kind, first.problem, first.line],
        "worst": [report.worst(1)[0].layer, report.worst(1)[0].kind],
        "keep_fp32": list(report.keep_fp32),
        "policy": report.policy,
        "initial_scale": report.initial_scale,
        "without_keep": {
            "steps_run": len(plain["losses"]),
            "skipped": len(plain["skipped"]),
            "first_origin": plain["origins"][0] if plain["origins"] else None,
            "error": plain["error"],
        },
        "with_keep": {
            "steps": len(kept["losses"]),
            "skipped_steps": kept["skipped"],
            "origins": kept["origins"],
            "error": kept["error"],
            "loss_first": head,
            "loss_last": tail,
        },
    }
    traced = origin_layer(figures["without_keep"]["first_origin"])
    claims = {
        "doctor flags big first (finding, worst, keep_fp32)": first is not None
        and (first.layer, first.problem) == ("big", "overflow")
        and figures["worst"][0] == "big"
        and report.keep_fp32 == ("big",),
        "without keep_fp32 the tracer names big (res.origin, NonFiniteError)": traced == "big"
        and "'forward output of big'" in (plain["error"] or ""),
        "without keep_fp32 every step is skipped": len(plain["skipped"]) == len(plain["losses"]),
        "with keep_fp32 no skip in the run's second half (the scale has settled)": not late
        and kept["error"] is None
        and len(kept["losses"]) == steps,
        "with keep_fp32 the loss falls": tail < head,
    }
    return {"figures": figures, "claims": claims}


# -- 3. loss scale -----------------------------------------------------------------------------------
def loss_scale(quick: bool = False) -> dict:
    """Training from the doctor's initial loss scale skips fewer steps than from 2^16 or 2^24."""
    steps, width, batch = SIZES["loss_scale"][quick]
    d_in, d_out = 32, 8
    sizes = [d_in, width, width, d_out]
    teacher = mlp([d_in, 64, d_out], seed=100)

    def loss_fn(out, y):
        return nn.functional.mse_loss(out.float(), y, reduction="sum")

    def data_at(seed):
        return batches(steps, batch, d_in, 1000 + seed, teacher, classes=False)

    model = mlp(sizes, seed=0)
    data = data_at(0)
    report = polyamp.doctor(model, data[0], loss_fn, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                            device="cuda")  # fp16's recommendation, wherever the proof runs  # fmt: skip
    grads = [r.amax for r in report.rows if r.kind in ("grad_output", "grad_weight")]
    rec = report.initial_scale
    runs = {}
    for name, scale in (("recommended", rec), ("2^16", 2.0**16), ("2^24", 2.0**24)):
        runs[name] = train_fp16(
            mlp(sizes, seed=0),
            data,
            loss_fn,
            debug=False,
            loss_scale=polyamp.DynamicLossScale(init_scale=scale),
        )
    finals = {name: mean(r["losses"][-TAIL:]) for name, r in runs.items()}
    seeds = [finals["recommended"]]
    for seed in (1, 2):
        r = train_fp16(
            mlp(sizes, seed=seed),
            data_at(seed),
            loss_fn,
            debug=False,
            loss_scale=polyamp.DynamicLossScale(init_scale=rec),
        )
        seeds.append(mean(r["losses"][-TAIL:]))
    noise = max(seeds) - min(seeds)
    skips = {name: len(r["skipped"]) for name, r in runs.items()}
    figures = {
        "largest_gradient": max(grads),
        "recommended_scale": rec,
        "recommended": pow2(rec),
        "reason": report.recommendation.checks["fp16-mixed"].loss_scale_reason,
        "steps": steps,
        "skipped": skips,
        "skipped_steps": {name: r["skipped"] for name, r in runs.items()},
        "final_scale": {name: r["scales"][-1] for name, r in runs.items()},
        "final_loss": finals,
        "final_loss_seeds_recommended": seeds,
        "noise": noise,
    }
    claims = {}
    for name in ("2^16", "2^24"):
        claims[f"fewer skips at the recommended scale than at {name}"] = skips["recommended"] < skips[name]
    for name in ("2^16", "2^24"):
        no_worse = finals["recommended"] <= finals[name] + noise
        claims[f"final loss at the recommended scale no worse than at {name}, within noise"] = no_worse
    return {"figures": figures, "claims": claims}


# -- 4. bf16 lost updates ----------------------------------------------------------------------------
def lost_updates(quick: bool = False) -> dict:
    """Predicted vs observed share of lost updates per layer in a pure-bf16 SGD step, at each of LRS."""
    _, width, batch = SIZES["lost_updates"][quick]
    d_in, classes = 64, 10
    sizes = [d_in, width, width, width // 2, classes]
    teacher = mlp([d_in, 64, classes], seed=200)
    x, y = batches(1, batch, d_in, 300, teacher, classes=True)[0]
    x = x.bfloat16().float()  # both runs see the same bf16-representable inputs ...
    base = mlp(sizes, seed=3)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(p.bfloat16().float())  # ... and start from the same bf16-representable weights
    loss_fn = nn.functional.cross_entropy
    fp32 = copy.deepcopy(base)
    loss_fn(fp32(x), y).backward()
    low = copy.deepcopy(base).to(torch.bfloat16)
    loss_fn(low(x.bfloat16()).float(), y).backward()
    runs = []
    for lr in LRS[quick]:
        model = copy.deepcopy(base)
        report = polyamp.doctor(model, (x, y), loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
        predicted = {r.layer: r.formats["bf16"]["lost"] for r in report.rows if r.kind == "update_ratio"}
        stepped = copy.deepcopy(low)
        for a, b in zip(stepped.parameters(), low.parameters()):
            a.grad = b.grad.clone()
        torch.optim.SGD(stepped.parameters(), lr=lr).step()  # the real pure-bf16 step
        layers = {name: _observe(name, lr, low, stepped, fp32) for name in predicted}
        for name, v in layers.items():
            v["predicted"] = predicted[name]
        n = sum(v["elements"] for v in layers.values())
        check = report.recommendation.checks["bf16-mixed"]
        runs.append(
            {
                "lr": lr,
                "layers": layers,
                "max_gap": max(abs(v["predicted"] - v["observed"]) for v in layers.values()),
                "predicted": sum(v["predicted"] * v["elements"] for v in layers.values()) / n,
                "observed": sum(v["observed"] * v["elements"] for v in layers.values()) / n,
                "master_weights": check.master_weights,
                "master_weights_reason": check.master_weights_reason,
            }
        )
    worst = max(runs, key=lambda r: r["max_gap"])
    claims = {
        f"every layer within {LOST_TOLERANCE:.0%} at every lr": worst["max_gap"] <= LOST_TOLERANCE,
        f"master weights at the small lr {runs[0]['lr']:g}": runs[0]["master_weights"] is True,
        f"no master weights at the large lr {runs[-1]['lr']:g}": runs[-1]["master_weights"] is False,
    }
    figures = {"sgd": "no momentum", "runs": runs, "max_gap": worst["max_gap"], "max_gap_lr": worst["lr"]}
    return {"figures": figures, "claims": claims}


def _observe(layer: str, lr: float, low: nn.Module, stepped: nn.Module, fp32: nn.Module) -> dict:
    """Shares of ``layer``'s parameters: "observed", left unchanged by the bf16 step (``low`` before,
    ``stepped`` after) although their bf16 gradient is non-zero; "fp32_g", the same for ``w - lr * g`` with
    the float32 gradient, rounded once to bf16; "fp32_zero", those whose float32 update is itself 0 although
    their gradient is not (below half a float32 ulp: the doctor counts a zero update, the bf16 step a lost
    one)."""
    counts = {"observed": 0, "fp32_g": 0, "fp32_zero": 0}
    total = 0
    for name, p in low.named_parameters():
        if name.rsplit(".", 1)[0] != layer:
            continue
        w, g, after = p.detach(), p.grad, stepped.get_parameter(name).detach()
        g32 = fp32.get_parameter(name).grad
        w32 = w.float()
        counts["observed"] += int(((after == w) & (g != 0)).sum())
        counts["fp32_g"] += int((((w32 - lr * g32).bfloat16() == w) & (g32 != 0)).sum())
        counts["fp32_zero"] += int((((w32 - lr * g32) == w32) & (g32 != 0)).sum())
        total += w.numel()
    return {"elements": total, **{k: v / total for k, v in counts.items()}}


def spans(steps: list[int]) -> str:
    """[0, 1, 2, 7] -> "0-2, 7"."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out) or "-"


def mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# -- printing ----------------------------------------------------------------------------------------
def show(name: str, result: dict) -> None:
    f = result["figures"]
    print(f"\n== {name} ({result['seconds']:.1f} s)")
    if name == "overflow":
        print(
            f"big output: max {f['big_output_amax']:.3g}, {f['big_output_fp16_overflow']:.1%} overflow fp16"
        )
        print(
            f"doctor: policy {f['policy']}, keep_fp32 {f['keep_fp32']}, initial scale {f['initial_scale']:g}"
        )
        print(f"  first finding: {f['first_finding']}")
        print(f"  worst row: {f['worst']}")
        w, k = f["without_keep"], f["with_keep"]
        print(
            f"fp16-mixed, no keep_fp32: {w['skipped']} of {w['steps_run']} steps skipped; first origin: "
            f"{w['first_origin']!r}"
        )
        said = re.search(r"the first non-finite value came from '[^']*'", w["error"] or "")
        print(f"  NonFiniteError after {MAX_SKIPS} skips: ... {said.group(0) if said else w['error']} ...")
        print(
            f"fp16-mixed, keep_fp32={tuple(f['keep_fp32'])}: {len(k['skipped_steps'])} of {k['steps']} steps "
            f"skipped (at {spans(k['skipped_steps'])}: {k['origins']}); loss {k['loss_first']:.3f} "
            f"(first {TAIL}) -> {k['loss_last']:.3f} (last {TAIL})"
        )
    elif name == "loss_scale":
        print(
            f"largest gradient at init {f['largest_gradient']:.3g}: recommended {f['recommended']} "
            f"({f['reason']})"
        )
        print(f"{'start':12s} {'skipped':>8s} {'at steps':32s} {'final scale':>12s} {'final loss':>11s}")
        for run in f["skipped"]:
            steps = spans(f["skipped_steps"][run])
            print(
                f"{run:12s} {f['skipped'][run]:>8d} {steps:32s} {pow2(f['final_scale'][run]):>12s} "
                f"{f['final_loss'][run]:>11.4f}"
            )
        seeds = ", ".join(f"{v:.4f}" for v in f["final_loss_seeds_recommended"])
        print(f"noise: the recommended run's final loss over seeds 0, 1, 2: {seeds}; spread {f['noise']:.4f}")
        for run in ("2^16", "2^24"):
            diff = f["final_loss"][run] - f["final_loss"]["recommended"]
            where = "within" if abs(diff) <= f["noise"] else "beyond"
            print(f"final loss from {run} - from recommended: {diff:+.4f} ({where} the noise)")
    else:
        print(
            f"pure bf16, one SGD step ({f['sgd']}): lost updates per layer, predicted (doctor, float32 step) "
            "and observed (bf16 step)"
        )
        print(f"largest gap {f['max_gap']:.2%} (lr {f['max_gap_lr']:g})")
        print(
            f"{'lr':>6s} {'layer':6s} {'elements':>8s} {'predicted':>9s} {'observed':>8s} {'gap':>7s} "
            f"{'fp32 g':>7s} {'fp32 0':>7s}"
        )
        for run in f["runs"]:
            rows = [
                *run["layers"].items(),
                ("all", {**run, "elements": sum(v["elements"] for v in run["layers"].values())}),
            ]
            for layer, v in rows:
                gap = v["observed"] - v["predicted"]
                extra = f"{v['fp32_g']:>7.2%} {v['fp32_zero']:>7.2%}" if layer != "all" else ""
                print(
                    f"{run['lr']:>6g} {layer:6s} {v['elements']:>8d} {v['predicted']:>9.2%} "
                    f"{v['observed']:>8.2%} {gap:>+7.2%} {extra}"
                )
            print(
                f"{'':6s} master weights (bf16-mixed): {run['master_weights']} -- "
                f"{run['master_weights_reason']}"
            )
    for claim, ok in result["claims"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {claim}")


CHECKS = {"overflow": overflow, "loss_scale": loss_scale, "lost_updates": lost_updates}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CHECKS), help="checks to run, comma-separated")
    parser.add_argument("--quick", action="store_true", help="the tests' small sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (fp16 at speed on a GPU)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check {unknown[0]!r}; accepted: {', '.join(CHECKS)}")
    if not args.json:
        cuda = DEVICE.startswith("cuda")
        where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads, CPU"
        print(f"torch {torch.__version__}, {where}")
    results = {}
    for name in names:
        start = time.perf_counter()
        results[name] = CHECKS[name](args.quick)
        results[name]["seconds"] = time.perf_counter() - start
        if not args.json:
            show(name, results[name])
    failed = [f"{n}: {c}" for n, r in results.items() for c, ok in r["claims"].items() if not ok]
    if args.json:
        out = {"torch": torch.__version__, "device": DEVICE, "quick": args.quick, "results": results}
        print(json.dumps(out, indent=1))
    elif failed:
        print("\nFAILED: " + "; ".join(failed))
    else:
        print("\nall claims hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
