"""What a rollout layer is built with besides its shapes: one frozen :class:`LayerContext`.

``build_model`` (``rollout/engine.py``) builds it once per model from the engine's
quantization, dtype, device and tensor-parallel rank; every module hands its children
``ctx.child(name)``, the same context under the child's Hugging Face module name
(``model.layers.3.self_attn.qkv_proj``: the ``prefix`` that error messages name). A layer's
own arguments are then its shapes and what is particular to it (``bias``, ``unit``,
``reduce``), as in nano-vLLM, whose layers take shapes only.

Leaf modules that need nothing but a dtype and a device (norms, rope tables, routers' plain
parameters, hyper-connections) take ``ctx.dtype, ctx.device``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from hybridrl.rollout.layers.fused_moe_method import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from hybridrl.rollout.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from hybridrl.rollout.layers.quantization import get_linear_method, get_moe_method
from hybridrl.rollout.layers.tensor_parallel import SINGLE, TensorParallel


@dataclass(frozen=True, kw_only=True)
class LayerContext:
    """The quantization methods, dtype, device and tensor-parallel rank every layer of one
    model shares, and the module name (``prefix``) of the layer it is handed to."""

    linear_method: LinearMethodBase
    """how dense linears hold their weights and multiply (``layers/quantization.py``)."""
    moe_method: FusedMoEMethodBase = field(default_factory=UnquantizedFusedMoEMethod)
    """how fused MoE experts hold theirs (engine dtype, or MXFP4)."""
    dtype: torch.dtype
    """the engine's weight and activation dtype (activations stay in it over FP8 weights)."""
    device: torch.device
    tp: TensorParallel = SINGLE
    """this rank's place in its tensor-parallel group (``layers/tensor_parallel.py``)."""
    prefix: str = ""
    """the HF module name of the layer built with this context ("" at the model's root)."""
    exact: bool = False
    """batch-invariant numerics (``rollout.exact``): every layer computes what the trainer's
    transformers module computes under ``hybridrl.exact``, op for op (``docs/exact.md``)."""

    @classmethod
    def for_quantization(cls, quantization: str | None, *, dtype: torch.dtype, device: torch.device,
                         tp: TensorParallel = SINGLE, exact: bool = False) -> "LayerContext":
        """The root context of a model quantized by ``quantization`` (None, "fp8", "fp8+mxfp4", ...);
        ``exact``: batch-invariant numerics (full-precision weights only: the engine refuses the rest)."""
        if exact:
            from hybridrl.rollout.layers.exact_linear import ExactLinearMethod

            return cls(linear_method=ExactLinearMethod(), dtype=dtype, device=device, tp=tp, exact=True)
        return cls(linear_method=get_linear_method(quantization), moe_method=get_moe_method(quantization),
                   dtype=dtype, device=device, tp=tp)

    def child(self, name: str) -> "LayerContext":
        """This context for the submodule ``name`` (its prefix ``{prefix}.{name}``)."""
        return dataclasses.replace(self, prefix=f"{self.prefix}.{name}" if self.prefix else name)

    def unquantized(self) -> "LayerContext":
        """This context with plain engine-dtype linears: MoE routers and the layers that checkpoints
        ship unquantized (routing is where small errors flip choices)."""
        if self.exact:  # already plain weights, multiplied batch-invariantly
            return self
        return dataclasses.replace(self, linear_method=UnquantizedLinearMethod())
