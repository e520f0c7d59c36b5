"""polyamp's step against hand-written native PyTorch AMP: median step-time ratios.

    python benchmarks/overhead_torch.py [--repeats 7] [--fp16-repeats 3] [--models mlp,transformer]
                                        [--device cpu|cuda] [--batch-mult 1]

Same model, weights, data and optimizer (Adam); native and polyamp steps alternate in one process
(native, polyamp, native, ...) so drift hits both; medians after one warm-up step each. Cases:
- bf16:  ``torch.autocast(cpu, bf16)`` alone vs ``MixedPrecision("bf16-mixed")`` (guarded: it
  checks every gradient for inf/NaN, which native bf16 does not) and with ``guard=False``;
- fp16 scaler at bf16 speed: ``autocast(bf16) + GradScaler`` vs polyamp dynamic loss scaling with
  the torch preset: the loss-scaling machinery alone, at a realistic step time;
- fp16: ``autocast(fp16) + GradScaler`` vs ``MixedPrecision("fp16-mixed", loss_scale="torch")``.
  This CPU has no fp16 units; torch runs fp16 ~100x slower, so this case gets fewer repeats.
``--device cuda`` runs the same cases on a GPU (each step ends with ``torch.cuda.synchronize()``, in both
contenders); ``--batch-mult`` multiplies the batch, so a GPU step is not only launch overhead.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from _timing import alternate  # benchmarks/_timing.py (this folder is on sys.path)
from torch import nn

import polyamp as pa


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1024))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    n = 256 * BATCH_MULT
    return model, torch.randn(n, 1024, generator=g), torch.randn(n, 1024, generator=g)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(256, 256)

    def forward(self, x):
        return self.head(self.encoder(x))


def transformer():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = 32 * BATCH_MULT
    return Encoder(), torch.randn(n, 64, 256, generator=g), torch.randn(n, 64, 256, generator=g)


DEVICE, BATCH_MULT = "cpu", 1


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def native_step(model, opt, x, y, dtype, scaler):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.split(":")[0], dtype=dtype):
        loss = nn.functional.mse_loss(model(x).float(), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    sync()


def polyamp_step(model, opt, x, y, mp):
    opt.zero_grad(set_to_none=True)
    with mp.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)
    mp.step(opt)
    sync()


def compare(build, native_dtype, scaler_on, contenders, repeats):
    """contenders: name -> MixedPrecision; returns name -> median seconds (plus 'native')."""
    setups = {}
    for name in ["native", *contenders]:
        model, x, y = build()
        model, x, y = model.to(DEVICE), x.to(DEVICE), y.to(DEVICE)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        if name == "native":
            scaler = torch.amp.GradScaler(DEVICE.split(":")[0]) if scaler_on else None
            setups[name] = lambda m=model, o=opt, s=scaler, x=x, y=y: native_step(m, o, x, y, native_dtype, s)
        else:
            mp = contenders[name]
            setups[name] = lambda m=model, o=opt, mp=mp, x=x, y=y: polyamp_step(m, o, x, y, mp)
    return alternate(setups, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fp16-repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    parser.add_argument("--batch-mult", type=int, default=1, help="multiply each batch (e.g. 16 on a GPU)")
    args = parser.parse_args()
    global DEVICE, BATCH_MULT
    DEVICE, BATCH_MULT = args.device, args.batch_mult
    warnings.simplefilter("ignore", RuntimeWarning)
    builds = {"mlp": mlp, "transformer": transformer}
    cuda = DEVICE.startswith("cuda")
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {DEVICE} ({where}), batch x{BATCH_MULT}, Adam, median step time")
    print(f"{'model':12s} {'case':28s} {'native ms':>10s} {'polyamp ms':>11s} {'ratio':>7s}")
    for model_name in args.models.split(","):
        build = builds[model_name]
        rows = []
        bf16 = compare(build, torch.bfloat16, False, {
            "bf16 guarded": pa.MixedPrecision("bf16-mixed", framework="torch", device=DEVICE),
            "bf16 guard=False": pa.MixedPrecision("bf16-mixed", framework="torch", device=DEVICE,
                                                  guard=False, loss_scale="none"),
        }, args.repeats)  # fmt: skip
        rows += [(k, bf16["native"], bf16[k]) for k in ("bf16 guarded", "bf16 guard=False")]
        scaled = compare(build, torch.bfloat16, True, {
            "fp16 scaler at bf16 speed": pa.MixedPrecision(
                "bf16-mixed", framework="torch", device=DEVICE, loss_scale="torch"),
        }, args.repeats)  # fmt: skip
        rows.append(("fp16 scaler at bf16 speed", scaled["native"], scaled["fp16 scaler at bf16 speed"]))
        if args.fp16_repeats:
            fp16 = compare(build, torch.float16, True, {
                "fp16 (autocast fp16)": pa.MixedPrecision(
                    "fp16-mixed", framework="torch", device=DEVICE, loss_scale="torch"),
            }, args.fp16_repeats)  # fmt: skip
            rows.append(("fp16 (autocast fp16)", fp16["native"], fp16["fp16 (autocast fp16)"]))
        for case, native, ours in rows:
            print(f"{model_name:12s} {case:28s} {native * 1e3:10.1f} {ours * 1e3:11.1f} "
                  f"{ours / native:7.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
