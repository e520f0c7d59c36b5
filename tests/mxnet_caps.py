"""What this machine's MXNet can compute, for the MXNet tests' skips (a hardware capability, like CUDA).

``BF16_UNSUPPORTED`` is ``polyamp.mxnet.capability.bf16_unsupported()``: None where MXNet's oneDNN
computes bf16 FullyConnected / Convolution, else the reason, which is the text of the UnsupportedError
``MixedPrecision("bf16-mixed" or a recipe, framework="mxnet")`` raises there. ``needs_bf16`` skips a
test with that reason; ``bf16_or_none(spec)`` is the module-level MixedPrecision of a test file (its
amp.init, before any network), or None where bf16 is unsupported.
"""

import pytest

import polyamp as pa
from polyamp.mxnet.capability import bf16_unsupported

BF16_UNSUPPORTED = bf16_unsupported()
needs_bf16 = pytest.mark.skipif(BF16_UNSUPPORTED is not None, reason=str(BF16_UNSUPPORTED))


def bf16_or_none(spec: str, **kwargs):
    """``pa.MixedPrecision(spec, framework="mxnet", **kwargs)`` where bf16 computes, else None."""
    return None if BF16_UNSUPPORTED else pa.MixedPrecision(spec, framework="mxnet", **kwargs)
