"""FP8 (e4m3fn) linear method: weights quantized on arrival, in place, per output
channel (``block=False``) or in 128×128 tiles (``block=True``).

Tensors registered on the layer, each allocated once in ``create_weights``:

- ``weight [N, K]`` float8_e4m3fn Parameter (``weight_loader`` quantizes into its rows);
- ``weight_scale`` float32 Parameter, ``[N, 1]`` or ``[ceil(N/128), ceil(K/128)]``;
- ``weight_dequant [N, K]`` in the engine dtype — a registered ``DerivedCache`` — when
  ``torch._scaled_mm`` cannot serve the layer (CPU, ROCm, block scales, a non-bf16
  engine, N/K not multiples of 16, a GPU below compute capability 9.0 — an A100 has no
  FP8 tensor cores and rowwise-scaled ``_scaled_mm`` raises there — or torch < 2.5, which
  has no rowwise scales). It is refreshed in place after loading, never deleted and
  rebuilt. So ``fp8_block`` always runs through this bf16 cache, on CUDA too: its linear
  weights then take 1.5x the bytes of a bf16 engine (1 B fp8 + 2 B cache per element;
  ``benchmarks/refit.py`` reports it); FP8 saves memory only on the ``_scaled_mm`` path.

Two layouts. *Loading layout*: plain e4m3fn values and scales, what ``weight_loader``
writes. *Inference layout*: what the kernels read. On ROCm (MI300) that is e4m3fnuz:
the same bits mean half the value, so vLLM reinterprets the weight and doubles the
scale after loading. This step is exactly the kind that, run twice without being
undone, doubles the scale on every sync — so here it is an explicit, flagged pair:
``restore_loading_layout`` (scale /= 2) and ``apply_inference_layout`` (scale *= 2),
both in place on the same storage, each a no-op if the layer is already in that layout.
The engine's weight-update bracket runs them: ``begin`` restores loading layouts;
``finish`` re-applies inference layouts to every layer and only then refreshes derived
caches (each cache refuses to refresh while its layer is in loading layout). On CUDA/CPU the inference layout is the
loading layout (``_scaled_mm`` reads ``weight.t()``, a column-major view); tests force
the fnuz layout on CPU with ``Fp8LinearMethod(block, fnuz=True)`` or ``FNUZ_DEFAULT``.

Fused layers (qkv, gate_up): each shard is quantized into its own rows. Per-channel
scales are per row, so shards are independent. With 128×128 blocks, a tile that
straddled two shards would need both shards' values for its scale; like vLLM we require
every shard but the last to span whole 128-row tiles and raise at construction otherwise
(use ``quantization="fp8"`` for such shapes).

Numerics: weight-only dequantization on the cache path (activations stay in the engine
dtype); on the ``_scaled_mm`` path activations are also quantized per token to e4m3fn
(:func:`quantize_activations`: eight elementwise/reduction kernels eager, so on CUDA it is
``torch.compile``d into one reduction and one pointwise kernel, falling back to eager if
compilation is unavailable).
Per-element weight error is bounded by ``hybridrl.quant.abs_error_bound``.

Verification (``expected_held`` / ``held``) lives here too, so nothing outside this file
needs to know that a weight is FP8: the expected value is ``dequant(quant(w))`` computed on
the trainer tensor's device, exactly as ``weight_loader`` computes it.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.torch_version import TorchVersion

from hybridrl.quant.fp8 import (BLOCK, FP8_DTYPE, FP8_MAX, abs_error_bound, block_scale_shape, dequantize_,
                                quantize_)
from hybridrl.rollout.compile import compile_fn
from hybridrl.rollout.derived import DerivedCache
from hybridrl.rollout.layers import cpu_linear
from hybridrl.rollout.layers.linear_method import LinearMethodBase

FNUZ_DEFAULT: bool | None = None  # None: fnuz inference layout exactly when running on ROCm
FNUZ_SCALE = 2.0  # e4m3fnuz bits encode half the e4m3fn value
SCALED_MM_MULTIPLE = 16  # _scaled_mm needs both matrix dims divisible by 16
SCALED_MM_MIN_CAPABILITY = (9, 0)  # FP8 tensor cores + rowwise scales: Hopper and newer
SCALED_MM_MIN_TORCH = "2.5"  # rowwise (per-token x per-channel) scales; before, a tuple return
COMPILE_ACTIVATION_QUANT = True  # switch: False keeps the eager activation quantization on CUDA

log = logging.getLogger(__name__)


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, block: bool = False, fnuz: bool | None = None, pow2_scales: bool = False):
        self.block = block
        self.pow2_scales = pow2_scales  # ue8m0: scales rounded up to powers of two (quant.fp8.quantize_)
        fnuz = FNUZ_DEFAULT if fnuz is None else fnuz
        self.fnuz = (torch.version.hip is not None) if fnuz is None else fnuz

    # -- storage ---------------------------------------------------------------------
    def create_weights(self, layer, dtype, device):
        n, k = layer.output_size, layer.input_size
        if self.block:
            bad = [s for s in layer.output_sizes[:-1] if s % BLOCK]
            if bad:
                raise ValueError(
                    f"{layer.prefix}: fp8_block needs every fused shard but the last to be a "
                    f"multiple of {BLOCK} rows, got shard sizes {layer.output_sizes}; "
                    "use quantization='fp8' (per-channel) for this model")
        scale_shape = block_scale_shape(n, k) if self.block else (n, 1)
        layer.weight = nn.Parameter(torch.zeros(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32, device=device),
                                          requires_grad=False)
        layer.weight.weight_loader = lambda p, w, shard_id=None: self.weight_loader(layer, p, w, shard_id)
        layer.fp8_inference_layout = False  # created in loading layout
        layer.weight_dequant_cache = None
        if not self._scaled_mm_ok(layer, dtype, device):
            cache = torch.zeros(n, k, dtype=dtype, device=device)
            layer.weight_dequant_cache = DerivedCache(
                layer, "weight_dequant", cache,
                compute=lambda out: self.dequantize_into(layer, out),
                ready=lambda: layer.fp8_inference_layout)

    def _scaled_mm_ok(self, layer, dtype, device) -> bool:
        device = torch.device(device)
        # a layer that reads its whole weight as a tensor (DeepSeek-V4's grouped o_a_proj: a
        # bmm over per-group blocks) needs the dequantized cache: it is the seed PR's bf16 wo_a copy
        return (not getattr(layer, "needs_dense_weight", False)
                and device.type == "cuda" and torch.version.hip is None and not self.block
                and dtype == torch.bfloat16  # rowwise-scaled _scaled_mm outputs bf16
                and not self.fnuz and layer.output_size % SCALED_MM_MULTIPLE == 0
                and layer.input_size % SCALED_MM_MULTIPLE == 0
                and TorchVersion(torch.__version__) >= SCALED_MM_MIN_TORCH
                and torch.cuda.get_device_capability(device) >= SCALED_MM_MIN_CAPABILITY)

    # -- loading ---------------------------------------------------------------------
    def weight_loader(self, layer, param, loaded_weight, shard_id=None):
        """Quantize one HF tensor ``[rows, K]`` into its rows of ``weight`` and ``weight_scale``."""
        rows = layer.shard_slice(shard_id)
        slot = layer.weight.data[rows]
        if tuple(loaded_weight.shape) != tuple(slot.shape):
            raise ValueError(
                f"weight for {layer.prefix} shard {shard_id!r} has shape {tuple(loaded_weight.shape)}, "
                f"expected {tuple(slot.shape)}; check that the checkpoint matches the engine config")
        if layer.fp8_inference_layout:  # the engine's weight update restores loading layout first
            raise ValueError(f"{layer.prefix}: FP8 weight written outside a weight update; load through "
                             "engine.load_weights or begin_weight_update() ... finish_weight_update()")
        quantize_(loaded_weight, slot, self.scale_rows(layer, rows), block=self.block, pow2=self.pow2_scales)

    def scale_rows(self, layer, rows: slice) -> torch.Tensor:
        """The view of ``weight_scale`` that belongs to weight rows ``rows``."""
        if not self.block:
            return layer.weight_scale.data[rows]
        assert rows.start % BLOCK == 0, rows
        return layer.weight_scale.data[rows.start // BLOCK:-(-rows.stop // BLOCK)]

    def restore_loading_layout(self, layer) -> None:
        """Inference -> loading layout, in place (no-op if already in loading layout)."""
        if not layer.fp8_inference_layout:
            return
        if self.fnuz:
            layer.weight_scale.data.div_(FNUZ_SCALE)
        layer.fp8_inference_layout = False

    def apply_inference_layout(self, layer) -> None:
        """Loading -> inference layout, in place (no-op if already in inference layout)."""
        if layer.fp8_inference_layout:
            return
        if self.fnuz:
            bits = layer.weight.data.view(torch.int8)
            bits.masked_fill_(bits == -128, 0)  # e4m3fn -0 is NaN in e4m3fnuz
            layer.weight_scale.data.mul_(FNUZ_SCALE)
        layer.fp8_inference_layout = True

    def in_inference_layout(self, layer) -> bool:
        return layer.fp8_inference_layout

    # -- reading ---------------------------------------------------------------------
    def inference_weight(self, layer) -> torch.Tensor:
        """``weight`` as the kernels read it (an e4m3fnuz view of the same storage on fnuz)."""
        return layer.weight.view(torch.float8_e4m3fnuz) if self.fnuz else layer.weight

    def dequantize_into(self, layer, out: torch.Tensor) -> None:
        """``out [N, K] = weight * scale`` read in inference layout (the derived cache)."""
        assert layer.fp8_inference_layout, "dequantize_into reads the inference layout"
        dequantize_(self.inference_weight(layer), layer.weight_scale, out)

    # -- verification ----------------------------------------------------------------
    def expected_held(self, layer, loaded_weight, shard_id):
        """float32 ``[rows, K]``: ``dequant(quant(loaded_weight))``, what ``held`` will return.

        Quantized into fresh tensors on ``loaded_weight``'s device with this shard's own
        scales, as ``weight_loader`` does (a shard starts on a scale-tile boundary, so its
        scales do not depend on its neighbours). Raises if the round trip exceeds
        ``abs_error_bound`` (inf/nan in the trainer weights).
        """
        src, device = loaded_weight, loaded_weight.device
        weight = torch.empty(src.shape, dtype=FP8_DTYPE, device=device)
        scale = torch.empty(block_scale_shape(*src.shape) if self.block else (src.shape[0], 1),
                            dtype=torch.float32, device=device)
        quantize_(src, weight, scale, block=self.block, pow2=self.pow2_scales)
        expected = torch.empty(src.shape, dtype=torch.float32, device=device)
        dequantize_(weight, scale, expected)
        if not ((expected - src).abs() <= abs_error_bound(src, scale)).all():
            raise ValueError(f"{layer.prefix} shard {shard_id!r}: FP8 quantization exceeds its error "
                             "bound; check for inf/nan in the trainer weights")
        return expected

    def held(self, layer, rows):
        """float32 ``[rows, K]`` dequantization of weight rows ``rows``, in either layout."""
        w = layer.weight.data[rows]
        if layer.fp8_inference_layout and self.fnuz:
            w = w.view(torch.float8_e4m3fnuz)  # scale is doubled in this layout too
        out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        dequantize_(w, self.scale_rows(layer, rows), out)
        return out

    def apply(self, layer, x):
        if layer.weight_dequant_cache is not None:
            return cpu_linear.linear(x, layer.weight_dequant, layer.bias)
        return _scaled_mm_linear(x, layer.weight, layer.weight_scale, layer.bias)


def _scaled_mm_linear(x, weight, weight_scale, bias):
    """CUDA: per-token e4m3fn activations × per-channel e4m3fn weight via ``_scaled_mm``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # (M, K)
    x_fp8, x_scale = quantize_activations(x2)
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                         bias=bias, out_dtype=x.dtype)  # (M, N)
    if isinstance(y, tuple):  # torch < 2.5 returned (out, amax)
        y = y[0]
    return y.reshape(*shape[:-1], weight.shape[0])


