"""Fused experts: every expert of a MoE layer in two stacked tensors, and grouped dispatch.

Storage (inference layout, what ``torch._grouped_mm`` reads):

- ``gate_up_proj [E, 2I, H]`` — rows ``[0, I)`` are expert e's ``gate_proj``, ``[I, 2I)`` its ``up_proj``;
- ``down_proj [E, H, I]``.

These are exactly transformers >= 5's fused ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``
parameters, so the module's parameter names *are* the trainer's names. A *fused-MoE method*
owns the storage (as a linear method owns a linear's): unquantized, or MXFP4
(``Mxfp4FusedMoEMethod``: packed E2M1 codes and E8M0 scales quantized on arrival, plus a
dequantized derived cache the matmuls read).

Routes (``FusedExperts.hf_weight_routes``): the fused names are the *expected* names; the
per-expert names of safetensors checkpoints on disk (``experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) are *aliases* of slices of them. Loading either writes the same
storage in place: a checkpoint (per-expert) and a trainer (fused) refit the same engine.

Tensor parallel (``tensor_parallel.py``): every rank holds every expert, with its share of
the intermediate width (``gate_up_proj`` rows ``[t·I/T, (t+1)·I/T)`` of both halves,
``down_proj`` the same columns), so an expert's output on a rank is a partial sum that the
MoE block all-reduces once (with its shared experts'). Sharding the experts themselves
(expert parallel) would need an all-to-all dispatch of tokens to their experts' ranks;
with the expert counts we serve, TP keeps every rank's work equal whatever the routing and
needs no dispatch, which is also vLLM's default (``enable_expert_parallel`` off).

Dispatch (:func:`fused_experts`): the T*k (token, expert) pairs are sorted by expert
(a stable sort on the device), the tokens gathered in that order, and each projection is
one grouped GEMM over contiguous per-expert row groups whose end offsets come from a
``searchsorted`` on the device — no Python loop over tokens, no host sync, static shapes
(T*k rows whatever the routing), so a CUDA graph can capture it. The k outputs of a token
are scattered back to their (token, slot) place and summed in slot order (deterministic).

Implementations (``IMPL``): ``"grouped"`` (``torch._grouped_mm``), ``"loop"`` (one GEMM per
expert over its row group; syncs the group sizes to the host — eager only), ``"dense"``
(every expert on every token, weighted by a zero-filled [T, E] combine matrix: E/k times
the FLOPs, but capture-safe with any dtype). ``"auto"``: grouped, except that on CUDA outside
the bf16 sm90/sm100 fast path torch's grouped GEMM falls back to a host-synced loop, so
*during a CUDA-graph capture* that case takes ``"dense"``.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.quant import mxfp4
from hybridrl.rollout.derived import DerivedCache
from hybridrl.rollout.layers.tensor_parallel import SINGLE, TensorParallel, TPSlice, take_local

PROJS = ("gate_up_proj", "down_proj")
IMPL = "auto"  # "auto" | "grouped" | "loop" | "dense" (tests force each)


# ---- dispatch ------------------------------------------------------------------------------
def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


@functools.cache
def _cuda_fast_grouped(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's CUDA grouped GEMM runs without a host sync only for bf16 on sm90/sm100."""
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch's grouped GEMM accepts


