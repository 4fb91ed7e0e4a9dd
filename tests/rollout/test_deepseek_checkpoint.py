"""DeepSeek-V3 checkpoints on disk: the released block-FP8 layout (``weight_scale_inv``,
128x128 tiles), multi-token-prediction layers, a missing weight, bad configs."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.rollout import EngineSpec, RolloutEngine
from tests.rollout import _deepseek as ds

FP8_MAX = 448.0


def _deepseek_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's own weight quantization, written out here independently of hybridrl:
    per 128x128 tile, scale_inv = amax / 448, q = e4m3(w / scale_inv)."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-N // 128), -(-K // 128))
    for i in range(0, N, 128):
        for j in range(0, K, 128):
            tile = w[i:i + 128, j:j + 128].float()
            s[i // 128, j // 128] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i:i + 128, j:j + 128] = (tile / s[i // 128, j // 128]).to(torch.float8_e4m3fn)
    return q, s


def _quantized(name: str, t: torch.Tensor) -> bool:
    # what DeepSeek-V3's release stores in FP8: every linear of attention and MLPs/experts
    return t.dim() == 2 and "_proj" in name and "embed" not in name


def save_fp8_checkpoint(hf, cfg, path, mtp_layers: int = 1):
    """``hf``'s weights in the released layout, plus ``mtp_layers`` extra decoder layers
    (``model.layers.{num_hidden_layers + i}``, as DeepSeek-V3 ships its MTP module)."""
    path.mkdir()
    tensors, dequantized = {}, {}
    for name, t in hf.state_dict().items():
        if _quantized(name, t):
            q, s = _deepseek_fp8(t)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            expand = s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
            dequantized[name] = q.float() * expand
        else:
            tensors[name] = t.contiguous()
            dequantized[name] = t
    L = cfg.num_hidden_layers
    for i in range(mtp_layers):
        for name, t in list(tensors.items()):
            if name.startswith(f"model.layers.{L - 1}."):
                tensors[name.replace(f"model.layers.{L - 1}.", f"model.layers.{L + i}.")] = t.clone()
        tensors[f"model.layers.{L + i}.eh_proj.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size)
        tensors[f"model.layers.{L + i}.enorm.weight"] = torch.ones(cfg.hidden_size)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config.update(num_nextn_predict_layers=mtp_layers, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def _spec(quantization=None):
    return EngineSpec(max_batch_size=4, max_seq_len=64, dtype=torch.float32, quantization=quantization)


def test_released_fp8_layout_loads_directly_and_mtp_layers_are_skipped(tmp_path, caplog):
    cfg = ds.config(intermediate_size=128, moe_intermediate_size=64, n_shared_experts=2)
    hf = ds.hf_model(cfg, seed=31)
    dequantized = save_fp8_checkpoint(hf, cfg, tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="hybridrl.rollout.hf_checkpoint"):
        engine = RolloutEngine.from_pretrained(str(tmp_path / "ckpt"), _spec())
    mtp = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(mtp) == 1 and f"[{cfg.num_hidden_layers}]" in mtp[0].getMessage()
    with torch.no_grad():
        hf.load_state_dict(dequantized)  # the reference: the checkpoint's values in float32
    ids = torch.randint(0, cfg.vocab_size, (3, 20))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(engine.logits(ids, torch.ones_like(ids)), ref, rtol=1e-5, atol=1e-5)

    # an fp8_block engine holds the checkpoint's own e4m3 tiles
    fp8 = RolloutEngine.from_pretrained(str(tmp_path / "ckpt"), _spec("fp8_block"))
    on_disk = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    kv_b = fp8.model.model.layers[0].self_attn.kv_b_proj
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(kv_b.weight.view(torch.uint8), on_disk[name].view(torch.uint8))
    assert torch.equal(kv_b.weight_scale, on_disk[name + "_scale_inv"])


def test_a_checkpoint_missing_kv_b_proj_is_refused_before_anything_is_written(tmp_path):
    cfg = ds.config()
    hf = ds.hf_model(cfg, seed=32)
    hf.save_pretrained(tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        RolloutEngine.from_pretrained(str(tmp_path / "ckpt"), _spec())
    msg = str(err.value)
    assert "\n" not in msg and "model.layers.1.self_attn.kv_b_proj.weight" in msg and "lacks 1 weight" in msg


@pytest.mark.parametrize("field, value, key", [
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "rope_parameters.rope_type"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("qk_head_dim", 30, "qk_head_dim"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("n_group", 3, "n_group"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
])
def test_bad_deepseek_configs_fail_at_construction_naming_the_key(field, value, key):
    cfg = ds.config()
    setattr(cfg, field, value)
    with pytest.raises(ValueError) as err:
        RolloutEngine(cfg, _spec())
    msg = str(err.value)
    assert "\n" not in msg and f"{key}=" in msg, msg
