import pytest
import torch

from hybridrl.data.char_tokenizer import build_char_tokenizer
from hybridrl.checkpoint.atomic import save_checkpoint_atomic
from hybridrl.job.model_factory import builtin_model
from hybridrl.config import ModelConfig


def _model(seed):
    tok = build_char_tokenizer()
    return builtin_model(tok, ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True), seed=seed), tok


def test_checkpoint_reloads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = _model(1)
    save_checkpoint_atomic(model, tok, tmp_path / "ckpt", extra_files={"note.txt": "x"})
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt").eos_token_id == tok.eos_token_id


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model, tok = _model(1)
    path = save_checkpoint_atomic(model, tok, tmp_path / "ckpt")
    before = AutoModelForCausalLM.from_pretrained(path).state_dict()
    model2, _ = _model(2)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(type(tok), "save_pretrained", boom)
    with pytest.raises(OSError):
        save_checkpoint_atomic(model2, tok, tmp_path / "ckpt", step=5)
    after = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0"]  # no temp dirs left behind


def test_new_save_repoints_and_prunes(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = _model(1)
    save_checkpoint_atomic(model, tok, tmp_path / "ckpt", step=1)
    model2, _ = _model(2)
    path = save_checkpoint_atomic(model2, tok, tmp_path / "ckpt", step=2)
    again = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(again[k], v) for k, v in model2.state_dict().items())
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-2"]
