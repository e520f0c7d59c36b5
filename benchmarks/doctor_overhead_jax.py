"""What the doctor's JAX taps cost: a plain float32 training step against ``collect`` of one step.

    python benchmarks/doctor_overhead_jax.py [--workloads mlp,charlm] [--repeats 7] [--quick]

The compare workloads' JAX networks (``polyamp.compare.jax``: same weights, batch 0, optax Adam as compare
trains them). Cases, each against the plain step (one jitted ``value_and_grad`` + ``adam.update`` +
``apply_updates``, params and Adam state donated, as compare's trainer runs it):
- ``collect(..., optimizer=(adam, state))``: one tapped step with update ratios, from the live Adam state;
- ``collect(...)``: no optimizer, so no update ratios;
- ``collect(..., steps=4, optimizer=(adam, state))`` divided by 4: four tapped steps, each from the last.
``collect`` compiles its program once per (loss, optimizer, shapes); the first calls (trace, compile and
one run) are timed apart, the plain step's too, and left out of the rounds. Contenders alternate in
rotating rounds in one process; medians after one warm-up call each, and the median of the per-round
ratios. The issue's budget: 1.5x.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)

from polyamp.compare import jax as compare_jax
from polyamp.compare.workloads import get_workload
from polyamp.jax.doctor import collect


def setup(name: str, quick: bool):
    wl = get_workload(name, quick=quick)
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    adam = optax.adam(wl.lr)
    batch = compare_jax.inputs(wl, *wl.batch_at(0))

    def loss(p, b):
        return compare_jax.loss_fn(wl, p, *b)

    return params, adam, batch, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (a smoke run)")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].platform}, float32, Adam")
    print(f"{'workload':8s} {'case':34s} {'plain ms':>10s} {'tapped ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        measure(name, args.quick, args.repeats)


def measure(name: str, quick: bool, repeats: int) -> None:
    params, adam, batch, loss = setup(name, quick)

    def train_step(p, s, b):
        grads = jax.grad(loss)(p, b)
        updates, s = adam.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(train_step, donate_argnums=(0, 1))
    live = [params, adam.init(params)]  # the run's params and Adam state, threaded through the plain step

    def plain():
        live[:] = step(*live, batch)
        jax.block_until_ready(live)

    start = time.perf_counter()
    plain()
    compile_s = {"plain step": time.perf_counter() - start}
    for case, kwargs in (("no optimizer", {}), ("optimizer", {"optimizer": (adam, live[1])}),
                         ("steps=4 optimizer", {"steps": 4, "optimizer": (adam, live[1])})):  # fmt: skip
        start = time.perf_counter()
        collect(live[0], batch, loss, **kwargs)
        compile_s[case] = time.perf_counter() - start

    def tapped(steps=1, stepped=True):  # on the live params and Adam state of the moment of the call
        return lambda: collect(live[0], batch, loss, steps=steps,
                               optimizer=(adam, live[1]) if stepped else None)  # fmt: skip

    runs = run_paired({
        "plain": plain,
        "collect, with optimizer": tapped(),
        "collect, no optimizer": tapped(stepped=False),
        "collect steps=4 optimizer, /4": tapped(steps=4),
    }, repeats)  # fmt: skip
    median, rounds = runs["collect steps=4 optimizer, /4"]
    runs["collect steps=4 optimizer, /4"] = (median / 4, [t / 4 for t in rounds])
    for case in list(runs)[1:]:
        print(ratio_row(name, case, runs["plain"], runs[case]), flush=True)
    print(f"{name:8s} first calls (trace, compile, run): "
          + ", ".join(f"{case} {s:.2f} s" for case, s in compile_s.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
