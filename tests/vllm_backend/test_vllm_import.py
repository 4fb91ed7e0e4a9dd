"""What runs without vLLM installed: the one-line error naming the extra, and the
process-state guards the backend wraps around vLLM."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch


def test_missing_vllm_is_one_line_naming_the_extra(monkeypatch):
    from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
    from hybridrl.config import ModelConfig
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine, VllmUnavailableError

    monkeypatch.setitem(sys.modules, "vllm", None)  # hides an installed vLLM: `import vllm` raises
    cfg = builtin_model(builtin_tokenizer(), ModelConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=True)).config
    with pytest.raises(VllmUnavailableError) as info:
        VllmEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=8))
    message = str(info.value)
    assert "pip install 'hybridrl[vllm]'" in message and "\n" not in message
    assert isinstance(info.value, ImportError)


def test_a_folder_named_vllm_is_not_vllm(tmp_path, monkeypatch):
    """A ``vllm`` folder on sys.path (what ``tests/vllm`` was under pytest without vLLM
    installed) imports as an empty namespace package: neither check takes it for vLLM."""
    from hybridrl.vllm_backend import VllmUnavailableError, vllm_available
    from hybridrl.vllm_backend._import import import_vllm

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # import_vllm sets them: restored after
    (tmp_path / "vllm").mkdir()
    saved = sys.modules.pop("vllm", None)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    try:
        assert not vllm_available()
        with pytest.raises(VllmUnavailableError, match="folder on sys.path") as info:
            import_vllm()
        assert "\n" not in str(info.value)
    finally:
        sys.modules.pop("vllm", None)
        if saved is not None:
            sys.modules["vllm"] = saved


def test_importing_the_backend_does_not_import_vllm():
    import subprocess

    code = ("import sys, hybridrl.vllm_backend as b; b.vllm_available(); "
            "from hybridrl.vllm_backend import engine; assert 'vllm' not in sys.modules, 'vllm imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_preserve_torch_state_undoes_what_vllm_does():
    from hybridrl.vllm_backend.isolation import preserve_torch_state

    real, threads = torch.set_num_threads, torch.get_num_threads()
    torch.manual_seed(1)
    random.seed(1)
    want_t, want_r = torch.rand(2), random.random()
    torch.manual_seed(1)
    random.seed(1)
    with preserve_torch_state():  # what vLLM's CPU worker does in-process
        torch.set_num_threads(1)
        torch.set_num_threads = lambda n: None
        torch.manual_seed(0)
        random.seed(0)
        torch.rand(5)
    assert torch.set_num_threads is real and torch.get_num_threads() == threads
    assert torch.equal(torch.rand(2), want_t) and random.random() == want_r


def test_preserve_environ_keeps_only_vllm_variables(monkeypatch):
    from hybridrl.vllm_backend.isolation import preserve_environ

    monkeypatch.setenv("HYBRIDRL_TEST_KEEP", "a")
    monkeypatch.delenv("HYBRIDRL_TEST_NEW", raising=False)
    monkeypatch.delenv("VLLM_HYBRIDRL_TEST", raising=False)
    with preserve_environ():
        os.environ["HYBRIDRL_TEST_KEEP"] = "b"
        os.environ["HYBRIDRL_TEST_NEW"] = "c"
        os.environ["VLLM_HYBRIDRL_TEST"] = "d"
    assert os.environ["HYBRIDRL_TEST_KEEP"] == "a" and "HYBRIDRL_TEST_NEW" not in os.environ
    assert os.environ.pop("VLLM_HYBRIDRL_TEST") == "d"


def test_derived_tensor_attributes_walk_layers_methods_and_kernels():
    """refit's address check also sees tensors a layer, its quantization method or that
    method's kernel hold as plain attributes (vLLM's reload copies only into parameters and
    buffers); host tensors are left out unless asked for (no CUDA graph reads them)."""
    from torch import nn

    from hybridrl.vllm_backend.state_tensors import derived_tensor_attributes

    method = type("Method", (), {"__module__": "vllm.model_executor.layers.fake"})()
    kernel = type("Kernel", (), {"__module__": "vllm.model_executor.kernels.fake"})()
    method.scale, kernel.workspace, method.fp8_linear = torch.ones(1), torch.zeros(4), kernel
    layer = nn.Linear(2, 2)
    layer.cache, layer.quant_method, layer.shared = torch.zeros(3), method, layer.weight
    model = nn.Sequential(layer)
    assert set(dict(derived_tensor_attributes(model, include_host=True))) == {
        "attr:0.cache", "attr:0.quant_method.scale", "attr:0.quant_method.fp8_linear.workspace"}
    assert list(derived_tensor_attributes(model)) == []  # all on the host here
