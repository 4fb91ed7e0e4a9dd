"""MXFP4 fused experts: packed E2M1 codes and E8M0 scales quantized on arrival, in place,
plus the dequantized derived cache the grouped GEMMs read (``hybridrl.quant.mxfp4``)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from hybridrl.quant import mxfp4
from hybridrl.rollout.derived import DerivedCache
from hybridrl.rollout.layers.fused_moe_method import PROJS, FusedMoEMethodBase


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
