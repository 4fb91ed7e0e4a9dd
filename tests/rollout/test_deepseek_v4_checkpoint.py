"""DeepSeek-V4 checkpoints on disk: transformers' ``save_pretrained`` form and the released
layout (no ``model.`` prefix, DeepSeek's leaf names, block-FP8 linears with e8m0 or float32
``.scale`` tiles, FP4 routed experts as int8 + e8m0 scales, ``mtp.*``), written here by hand
with quantizers independent of hybridrl."""
import json
import logging
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.rollout import EngineSpec, RolloutEngine
from tests.rollout._deepseek import fresh_seed
from tests.rollout._deepseek_v4 import TYPES, VOCAB, draw_config, hf_model, reference

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# what the release stores in FP8 (the rest of the 2-D weights in bf16): attention, indexer query, shared MLP
FP8_LEAVES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
              "indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")
RELEASED_LEAVES = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                   "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


def _fp8_pow2(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 tile: scale 2**ceil(log2(amax / 448)) as E8M0 bits, q = e4m3(w / scale)."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    bits = torch.empty(-(-N // 128), -(-K // 128), dtype=torch.uint8)
    for i in range(0, N, 128):
        for j in range(0, K, 128):
            tile = w[i:i + 128, j:j + 128].double()
            e = int(torch.ceil(torch.log2(tile.abs().max().clamp(min=1e-30) / 448.0)))
            bits[i // 128, j // 128] = e + 127
            q[i:i + 128, j:j + 128] = (tile / 2.0**e).float().to(torch.float8_e4m3fn)
    return q, bits.view(torch.float8_e8m0fnu)


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32 elements of a row: scale 2**(floor(log2(amax)) - 2), codes the nearest E2M1 value
    (saturating at 6), two per byte, element 2j in the low nibble; int8 bytes, E8M0 scales."""
    N, K = w.shape
    blocks = w.double().view(N, K // 32, 32)
    e = torch.floor(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100))) - 2  # [N, K/32]
    y = (blocks / torch.exp2(e)[..., None]).clamp(-6, 6)
    idx = (y.abs()[..., None] - E2M1.double()).abs().argmin(-1)
    codes = (idx | ((y < 0).long() << 3)).view(N, K)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _dequant_fp8(q, bits_or_scale):
    s = bits_or_scale.float()
    N, K = q.shape
    return q.float() * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


def _dequant_fp4(packed, scale):
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], -1).flatten(1)
    vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return vals * scale.float().repeat_interleave(32, 1)


def _released_name(saved: str) -> str:
    bare = saved.removeprefix("model.")
    return "head.weight" if bare == "lm_head.weight" else RELEASED_LEAVES.get(bare, bare)


def save_released_checkpoint(hf, cfg, path, *, scale_dtype=torch.float8_e8m0fnu) -> dict[str, torch.Tensor]:
    """``hf`` saved by transformers, rewritten in the released layout; returns the tensors it
    holds under the saved (``model.``) names, dequantized, for an HF reference."""
    hf.save_pretrained(path)
    saved = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    tensors, values = {}, {}
    for name, t in saved.items():
        out = _released_name(name)
        if ".ffn.experts." in name:  # routed experts: FP4
            q, s = _fp4(t)
            tensors[out], tensors[out[:-len(".weight")] + ".scale"] = q, s
            values[name] = _dequant_fp4(q, s)
        elif name.endswith(FP8_LEAVES):
            q, s = _fp8_pow2(t)
            s = s if scale_dtype == torch.float8_e8m0fnu else s.float()
            tensors[out], tensors[out[:-len(".weight")] + ".scale"] = q, s
            values[name] = _dequant_fp8(q, s)
        elif name.endswith("tid2eid"):
            tensors[out], values[name] = t.to(torch.int32), t
        elif t.dim() == 2:
            tensors[out] = t.to(torch.bfloat16)
            values[name] = tensors[out].float()
        else:
            tensors[out], values[name] = t, t
    tensors["mtp.0.e_proj.weight"] = torch.randn(cfg.hidden_size, cfg.hidden_size).to(torch.bfloat16)
    tensors["mtp.0.attn.wq_a.weight"], tensors["mtp.0.attn.wq_a.scale"] = _fp8_pow2(torch.randn(24, cfg.hidden_size))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, expert_dtype="fp4", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]})
    (path / "config.json").write_text(json.dumps(config))
    return values


def _config():
    # whole 128-row tiles for the fused shared expert; expert K % 32 == 0
    return draw_config(random.Random(fresh_seed()), moe_intermediate_size=128, num_hidden_layers=3,
                       layer_types=TYPES, mlp_layer_types=["hash_moe", "moe", "moe"])


def _spec(quantization=None):
    return EngineSpec(max_batch_size=3, max_seq_len=128, dtype=torch.float32, quantization=quantization)


def _reference(hf, values, path):
    """transformers' model holding the checkpoint's dequantized values, loaded by transformers
    from a ``save_pretrained``-form copy of them (its own name conversion)."""
    import transformers

    hf.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in values.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")


def test_a_save_pretrained_checkpoint_loads_with_transformers_numerics(tmp_path):
    cfg = _config()
    hf = hf_model(cfg, 41)
    hf.save_pretrained(tmp_path / "ckpt")
    engine = RolloutEngine.from_pretrained(str(tmp_path / "ckpt"), _spec())
    ids = torch.randint(0, VOCAB, (2, 70))
    ref = reference(hf, input_ids=ids).logits
    got = engine.logits(ids, torch.ones_like(ids))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_the_released_layout_loads_directly_and_a_refit_requantizes_into_its_bytes(tmp_path, caplog, scale_dtype):
    from hybridrl.refit import refit_from_model

    cfg = _config()
    hf = hf_model(cfg, 42)
    values = save_released_checkpoint(hf, cfg, tmp_path / "ckpt", scale_dtype=scale_dtype)
    with caplog.at_level(logging.INFO, logger="hybridrl.rollout.hf_checkpoint"):
        plain = RolloutEngine.from_pretrained(str(tmp_path / "ckpt"), _spec())
    mtp = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(mtp) == 1 and "3 tensors" in mtp[0] and "[0]" in mtp[0], mtp
    ids = torch.randint(0, VOCAB, (2, 70))
    hf = _reference(hf, values, tmp_path / "dequantized")
    ref = reference(hf, input_ids=ids).logits
    torch.testing.assert_close(plain.logits(ids, torch.ones_like(ids)), ref, rtol=0, atol=1e-4 * float(ref.abs().max()))

    engine = RolloutEngine.from_pretrained(str(tmp_path / "ckpt"), _spec("fp8_block_ue8m0+mxfp4"))
    on_disk = load_file(str(tmp_path / "ckpt" / "model.safetensors"))

    def assert_holds_the_checkpoint_bytes():
        from hybridrl.rollout.models.deepseek_v4.checkpoint import hf_name
        checked = 0
        for disk, t in on_disk.items():
            scale = disk[:-len(".weight")] + ".scale"
            if disk.startswith("mtp.") or scale not in on_disk:
                continue
            route = engine.weight_routes[hf_name(disk)]
            layer = route.layer
            if t.dtype == torch.int8:  # an FP4 expert: its slice of the fused MXFP4 blocks / scales
                blocks = layer.slot(getattr(layer, f"{route.proj}_blocks").data, route.proj, route.expert, route.shard_id)
                scales = layer.slot(getattr(layer, f"{route.proj}_scales").data, route.proj, route.expert, route.shard_id)
                assert torch.equal(blocks, t.view(torch.uint8)), disk
                assert torch.equal(scales, on_disk[scale].view(torch.uint8)), disk
            else:  # block FP8: the same values; the same bytes unless a tile's largest code is <= 224
                rows = route.rows or slice(0, layer.weight.shape[0])
                held, want = layer.weight.data[rows], t
                held_scale, want_scale = layer.method.scale_rows(layer, rows), on_disk[scale].float()
                assert torch.equal(route.held(), _dequant_fp8(want, want_scale)), disk
                same = held_scale == want_scale
                for i, j in zip(*torch.nonzero(~same, as_tuple=True)):
                    # 224 * s == 448 * (s / 2): both scales hold the tile exactly; the smaller is ours
                    tile = want[128 * i:128 * i + 128, 128 * j:128 * j + 128].float().abs().max()
                    assert held_scale[i, j] * 2 == want_scale[i, j] and tile <= 224, disk
                mask = same.repeat_interleave(128, 0)[:held.shape[0]].repeat_interleave(128, 1)[:, :held.shape[1]]
                assert torch.equal(held.view(torch.uint8)[mask], want.view(torch.uint8)[mask]), disk
            checked += 1
        assert checked > 20

    assert_holds_the_checkpoint_bytes()
    refit_from_model(engine, hf_model(cfg, 43), verify=True)  # other weights, then the checkpoint's again
    refit_from_model(engine, hf, verify=True)
    assert_holds_the_checkpoint_bytes()
    fresh_logits = engine.logits(ids, torch.ones_like(ids))
    torch.testing.assert_close(fresh_logits, RolloutEngine.from_pretrained(
        str(tmp_path / "ckpt"), _spec("fp8_block_ue8m0+mxfp4")).logits(ids, torch.ones_like(ids)), rtol=0, atol=0)
