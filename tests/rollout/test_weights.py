"""Weight loading: names, specs, in-place writes, checkpoint directories, errors."""

import pytest
import torch

from hybridrl.rollout import EngineSpec, RolloutEngine
from tests.rollout.conftest import VOCAB, make_config, make_hf_model


def test_expected_names_and_specs(family):
    cfg = make_config(family)
    hf = make_hf_model(cfg)
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16))
    hf_state = hf.state_dict()
    expected = set(hf_state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert engine.expected_weight_names() == expected
    for name in expected:
        assert engine.weight_spec(name) == (hf_state[name].shape, torch.float32)
    assert engine.load_weights(hf_state.items()) == expected  # tied lm_head accepted and ignored
    assert engine.weight_version == 1
    assert "model.layers.0.self_attn.qkv_proj" in dict(engine.model.named_modules())


def test_reload_is_in_place_and_takes_effect():
    cfg = make_config("qwen3")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16))
    engine.load_weights(make_hf_model(cfg, seed=0).named_parameters())
    before = {n: t.data_ptr() for n, t in engine.named_state_tensors()}
    ids, mask = torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long)
    other = make_hf_model(cfg, seed=1)
    engine.load_weights(other.named_parameters())
    assert {n: t.data_ptr() for n, t in engine.named_state_tensors()} == before
    assert engine.weight_version == 2
    torch.testing.assert_close(engine.logits(ids, mask), other(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_from_pretrained_sharded_checkpoint(tmp_path):
    cfg = make_config("llama_linear")
    hf = make_hf_model(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    engine = RolloutEngine.from_pretrained(str(tmp_path), max_batch_size=2, max_seq_len=32)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(engine.logits(ids, torch.ones_like(ids)), ref, rtol=1e-4, atol=1e-4)


def test_errors_are_one_line_value_errors():
    cfg = make_config("llama")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16))
    with pytest.raises(ValueError, match="q_proj"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 3))])
    with pytest.raises(ValueError, match="no slot"):
        engine.load_weights([("model.layers.9.mlp.up_proj.weight", torch.randn(3, 3))])
    with pytest.raises(ValueError, match="prompt length"):
        engine.generate([list(range(16))])
    with pytest.raises(ValueError, match="quantization"):
        RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16, quantization="int3"))
    with pytest.raises(ValueError, match="model_type"):
        RolloutEngine({"model_type": "gpt2"}, EngineSpec(max_batch_size=2, max_seq_len=16))
