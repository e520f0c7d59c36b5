"""polyamp bf16-mixed against native ``torch.autocast`` on a Hugging Face GPT-2: paired step times.

    python benchmarks/models_overhead_torch.py [--repeats 15] [--layers 4] [--hidden 256] [--seq 128]
                                               [--batch 8]

A ``transformers.GPT2LMHeadModel`` built from a config (no download), its language-model loss, AdamW.
The two contenders train twin copies of the same model on the same batch, alternating in one process
(rotated rounds, one warm-up step each): native ``torch.autocast("cpu", torch.bfloat16)`` with a plain
``optimizer.step()``, and ``MixedPrecision("bf16-mixed")`` (``mp.autocast``, ``mp.backward``,
``mp.step``: it also checks every gradient for inf/NaN, which the native loop does not). Prints both
medians, their ratio and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import transformers
from _timing import run_paired  # benchmarks/_timing.py (this folder is on sys.path)

import polyamp as pa


def gpt2(layers: int, hidden: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=4096, n_positions=seq, n_embd=hidden, n_layer=layers,
                                     n_head=max(1, hidden // 64), attn_pdrop=0.0, embd_pdrop=0.0,
                                     resid_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    base = gpt2(args.layers, args.hidden, args.seq)
    tokens = torch.randint(0, 4096, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    native_model, ours_model = copy.deepcopy(base), copy.deepcopy(base)
    native_opt = torch.optim.AdamW(native_model.parameters(), lr=1e-4)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-4)
    mp = pa.MixedPrecision("bf16-mixed", framework="torch")

    def native() -> None:
        native_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = native_model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        native_opt.step()

    def ours() -> None:
        ours_opt.zero_grad(set_to_none=True)
        with mp.autocast():
            loss = ours_model(input_ids=tokens, labels=tokens).loss
        mp.backward(loss)
        mp.step(ours_opt)

    times = run_paired({"native": native, "polyamp": ours}, args.repeats)
    (n_med, n_rounds), (p_med, p_rounds) = times["native"], times["polyamp"]
    paired = statistics.median(b / a for a, b in zip(n_rounds, p_rounds))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; GPT-2 {args.layers} layers x "
          f"{args.hidden}, batch {args.batch} x {args.seq} tokens, {args.repeats} rounds")  # fmt: skip
    print(f"{'contender':34s} {'median ms':>10s}")
    print(f"{'native torch.autocast bf16':34s} {n_med * 1e3:10.1f}")
    print(f"{'polyamp bf16-mixed (guarded)':34s} {p_med * 1e3:10.1f}")
    print(f"ratio polyamp / native: medians {p_med / n_med:.3f}, paired per round {paired:.3f}")


if __name__ == "__main__":
    main()
