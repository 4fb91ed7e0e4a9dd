"""The FP8 GEMM path (``torch._scaled_mm``) and its floors: compute capability >= 9.0 (an
A100 falls back to the dequantized cache instead of raising), torch >= 2.5 (rowwise scales;
older releases also returned a tuple), and the per-token activation quantization, which is
``torch.compile``d on CUDA with an eager fallback.

CPU: the gate with the capability / version faked, the tuple unwrap with ``_scaled_mm``
faked, the quantizer selection and its fallback with ``torch.compile`` faked.
GPU: the real ``_scaled_mm`` path on Hopper vs a bf16 engine, compiled vs eager activation
quantization, and an engine forced to capability 8.0 (must load, capture and generate).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hybridrl.quant.fp8 import FP8_DTYPE
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.layers import fp8_linear
from hybridrl.rollout.layers.fp8_linear import Fp8LinearMethod
from tests.rollout.conftest import make_config, make_hf_model

CUDA0 = torch.device("cuda", 0)


def _layer(n=256, k=128):
    return SimpleNamespace(output_size=n, input_size=k)


def test_scaled_mm_gate(monkeypatch):
    method = Fp8LinearMethod(block=False, fnuz=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert method._scaled_mm_ok(_layer(), torch.bfloat16, CUDA0)
    for cap in ((8, 0), (8, 9), (7, 5)):  # A100, Ada, Turing: the dequantized path, no raise
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert not method._scaled_mm_ok(_layer(), torch.bfloat16, CUDA0), cap
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert method._scaled_mm_ok(_layer(), torch.bfloat16, CUDA0)
    assert not method._scaled_mm_ok(_layer(), torch.float16, CUDA0)
    assert not method._scaled_mm_ok(_layer(250, 128), torch.bfloat16, CUDA0)
    assert not Fp8LinearMethod(block=True, fnuz=False)._scaled_mm_ok(_layer(), torch.bfloat16, CUDA0)
    assert not method._scaled_mm_ok(_layer(), torch.bfloat16, "cpu")
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")  # no rowwise scales before 2.5
    assert not method._scaled_mm_ok(_layer(), torch.bfloat16, CUDA0)
    monkeypatch.setattr(torch, "__version__", "2.5.0+cu124")
    assert method._scaled_mm_ok(_layer(), torch.bfloat16, CUDA0)


def test_capability_is_asked_about_the_layers_device(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    Fp8LinearMethod(block=False, fnuz=False)._scaled_mm_ok(_layer(), torch.bfloat16, "cuda:3")
    assert asked == [torch.device("cuda", 3)]


def test_fp8_block_holds_one_and_a_half_times_bf16():
    """fp8_block never takes _scaled_mm (CUDA included): fp8 weight + bf16 dequantized cache."""
    from hybridrl.rollout.layers.linear import LinearBase
    cfg = make_config("qwen2", hidden_size=256, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=1)  # q / k / gate shards of 128 rows: whole tiles

    def linear_bytes(eng):
        tensors = {t.data_ptr(): t for m in eng.model.modules() if isinstance(m, LinearBase)
                   for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    block = RolloutEngine(cfg, EngineSpec(max_batch_size=1, max_seq_len=8, dtype=torch.bfloat16,
                                          quantization="fp8_block"))
    bf16 = RolloutEngine(cfg, EngineSpec(max_batch_size=1, max_seq_len=8, dtype=torch.bfloat16))
    assert all(m.weight_dequant_cache is not None for m in block.model.modules() if hasattr(m, "weight_dequant_cache"))
    assert 1.48 <= linear_bytes(block) / linear_bytes(bf16) < 1.52  # biases stay bf16; + block scales


def _reference_scaled_mm(x_fp8, w_t, *, scale_a, scale_b, bias, out_dtype):
    y = (x_fp8.float() @ w_t.float()) * scale_a * scale_b
    return (y if bias is None else y + bias.float()).to(out_dtype)


@pytest.mark.parametrize("old_torch", [False, True])
def test_scaled_mm_result_unwrapped(monkeypatch, old_torch):
    def fake(*args, **kw):
        y = _reference_scaled_mm(*args, **kw)
        return (y, torch.zeros(())) if old_torch else y  # torch < 2.5: (out, amax)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(32, 64, generator=g) * 10).to(FP8_DTYPE)
    s = torch.rand(32, 1, generator=g) + 0.5
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    y = fp8_linear._scaled_mm_linear(x, w, s, bias)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    ref = (x.float() @ (w.float() * s).t() + bias.float())
    torch.testing.assert_close(y.float(), ref, rtol=0.1, atol=0.1 * float(ref.abs().max()))


def test_activation_quantizer_selection_and_fallback(monkeypatch):
    monkeypatch.setattr(fp8_linear, "_compiled_quantize_rows", None)
    compiled = []

    def fake_compile(fn, dynamic=None, **kw):
        compiled.append(dynamic)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert fp8_linear.activation_quantizer("cpu") is fp8_linear.quantize_rows_eager
    chosen = fp8_linear.activation_quantizer(CUDA0)
    assert chosen is not fp8_linear.quantize_rows_eager
    a, b = chosen(x), chosen(x)
    assert compiled == [True], "compiled once, with dynamic shapes (every token count)"
    ref = fp8_linear.quantize_rows_eager(x)
    for got in (a, b):
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])

    def broken(fn, dynamic=None, **kw):
        def run(x2):
            raise RuntimeError("no triton")
        return run

    monkeypatch.setattr(fp8_linear, "_compiled_quantize_rows", None)
    monkeypatch.setattr(torch, "compile", broken)
    got = fp8_linear.activation_quantizer(CUDA0)(x)  # falls back, correct
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
    assert fp8_linear.activation_quantizer(CUDA0) is fp8_linear.quantize_rows_eager  # and stays eager
    monkeypatch.setattr(fp8_linear, "_compiled_quantize_rows", None)
    monkeypatch.setattr(fp8_linear, "COMPILE_ACTIVATION_QUANT", False)
    assert fp8_linear.activation_quantizer(CUDA0) is fp8_linear.quantize_rows_eager


def test_eager_activation_quantization_is_what_it_was():
    """Same ops as before the refactor (scale = amax / 448 in fp32, then a clamped cast)."""
    x = (torch.randn(7, 96) * torch.logspace(-2, 2, 96)).to(torch.bfloat16)
    q, s = fp8_linear.quantize_rows_eager(x)
    want_s = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12).div_(448.0)
    want_q = (x.float() / want_s).clamp_(-448.0, 448.0).to(FP8_DTYPE)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# ---- GPU -----------------------------------------------------------------------------------

def _engines(monkeypatch=None, capability=None):
    cfg = make_config("qwen2", hidden_size=128, intermediate_size=256)  # linear dims multiples of 16
    hf = make_hf_model(cfg)
    if capability is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    spec = EngineSpec(max_batch_size=4, max_seq_len=32, dtype=torch.bfloat16, device="cuda")
    fp8 = RolloutEngine(cfg, dataclasses.replace(spec, quantization="fp8"))
    bf16 = RolloutEngine(cfg, spec)
    for eng in (fp8, bf16):
        eng.load_weights(hf.named_parameters())
    return fp8, bf16


def _fp8_layers(eng):
    return [m for m in eng.model.modules() if hasattr(m, "weight_dequant_cache")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scaled_mm_path_on_this_gpu():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 GEMM needs compute capability 9.0")
    fp8, bf16 = _engines()
    assert all(m.weight_dequant_cache is None for m in _fp8_layers(fp8)), "_scaled_mm serves every layer"
    ids = torch.randint(0, 101, (3, 12), device="cuda")
    mask = torch.ones_like(ids)
    a, b = fp8.logits(ids, mask), bf16.logits(ids, mask)
    assert (a - b).abs().max() <= 0.2 * b.abs().max()  # fp8 weights and activations vs bf16
    out = fp8.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=6, seed=0))
    assert fp8.runner.graphs.replays > 0 and all(len(r) == 6 for r in out.response_token_ids)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_activation_quantization_matches_eager():
    x = (torch.randn(33, 256, device="cuda") * torch.logspace(-2, 2, 256, device="cuda")).to(torch.bfloat16)
    for m in (1, 2, 33):
        q, s = fp8_linear.activation_quantizer(x.device)(x[:m])
        q_ref, s_ref = fp8_linear.quantize_rows_eager(x[:m])
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)  # amax exact; / 448 may be * (1/448)
        # a 1-ulp difference of x / s can round to the neighbouring fp8 value (<= 2^-3 relative,
        # 2^-9 * s below the normal range), rarely
        deq, deq_ref = q.float() * s, q_ref.float() * s_ref
        assert ((deq - deq_ref).abs() <= deq_ref.abs() * 2**-3 + s_ref * 2**-9).all()
        assert (deq != deq_ref).float().mean() < 0.01


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_below_capability_9_falls_back_to_the_dequantized_path(monkeypatch):
    fp8, bf16 = _engines(monkeypatch, capability=(8, 0))  # what an A100 reports
    assert all(m.weight_dequant_cache is not None for m in _fp8_layers(fp8))
    out = fp8.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=6, seed=0))
    assert fp8.runner.graphs is not None and all(len(r) == 6 for r in out.response_token_ids)