def _pick_impl(x: torch.Tensor) -> str:
    if IMPL != "auto":
        return IMPL
    if _grouped_mm_fn() is None or x.dtype not in GROUPED_DTYPES:
        return "dense" if _capturing(x) else "loop"
    if x.device.type == "cuda" and _capturing(x) and not _cuda_fast_grouped(x.device, x.dtype):
        return "dense"
    return "grouped"


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit`` (DeepSeek-V4's ``swiglu_limit``) the gate is clamped
    to ``<= limit`` and up to ``[-limit, limit]`` first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, impl: str | None = None, limit: float | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token t.

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows then up rows); w2 ``[E, H, I]``; topk_ids,
    topk_weights ``[T, k]`` (weights in x's dtype). An expert is ``down(swiglu(gate(x), up(x)))``
    (``limit``: the clamped SwiGLU). Returns ``[T, H]`` in x's dtype.
    """
    impl = impl or _pick_impl(x)
    if impl == "dense":
        return _dense(x, w13, w2, topk_ids, topk_weights, limit)
    T, H = x.shape
    k = topk_ids.shape[1]
    E, two_i, _ = w13.shape
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)  # pairs grouped by expert, token order kept
    xs = x.index_select(0, order // k)  # (T*k, H)
    if impl == "grouped":
        experts = torch.arange(E, device=x.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # group ends
        mm = _grouped_mm_fn()
        h = mm(xs, w13.transpose(1, 2), offs=offs)  # (T*k, 2I)
        a = swiglu(h[:, :two_i // 2], h[:, two_i // 2:], limit)
        y = mm(a, w2.transpose(1, 2), offs=offs)  # (T*k, H)
    elif impl == "loop":
        y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
        counts = torch.bincount(sorted_ids, minlength=E).tolist()  # host sync: eager only
        start = 0
        for e, n in enumerate(counts):
            if n:
                g, u = F.linear(xs[start:start + n], w13[e]).chunk(2, dim=-1)
                y[start:start + n] = F.linear(swiglu(g, u, limit), w2[e])
                start += n
    else:
        raise ValueError(f"fused_experts: unknown impl {impl!r}; use 'grouped', 'loop' or 'dense'")
    y = y * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return out.view(T, k, H).sum(dim=1)


def _dense(x, w13, w2, topk_ids, topk_weights, limit=None) -> torch.Tensor:
    """Every expert on every token, weighted by a [T, E] combine matrix (zeros off the top-k)."""
    E, two_i, _ = w13.shape
    combine = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter_(1, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    for e in range(E):
        g, u = F.linear(x, w13[e]).chunk(2, dim=-1)
        out += combine[:, e:e + 1] * F.linear(swiglu(g, u, limit), w2[e])
    return out


# ---- methods: what the experts store and how a trainer tensor lands in it -------------------
class FusedMoEMethodBase(ABC):
    """Storage of a ``FusedExperts`` layer (the fused-MoE analogue of a linear method).

    ``proj`` is ``"gate_up_proj"`` or ``"down_proj"``; ``expert`` None means all experts (the
    fused tensor); ``shard`` 0 / 1 selects the gate / up rows of ``gate_up_proj`` (None: all).
    ``expected_held`` and ``held`` return the same dtype (the engine dtype, or float32 for
    quantized storage) so that refit's exact checksums compare them.
    """

    @abstractmethod
    def create_weights(self, layer: "FusedExperts", dtype: torch.dtype, device: torch.device) -> None: ...

    @abstractmethod
    def loaded_param(self, layer: "FusedExperts", proj: str) -> nn.Parameter:
        """The parameter a trainer tensor for ``proj`` is written into."""

    @abstractmethod
    def weight_loader(self, layer: "FusedExperts", proj: str, loaded: torch.Tensor,
                      expert: int | None, shard: int | None) -> None: ...

    def restore_loading_layout(self, layer: "FusedExperts") -> None:
        """Inference -> loading layout, in place (default: one layout)."""

    def apply_inference_layout(self, layer: "FusedExperts") -> None:
        """Loading -> inference layout, in place (default: one layout)."""

    @abstractmethod
    def expected_held(self, layer: "FusedExperts", proj: str, loaded: torch.Tensor,
                      expert: int | None, shard: int | None) -> torch.Tensor: ...

    @abstractmethod
    def held(self, layer: "FusedExperts", proj: str, expert: int | None, shard: int | None) -> torch.Tensor: ...

    @abstractmethod
    def compute_weights(self, layer: "FusedExperts") -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 ``[E, 2I, H]``, w2 ``[E, H, I]``) in the engine dtype, as the matmuls read them."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """``gate_up_proj`` / ``down_proj`` in the engine dtype; loading is a slice ``copy_``."""

    def create_weights(self, layer, dtype, device):
        for proj in PROJS:
            shape = layer.full_shape(proj)
            setattr(layer, proj, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))

    def loaded_param(self, layer, proj):
        return getattr(layer, proj)

    def weight_loader(self, layer, proj, loaded, expert, shard):
        slot = layer.slot(getattr(layer, proj).data, proj, expert, shard)
        layer.check_shape(proj, loaded, expert, shard)
        slot.copy_(loaded)

    def expected_held(self, layer, proj, loaded, expert, shard):
        return loaded.to(layer.dtype)

    def held(self, layer, proj, expert, shard):
        return layer.slot(getattr(layer, proj).data, proj, expert, shard)

    def compute_weights(self, layer):
        return layer.gate_up_proj, layer.down_proj


class Mxfp4FusedMoEMethod(FusedMoEMethodBase):
    """MXFP4 experts: ``{proj}_blocks`` (packed E2M1, ``[E, N, K/2]`` uint8) and ``{proj}_scales``
    (E8M0, ``[E, N, K/32]`` uint8) Parameters, quantized on arrival in place
    (``hybridrl.quant.mxfp4``), plus ``{proj}_dequant [E, N, K]`` in the engine dtype: a
    registered ``DerivedCache`` that the grouped GEMMs read on CPU and on GPUs without FP4
    GEMMs. ``finish()`` of a weight update re-applies the inference layout *then* refreshes
    the caches in place; a cache refuses to refresh while the layer is in loading layout.

    Memory: 4.25 bits per weight for the packed storage + the cache in the engine dtype
    (so on this path ~1.27x bf16 — MXFP4 *numerics*, not savings, as for ``fp8_block``).
    """

    def create_weights(self, layer, dtype, device):
        for proj in PROJS:
            shape = layer.full_shape(proj)
            try:
                bshape, sshape = mxfp4.blocks_shape(shape), mxfp4.scales_shape(shape)
            except ValueError:
                raise ValueError(f"{layer.prefix}.{proj}: quantization 'mxfp4' needs the input size "
                                 f"({shape[-1]}) to be a multiple of {mxfp4.BLOCK}; leave the experts "
                                 "unquantized for this model") from None
            blocks = nn.Parameter(torch.zeros(bshape, dtype=torch.uint8, device=device), requires_grad=False)
            scales = nn.Parameter(torch.zeros(sshape, dtype=torch.uint8, device=device), requires_grad=False)
            setattr(layer, f"{proj}_blocks", blocks)
            setattr(layer, f"{proj}_scales", scales)
            cache = torch.zeros(shape, dtype=dtype, device=device)
            DerivedCache(layer, f"{proj}_dequant", cache,
                         compute=functools.partial(self._dequantize_into, layer, proj),
                         ready=lambda: layer.mxfp4_inference_layout)
        layer.mxfp4_inference_layout = False  # created in loading layout

    def loaded_param(self, layer, proj):
        return getattr(layer, f"{proj}_blocks")

    def _slots(self, layer, proj, expert, shard):
        blocks = layer.slot(getattr(layer, f"{proj}_blocks").data, proj, expert, shard)
        scales = layer.slot(getattr(layer, f"{proj}_scales").data, proj, expert, shard)
        return blocks, scales

    def weight_loader(self, layer, proj, loaded, expert, shard):
        layer.check_shape(proj, loaded, expert, shard)
        if layer.mxfp4_inference_layout:
            raise ValueError(f"{layer.prefix}: MXFP4 expert weight written outside a weight update; load "
                             "through engine.load_weights or begin_weight_update() ... finish_weight_update()")
        blocks, scales = self._slots(layer, proj, expert, shard)
        mxfp4.quantize_(loaded, blocks, scales)

    def restore_loading_layout(self, layer):
        layer.mxfp4_inference_layout = False

    def apply_inference_layout(self, layer):
        layer.mxfp4_inference_layout = True

    def _dequantize_into(self, layer, proj, out):
        assert layer.mxfp4_inference_layout, "the MXFP4 dequant cache reads the inference layout"
        mxfp4.dequantize_(getattr(layer, f"{proj}_blocks"), getattr(layer, f"{proj}_scales"), out)

    def expected_held(self, layer, proj, loaded, expert, shard):
        """float32 ``dequant(quant(loaded))`` on ``loaded``'s device (rows and blocks are
        independent, so a per-expert slice quantizes as it does inside the fused tensor);
        raises if the round trip exceeds ``mxfp4.abs_error_bound`` (inf/nan weights)."""
        blocks, scales = mxfp4.quantize(loaded)
        expected = mxfp4.dequantize(blocks, scales)
        if not ((expected - loaded).abs() <= mxfp4.abs_error_bound(loaded, scales)).all():
            raise ValueError(f"{layer.prefix}.{proj} expert {expert} shard {shard}: MXFP4 quantization exceeds "
                             "its error bound; check for inf/nan in the trainer weights")
        return expected

    def held(self, layer, proj, expert, shard):
        blocks, scales = self._slots(layer, proj, expert, shard)
        return mxfp4.dequantize(blocks, scales)

    def compute_weights(self, layer):
        return layer.gate_up_proj_dequant, layer.down_proj_dequant


# ---- the layer and its routes ------------------------------------------------------------
class FusedExperts(nn.Module):
    """E experts of width I over hidden size H; ``forward(x, topk_ids, topk_weights)``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 method: FusedMoEMethodBase, dtype: torch.dtype, device: torch.device, prefix: str = "",
                 swiglu_limit: float | None = None, tp: TensorParallel = SINGLE):
        """``intermediate_size``: the HF width I; this rank holds ``I / tp.size`` of it."""
        super().__init__()
        self.tp, self.hf_intermediate_size = tp, intermediate_size
        self.inter_start, local = tp.split(intermediate_size, f"{prefix}: the experts' intermediate size")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, local
        self.swiglu_limit = swiglu_limit
        self.dtype, self.prefix, self.method = dtype, prefix, method
        method.create_weights(self, dtype, device)

    # geometry
    def full_shape(self, proj: str) -> torch.Size:
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        return torch.Size([E, 2 * I, H] if proj == "gate_up_proj" else [E, H, I])

    def hf_shape(self, proj: str, expert: int | None, shard: int | None, local: bool = True) -> torch.Size:
        """The HF tensor's shape for (proj, expert, shard): this rank's part, or (``local=False``) whole."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size if local else self.hf_intermediate_size
        shape = torch.Size([E, 2 * I, H] if proj == "gate_up_proj" else [E, H, I])
        if expert is None:
            return shape
        return torch.Size([I, H]) if shard is not None else shape[1:]

    def tp_slice(self, proj: str, expert: int | None, shard: int | None) -> TPSlice | None:
        """The part of the HF tensor this rank holds (None without tensor parallelism)."""
        if self.tp.size == 1:
            return None
        s, n, I = self.inter_start, self.intermediate_size, self.hf_intermediate_size
        if proj == "down_proj":
            return TPSlice(2 if expert is None else 1, ((s, n),))
        if expert is None:
            return TPSlice(1, ((s, n), (I + s, n)))
        return TPSlice(0, ((s, n),))

    def rows(self, proj: str, shard: int | None) -> slice:
        """Rows of one expert's matrix holding ``shard`` (gate 0 / up 1 of ``gate_up_proj``)."""
        if shard is None:
            return slice(None)
        assert proj == "gate_up_proj" and shard in (0, 1), (proj, shard)
        return slice(shard * self.intermediate_size, (shard + 1) * self.intermediate_size)

    def slot(self, t: torch.Tensor, proj: str, expert: int | None, shard: int | None) -> torch.Tensor:
        """The view of a per-expert-stacked tensor ``t [E, N, *]`` a (expert, shard) write lands in."""
        if expert is None:
            assert shard is None, "a fused tensor covers both shards"
            return t
        return t[expert][self.rows(proj, shard)]

    def check_shape(self, proj, loaded, expert, shard) -> None:
        want = self.hf_shape(proj, expert, shard)
        if tuple(loaded.shape) != tuple(want):
            raise ValueError(f"weight for {self.prefix}.{proj} (expert {expert}, shard {shard}) has shape "
                             f"{tuple(loaded.shape)}, expected {tuple(want)}; check that the checkpoint "
                             "matches the engine config (num_experts, moe_intermediate_size)")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.method.compute_weights(self)
        return fused_experts(x, w13, w2, topk_ids, topk_weights, limit=self.swiglu_limit)

    def hf_weight_routes(self, module_name: str) -> Iterator["ExpertRoute"]:
        """Fused (expected) routes, then per-expert alias routes, for this layer at ``module_name``."""
        E = self.num_experts
        for proj in PROJS:
            fused = f"{module_name}.{proj}"
            param = self.method.loaded_param(self, proj)
            param_name = f"{module_name}.{_param_attr(self, param)}"
            yield ExpertRoute(fused, param_name, self.hf_shape(proj, None, None, local=False), param, self, proj,
                              None, None, None, tp=self.tp_slice(proj, None, None))
            parts = (("gate_proj", 0), ("up_proj", 1)) if proj == "gate_up_proj" else (("down_proj", None),)
            for e in range(E):
                for part, shard in parts:
                    yield ExpertRoute(f"{module_name}.{e}.{part}.weight", param_name,
                                      self.hf_shape(proj, e, shard, local=False), param, self, proj, e, shard, fused,
                                      tp=self.tp_slice(proj, e, shard))