def quantize_rows_eager(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) e4m3fn quantization of ``x2 [M, K]`` -> (``[M, K]`` fp8, scale ``[M, 1]`` fp32)."""
    x_scale = x2.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12).div_(FP8_MAX)  # (M, 1)
    x_fp8 = (x2.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, x_scale


_compiled_quantize_rows = None  # None: not built yet; False: compilation failed, eager from then on


def _compiled():
    global _compiled_quantize_rows
    if _compiled_quantize_rows is None:
        # dynamic: one compiled kernel pair for every token count M (M = 1 specializes once).
        _compiled_quantize_rows = compile_fn(quantize_rows_eager, dynamic=True)  # cache per CPU capability
    return _compiled_quantize_rows


def _compiled_or_eager(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    global _compiled_quantize_rows
    try:
        return _compiled()(x2)
    except Exception as e:  # no triton / compiler on this machine: stay correct, unfused
        log.warning("FP8 activation quantization: torch.compile failed (%s: %s); using the eager "
                    "kernels from now on", type(e).__name__, e)
        _compiled_quantize_rows = False
        return quantize_rows_eager(x2)


def activation_quantizer(device: torch.device | str):
    """What :func:`quantize_activations` runs on ``device``: the ``torch.compile``d kernels on
    CUDA (the first call per shape class compiles — the CUDA-graph warm-up makes it, never a
    capture), else (CPU, switched off, or compilation failed once) the eager ones."""
    if (torch.device(device).type == "cuda" and COMPILE_ACTIVATION_QUANT
            and _compiled_quantize_rows is not False):
        return _compiled_or_eager
    return quantize_rows_eager


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3fn quantization of ``x2 [M, K]`` (:func:`quantize_rows_eager`, fused on CUDA)."""
    return activation_quantizer(x2.device)(x2)
