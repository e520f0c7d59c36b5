"""polyamp's Lightning plugin against Lightning's own ``precision="bf16-mixed"`` (and, with ``--fp16``, its
``"16-mixed"`` with a GradScaler) on a Hugging Face GPT-2 under ``Trainer.fit``, paired: each round
fits both, in alternating order, and the round's ratio is polyamp's median step time over Lightning's
(steps after ``--warmup`` per fit). Prints every round and the median ratio with its range, then each
plugin's own time a step (its ``optimizer_step`` less the closure, Lightning's hooks and the
``optimizer.step`` it runs), which a noisy machine does not blur as it blurs the ratio.

    .venv/bin/python benchmarks/lightning_overhead.py --rounds 7 --steps 12
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning as L
import torch
import transformers
from lightning.pytorch.plugins import MixedPrecision as LightningMixedPrecision

import polyamp as pa
from polyamp.lightning import Precision


class GPT2Module(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=512, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip

    def training_step(self, batch, index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-4)


class StepTimes(L.Callback):
    def __init__(self):
        self.times, self._t = [], 0.0

    def on_train_batch_start(self, trainer, module, batch, index):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        self.times.append(time.perf_counter() - self._t)


def median_step(plugin, args) -> float:
    times = StepTimes()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, plugins=[plugin],
                        callbacks=[times], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 512, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    trainer.fit(GPT2Module(args), torch.utils.data.DataLoader(data, batch_size=None))
    return statistics.median(times.times[args.warmup:])


def own_time(make, args) -> float:
    """The plugin's own seconds a step (median after ``--warmup``): its ``optimizer_step`` less the closure
    (forward, backward), Lightning's ``_after_closure`` (``on_before_optimizer_step``, clipping) and the
    ``optimizer.step`` it runs."""
    plugin = make()
    inner, depth, own = [0.0], [0], []  # the closure may run inside optimizer.step(closure): timed once
    original = plugin.optimizer_step

    def timed_call(fn, *a, **k):
        start = time.perf_counter()
        depth[0] += 1
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                inner[0] += time.perf_counter() - start

    def timed(optimizer, model, closure, **kwargs):
        step = optimizer.step
        optimizer.step = lambda *a, **k: timed_call(step, *a, **k)
        start, inner[0] = time.perf_counter(), 0.0
        try:
            return original(optimizer, model, lambda: timed_call(closure), **kwargs)
        finally:
            del optimizer.step  # the class's own again
            own.append(time.perf_counter() - start - inner[0])

    plugin.optimizer_step = timed
    after = plugin._after_closure  # Lightning's hooks and clipping, which both plugins run
    plugin._after_closure = lambda *a, **k: timed_call(after, *a, **k)
    median_step(plugin, args)
    return statistics.median(own[args.warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--fp16", action="store_true", help="also polyamp fp16-mixed vs Lightning 16-mixed")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    cases = [("bf16-mixed", lambda: Precision("bf16-mixed"),
              lambda: LightningMixedPrecision("bf16-mixed", "cpu"))]  # fmt: skip
    if args.fp16:
        torch_scale = pa.DynamicLossScale.preset("torch")
        cases.append(("fp16-mixed", lambda: Precision("fp16-mixed", device="cpu", loss_scale=torch_scale),
                      lambda: LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))))
    print(f"GPT-2 {args.layers} x {args.hidden}, seq {args.seq}, batch {args.batch}; {args.steps} steps a "
          f"fit, median after {args.warmup}; torch {torch.__version__}, "
          f"lightning {L.__version__}")  # fmt: skip
    for name, ours, native in cases:
        ratios = []
        for r in range(args.rounds):
            pair = [("polyamp", ours), ("lightning", native)]
            if r % 2:
                pair.reverse()
            t = {label: median_step(make(), args) for label, make in pair}
            ratios.append(t["polyamp"] / t["lightning"])
            print(f"{name} round {r}: polyamp {t['polyamp'] * 1e3:.1f} ms, lightning "
                  f"{t['lightning'] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
        print(f"{name}: polyamp / lightning median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")  # fmt: skip
        mine, theirs = (statistics.median(own_time(make, args) for _ in range(3)) for make in (ours, native))
        print(f"{name}: the plugin's own time a step (median of 3 fits): polyamp {mine * 1e3:.2f} ms, "
              f"lightning {theirs * 1e3:.2f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