def _param_attr(module: nn.Module, param: nn.Parameter) -> str:
    return next(n for n, p in module.named_parameters(recurse=False) if p is param)


@dataclass(frozen=True)
class ExpertRoute:
    """Where one HF expert tensor lands (the ``WeightRoute`` interface).

    ``canonical`` is None for a fused name (one of ``WeightRoutes.expected``); for a
    per-expert alias it is the fused name whose slice it writes: the alias set of a fused
    name, all written, completes that name.
    """

    hf_name: str
    param_name: str
    shape: torch.Size
    param: nn.Parameter
    layer: FusedExperts
    proj: str
    expert: int | None
    shard_id: int | None
    canonical: str | None
    rows: slice | None = None
    tp: TPSlice | None = None
    """the part of the HF tensor this rank holds (tensor parallel); None: all of it."""

    @property
    def local_shape(self) -> torch.Size:
        return self.shape if self.tp is None else self.tp.local_shape(self.shape)

    def load(self, tensor: torch.Tensor) -> None:
        tensor = take_local(tensor, self.shape, self.tp)
        self.layer.method.weight_loader(self.layer, self.proj, tensor, self.expert, self.shard_id)

    def expected_held(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = take_local(tensor, self.shape, self.tp)
        return self.layer.method.expected_held(self.layer, self.proj, tensor, self.expert, self.shard_id)

    def held(self) -> torch.Tensor:
        return self.layer.method.held(self.layer, self.proj, self.expert, self.shard_id)
