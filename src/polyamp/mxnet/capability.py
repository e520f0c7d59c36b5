"""Whether this machine's MXNet computes in bfloat16: one probe per process, in a child process.

MXNet 1.9's CPU bfloat16 is oneDNN's, whose bf16 FullyConnected and Convolution kernels need AVX-512
(``avx512_core``; ``avx512_bf16`` for the native ones). On a CPU without it (e.g. an AVX2-only AMD EPYC)
every bf16 Dense and Conv fails with ``could not create a primitive descriptor iterator`` ("Unsupported
type 12" without oneDNN), and after such a failure MXNet's engine can hang the process. So the question
is asked once, of a short child process running one tiny bf16 ``FullyConnected`` and ``Convolution``
and checking their values; its verdict is cached for the life of this process.

``bf16_unsupported()`` is ``None`` where bf16 works, else the reason (what failed, why, what to use
instead): the text of the ``UnsupportedError`` that ``setup_amp`` raises and of the tests' skips.
"""

from __future__ import annotations

import functools
import subprocess
import sys

# one tiny bf16 FullyConnected and Convolution; prints "ok" when both compute the right values
_PROBE = """
import warnings
warnings.simplefilter("ignore")
import mxnet as mx
from mxnet.contrib import amp
bf16 = lambda shape: mx.nd.amp_cast(mx.nd.ones(shape), dtype=amp.amp.bfloat16)
fc = mx.nd.FullyConnected(bf16((2, 8)), bf16((4, 8)), no_bias=True, num_hidden=4)
conv = mx.nd.Convolution(bf16((1, 2, 5, 5)), bf16((3, 2, 3, 3)), no_bias=True, kernel=(3, 3), num_filter=3)
got = [mx.nd.amp_cast(y, dtype="float32").asnumpy() for y in (fc, conv)]
assert (got[0] == 8).all() and (got[1] == 18).all(), got
print("ok")
"""
PROBE_TIMEOUT_S = 180.0
_NEEDED_FLAGS = ("avx512_core", "avx512f", "avx512_bf16")


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _cpu_words() -> str:
    """'this CPU lacks them (it has avx2, no avx512f / avx512_bf16)' or the plain words where unknown."""
    flags = _cpu_flags()
    if flags is None:
        return "this CPU may lack them"
    has = [f for f in ("avx2", *_NEEDED_FLAGS) if f in flags]
    lacks = [f for f in _NEEDED_FLAGS if f not in flags and not (f == "avx512_core" and "avx512f" in flags)]
    return f"this CPU lacks them (it has {', '.join(has) or 'none of these'}; not {' / '.join(lacks)})"


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or ["no output"])[-1][:300]


def reason(failure: str) -> str:
    """The UnsupportedError text for a probe that failed with ``failure`` (its last error line)."""
    return (
        "MXNet's oneDNN computes no bfloat16 on this CPU: MXNet 1.9.1's bf16 FullyConnected and "
        f"Convolution kernels need AVX-512 (avx512_core, or avx512_bf16), and {_cpu_words()}; a tiny bf16 "
        f"FullyConnected + Convolution failed ({failure}). Use 'float32' (recipes: compute_dtype='fp32'), "
        "'fp16-mixed' on a GPU with cuDNN, or a CPU with AVX-512"
    )


@functools.lru_cache(maxsize=1)
def bf16_unsupported() -> str | None:
    """None when MXNet computes bf16 FullyConnected and Convolution here, else why not (cached)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        return reason(f"the probe process hung for {PROBE_TIMEOUT_S:g} s")
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return None
    return reason(_last_error_line(done.stderr or done.stdout))
