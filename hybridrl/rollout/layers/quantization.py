"""``quantization=`` name -> linear method (and MoE-expert method). The one module that knows every method.

It sits above ``linear_method.py``, ``fp8_linear.py`` and the fused-MoE methods so that none imports
another's user: the methods depend on their interfaces, this registry depends on the methods.

A name is ``<dense>`` or ``<dense>+mxfp4`` / ``mxfp4``: the dense part (None, ``fp8``,
``fp8_block``, ``fp8_block_ue8m0``: 128x128 tiles with power-of-two scales, the layout of
DeepSeek-V3.1/V4 checkpoints) quantizes every linear layer except MoE routers; ``mxfp4`` quantizes the MoE
experts (OCP MXFP4, ``hybridrl.quant.mxfp4``). Without ``mxfp4`` experts stay in the engine
dtype. So ``"fp8+mxfp4"`` is FP8 attention/dense MLPs + MXFP4 experts in one engine, one refit.
"""

from __future__ import annotations

from hybridrl.rollout.layers.fused_moe_method import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from hybridrl.rollout.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from hybridrl.rollout.layers.mxfp4_moe import Mxfp4FusedMoEMethod

from hybridrl.quant.schemes import QUANTIZATIONS


def _split(quantization: str | None) -> tuple[str | None, str | None]:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; use one of {QUANTIZATIONS} "
                         "('mxfp4' quantizes MoE experts; 'fp8'/'fp8_block' the other linears)")
    if quantization is None:
        return None, None
    parts = quantization.split("+")
    experts = "mxfp4" if "mxfp4" in parts else None
    dense = next((p for p in parts if p != "mxfp4"), None)
    return dense, experts


def get_moe_method(quantization: str | None) -> FusedMoEMethodBase:
    """How MoE experts are stored: MXFP4 when the name contains ``mxfp4``, else the engine dtype."""
    _, experts = _split(quantization)
    return Mxfp4FusedMoEMethod() if experts == "mxfp4" else UnquantizedFusedMoEMethod()


def get_linear_method(quantization: str | None) -> LinearMethodBase:
    """None -> ``UnquantizedLinearMethod``; "fp8" (per channel) / "fp8_block" (128x128) -> ``Fp8LinearMethod``.
    A model takes both methods in its ``LayerContext`` (``layers/context.py``)."""
    dense, _ = _split(quantization)
    if dense is None:
        method: LinearMethodBase = UnquantizedLinearMethod()
    else:
        from hybridrl.rollout.layers.fp8_linear import Fp8LinearMethod  # on demand: pulls in the FP8 math

        method = Fp8LinearMethod(block=dense.startswith("fp8_block"), pow2_scales=dense == "fp8_block_ue8m0")
    return method
