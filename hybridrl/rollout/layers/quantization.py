"""``quantization=`` name -> linear method. The one module that knows every method.

It sits above ``linear_method.py`` and ``fp8_linear.py`` so that neither imports the
other's user: the methods depend on the interface, this registry depends on the methods.
"""

from __future__ import annotations

from hybridrl.rollout.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod

QUANTIZATIONS = (None, "fp8", "fp8_block")


def get_linear_method(quantization: str | None) -> LinearMethodBase:
    """None -> ``UnquantizedLinearMethod``; "fp8" (per channel) / "fp8_block" (128x128) -> ``Fp8LinearMethod``."""
    if quantization is None:
        return UnquantizedLinearMethod()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; use None, 'fp8' or 'fp8_block'")
    from hybridrl.rollout.layers.fp8_linear import Fp8LinearMethod  # on demand: pulls in the FP8 math

    return Fp8LinearMethod(block=quantization == "fp8_block")
