"""The doctor's underflow prediction against a real fp16 step, in JAX (issue 14, must-show 1).

    python benchmarks/doctor_underflow_jax.py [--quick] [--json] [--variants]

JAX because its fp16 runs at about float32's speed on this CPU (torch's CPU fp16 matmuls are ~100x
slower). Models, each with its layers in ``jax.named_scope``s:
- ``charlm``: the compare workload's transformer (``polyamp.compare.jax``), its loss in float32 as
  compare trains it (the logits are cast up before the log-softmax);
- ``deep_mlp``: 8 tanh layers of width 256 with a 1e-3 loss weight on a mean squared error (computed
  in float32, as compare's losses are), whose activation gradients are small;
- with ``--variants``: MLPs of other depths, widths, activations and loss weights (``VARIANTS``),
  reported, not part of the claim.
Predicted: ``polyamp.doctor(params, batch, loss_fn)`` on the float32 model, per layer the share of its
output gradient ("grad_output") that flushes to zero in fp16 at loss scale 1 (``rows`` -> ``formats
["fp16"]["flush"]``). Observed: the same step run in fp16 (params and floating inputs cast to fp16,
every op computing in fp16, the loss as the model writes it), its output gradients observed by the same
taps (``polyamp.jax.doctor.collect``, which bins exactly what the fp16 program computed): the share of
elements exactly zero in fp16 less the share already zero in float32 (ReLU-like zeros are not
flushes). The same at the doctor's recommended loss scale S (the fp16 step differentiates S * loss).
Claim: every layer within 2 percentage points, at scale 1 and at S.

The prediction carries the backward chain's noise (``polyamp.doctor.chain``): the fp16 step computes
each layer's gradient from the later layers' gradients already rounded to fp16, whose subnormal and
flushed elements are off by up to half a subnormal step; that noise (relative power R, printed) lifts
some of the smallest values off zero. The model adds relative powers, which holds while R << 1; where
most gradients flush (R ~ 0.1 and more, the GELU variant) it still overstates the flush.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import polyamp as pa
from polyamp.compare import jax as compare_jax
from polyamp.compare.workloads import get_workload
from polyamp.doctor.chain import backward_noise
from polyamp.doctor.recommend import layer_table
from polyamp.jax.doctor import collect
from polyamp.numerics import get_format

TOLERANCE = 0.02  # the 2 percentage points
LOSS_WEIGHT = 1e-3


def charlm(quick: bool):
    wl = get_workload("charlm", quick=quick)
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    return params, compare_jax.inputs(wl, *wl.batch_at(0)), lambda p, b: compare_jax.loss_fn(wl, p, *b)


VARIANTS = ((12, 256, "tanh", 1e-3), (16, 128, "tanh", 1e-3), (8, 256, "tanh", 1e-2), (8, 256, "relu", 1e-3),
            (8, 128, "gelu", 1e-3))  # fmt: skip
ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": jax.nn.gelu}


def mlp(depth: int, width: int, activation: str, loss_weight: float, batch: int = 256, seed: int = 0):
    """``depth`` layers of ``width`` (the last to 1 output), a mean squared error times ``loss_weight``."""
    act, gain = ACTIVATIONS[activation], np.sqrt(2) if activation == "relu" else 1.0

    def make(quick: bool):
        rng = np.random.default_rng(seed)
        params = {}
        for i in range(depth):
            fan_out = 1 if i == depth - 1 else width
            w = rng.normal(0, gain / np.sqrt(width), (width, fan_out))
            params[f"fc{i}.w"] = jnp.asarray(w, jnp.float32)
            params[f"fc{i}.b"] = jnp.zeros(fan_out, jnp.float32)
        x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(batch, 1)), jnp.float32)

        def loss(p, b):
            h, target = b
            for i in range(depth):
                with jax.named_scope(f"fc{i}"):
                    h = h @ p[f"fc{i}.w"] + p[f"fc{i}.b"]
                    h = act(h) if i < depth - 1 else h
            return loss_weight * jnp.mean((h.astype(jnp.float32) - target) ** 2)

        return params, (x, y), loss

    return make


def deep_mlp(quick: bool):
    depth, width, batch = (4, 64, 64) if quick else (8, 256, 256)
    return mlp(depth, width, "tanh", LOSS_WEIGHT, batch)(quick)


def to_fp16(tree):
    def cast(a):
        return a.astype(jnp.float16) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree_util.tree_map(cast, tree)


def check(name: str, make, quick: bool) -> dict:
    params, batch, loss = make(quick)
    report = pa.doctor(params, batch, loss)
    scale = report.recommendation.checks["fp16-mixed"].loss_scale
    grads = [r for r in report.rows if r.kind == "grad_output"]
    fp32 = {ob.layer: ob.hist for ob in collect(params, batch, loss) if ob.kind == "grad_output"}
    low_params, low_batch = to_fp16(params), to_fp16(batch)
    fp16 = {ob.layer: ob.hist for ob in collect(low_params, low_batch, loss) if ob.kind == "grad_output"}
    scaled = {ob.layer: ob.hist for ob in collect(low_params, low_batch, lambda p, b: scale * loss(p, b))
              if ob.kind == "grad_output"}  # fmt: skip
    noise = backward_noise(layer_table(report.observations), get_format("fp16"), 1.0)
    rows = []
    for r in grads:
        h32, h16, hs = fp32[r.layer], fp16[r.layer], scaled[r.layer]
        observed = (h16.zeros - h32.zeros) / h16.total
        predicted = r.formats["fp16"]["flush"]
        rows.append({"layer": r.layer, "elements": h16.total, "predicted": predicted, "observed": observed,
                     "gap": observed - predicted, "fp32_zeros": h32.zeros / h32.total,
                     "predicted_at_scale": r.formats["fp16"]["at_recommended_scale"]["flush"],
                     "observed_at_scale": (hs.zeros - h32.zeros) / hs.total,
                     "nonfinite_at_scale": hs.nonfinite, "noise": noise[r.layer, "grad_output"]})  # fmt: skip
    worst = max(rows, key=lambda r: abs(r["gap"]))
    return {"model": name, "loss_scale": scale, "rows": rows, "largest_gap": worst["gap"],
            "largest_gap_layer": worst["layer"], "largest_noise": max(r["noise"] for r in rows),
            "beyond": [r["layer"] for r in rows if abs(r["gap"]) > TOLERANCE],
            "holds": all(abs(r["gap"]) <= TOLERANCE for r in rows),
            "holds_at_scale": all(abs(r["observed_at_scale"] - r["predicted_at_scale"]) <= TOLERANCE
                                  and not r["nonfinite_at_scale"] for r in rows)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (the tests')")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--variants", action="store_true",
                        help="also MLPs of other depths, widths, activations, loss weights")
    parser.add_argument("--seeds", default="0", help="with --variants: the seeds of their weights and data")
    args = parser.parse_args()
    results = [check("charlm", charlm, args.quick), check("deep_mlp", deep_mlp, args.quick)]
    if args.variants:  # deep_mlp's own shape too, at other seeds
        for seed in map(int, args.seeds.split(",")):
            for v in ([] if seed == 0 else [(8, 256, "tanh", LOSS_WEIGHT)]) + list(VARIANTS):
                name = "mlp {}x{} {} loss weight {:g} seed {}".format(*v, seed)
                results.append(check(name, mlp(*v, seed=seed), args.quick))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"jax {jax.__version__}: fp16 flush-to-zero of each layer's output gradient at loss scale 1")
        for res in results:
            print(f"\n== {res['model']}")
            s = res["loss_scale"]
            print(f"{'layer':18s} {'elements':>10s} {'predicted':>10s} {'observed':>10s} {'gap':>8s} "
                  f"{'fp32 zeros':>11s} {'noise R':>9s} {'pred. @S':>9s} {'obs. @S':>8s}  "
                  f"S = 2^{int(np.log2(s))}")
            for r in res["rows"]:
                print(f"{r['layer']:18s} {r['elements']:>10d} {r['predicted']:>10.2%} {r['observed']:>10.2%} "
                      f"{r['gap']:>+8.2%} {r['fp32_zeros']:>11.2%} {r['noise']:>9.2g} "
                      f"{r['predicted_at_scale']:>9.2%} {r['observed_at_scale']:>8.2%}")  # fmt: skip
            verdict = "holds" if res["holds"] else f"FAILS for {', '.join(res['beyond'])}"
            gap, layer = res["largest_gap"], res["largest_gap_layer"]
            print(f"largest gap at scale 1 {gap:+.2%} ({layer}), largest R {res['largest_noise']:.2g}; "
                  f"every layer within 2 points: {verdict}; "
                  f"at the recommended scale: {'holds' if res['holds_at_scale'] else 'FAILS'}")
    return 0 if all(r["holds"] and r["holds_at_scale"] for r in results[:2]) else 1


if __name__ == "__main__":
    sys.exit(main())
