"""The VL policy's structure: LoRA on the language model only, checkpoints in the VL layout
(save_pretrained and the bucketed export) that transformers' AutoModelForImageTextToText
loads back with the same log-probs."""

import json

import pytest
import torch

from hybridrl.checkpoint.dcp import export_hf
from hybridrl.trainer.forward import compute_logprobs_entropy
from hybridrl.trainer.pretrained import load_pretrained
from tests._seeds import fresh_seed
from tests.trainer._vl import draw_model, draw_rows, pad_rows

ARCHS = ["qwen2_5_vl", "qwen3_vl"]


def _logprobs(model, rows, images):
    with torch.no_grad():
        return compute_logprobs_entropy(model, *pad_rows(rows, "right"), images=images)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_adapts_the_language_model_only(arch):
    pytest.importorskip("peft")
    from hybridrl.config.model import DEFAULT_LORA_TARGETS
    from hybridrl.lora import apply_lora

    seed = fresh_seed()
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=3)
    base = _logprobs(model, rows, images)
    lora = apply_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=DEFAULT_LORA_TARGETS, init="gaussian")
    assert lora.targets and not any("visual" in t.split(".") for t in lora.targets), lora.targets
    assert any(t.endswith("mlp.gate_proj") for t in lora.targets)
    torch.testing.assert_close(_logprobs(lora.model, rows, images), base, rtol=0, atol=1e-6)  # B = 0
    lp, _ = compute_logprobs_entropy(lora.model, *pad_rows(rows, "left"), images=images)
    lp.sum().backward()
    trained = [n for n, p in lora.model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained), f"seed {seed}: {trained[:4]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_and_export_load_as_image_text_to_text(arch, tmp_path):
    from transformers import AutoModelForImageTextToText

    seed = fresh_seed()
    model, tokenizer, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=4)
    expected = _logprobs(model, rows, images)
    saved = tmp_path / "saved"
    model.save_pretrained(saved, safe_serialization=True)
    tokenizer.save_pretrained(saved)
    loaded, loaded_tokenizer = load_pretrained(str(saved), torch.float32)
    assert type(loaded) is type(model) and loaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    torch.testing.assert_close(_logprobs(loaded.eval(), rows, images), expected, rtol=0, atol=0)
    exported = tmp_path / "exported"
    exported.mkdir()
    export_hf(model, exported, bucket_bytes=1 << 16)  # several shards + index
    model.config.save_pretrained(exported)
    names = set(json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        assert names == set(f.keys()), f"seed {seed}: export names differ from save_pretrained's"
    again = AutoModelForImageTextToText.from_pretrained(exported, local_files_only=True).eval()
    torch.testing.assert_close(_logprobs(again, rows, images), expected, rtol=0, atol=0)
