"""Decode attention through flash-attn's per-row cache lengths (``layers/flash_decode.py``).

CPU: the gate (package, device, dtype, head_dim, compute capability), and the whole decode
path wired to a *reference* stand-in for ``flash_attn_with_kvcache`` (SDPA over each row's
first ``cache_seqlens[b]`` slots): same logits as the masked path, the call shapes a graph
needs (whole cache rows, int32 lengths on the device, no mask), and independence from
kv_len (so a graph over max_seq_len equals eager). Without the package the engine keeps
the masked path. GPU: the real kernel against the SDPA path, in graphs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridrl.rollout import EngineSpec, RolloutEngine
from hybridrl.rollout.layers import flash_decode
from tests.rollout.conftest import VOCAB, make_config, make_hf_model


def reference_flash(calls):
    """A stand-in for flash_attn_with_kvcache with its argument layout, recording calls."""

    def fn(q, k_cache, v_cache, *, cache_seqlens, causal):
        calls.append(dict(q=tuple(q.shape), k=tuple(k_cache.shape), seqlens=cache_seqlens.clone(),
                          causal=causal, k_ptr=k_cache.data_ptr()))
        B, _, H, D = q.shape
        T, KVH = k_cache.shape[1], k_cache.shape[2]
        mask = (torch.arange(T, device=q.device).view(1, T) < cache_seqlens.view(B, 1).long()).view(B, 1, 1, T)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=H != KVH)
        return o.transpose(1, 2)  # (B, 1, H, D)

    return fn


def test_gate(monkeypatch):
    monkeypatch.setattr(flash_decode, "_kernel", lambda: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert flash_decode.usable(cuda, torch.bfloat16, 64)
    assert flash_decode.usable(cuda, torch.float16, 128)
    assert not flash_decode.usable("cpu", torch.bfloat16, 64)
    assert not flash_decode.usable(cuda, torch.float32, 64)  # flash-attn: fp16/bf16 only
    assert not flash_decode.usable(cuda, torch.bfloat16, 20)  # would pad a copy of the cache
    assert not flash_decode.usable(cuda, torch.bfloat16, 512)
    for cap, ok in (((8, 0), True), ((8, 9), True), ((9, 0), True), ((7, 5), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert flash_decode.usable(cuda, torch.bfloat16, 64) is ok, cap
    monkeypatch.setattr(flash_decode, "_kernel", lambda: None)  # package absent
    assert not flash_decode.usable(cuda, torch.bfloat16, 64)
    monkeypatch.setattr(flash_decode, "_kernel", lambda: object())
    monkeypatch.setattr(flash_decode, "USE_FLASH_DECODE", False)
    assert not flash_decode.usable(cuda, torch.bfloat16, 64)


def test_absent_package_keeps_the_masked_path():
    cfg = make_config("qwen2")
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16))
    assert eng.runner.flash_decode is False
    if flash_decode._kernel() is None:  # the package is absent here: CUDA would fall back too
        assert not flash_decode.usable(torch.device("cuda", 0), torch.bfloat16, 64)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # GQA 4/2 heads; llama3 rope
def test_flash_path_matches_masked_path(monkeypatch, family):
    cfg = make_config(family)
    hf = make_hf_model(cfg)
    masked = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32))
    flash = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32))
    for eng in (masked, flash):
        eng.load_weights(hf.named_parameters())
    calls = []
    monkeypatch.setattr(flash_decode, "_kernel", lambda: reference_flash(calls))
    flash.runner.flash_decode = True
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 9, 5])
    prompts = torch.randint(0, VOCAB, (3, 9), generator=g)
    tokens = torch.randint(0, VOCAB, (4, 3), generator=g)
    la, lb = masked.runner.prefill(prompts, lengths), flash.runner.prefill(prompts, lengths)
    for step in range(4):
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
        kv_len = int(lengths.max()) + step + 1
        la = masked.runner.decode(tokens[step], lengths + step, kv_len)
        lb = flash.runner.decode(tokens[step], lengths + step, kv_len)
        # graph-shaped: whole cache rows (T = max_seq_len), one length per row, int32, no mask
        for c in calls[-cfg.num_hidden_layers:]:
            assert c["k"] == (3, 32, cfg.num_key_value_heads, c["q"][-1]) and c["q"][1] == 1
            assert c["seqlens"].dtype == torch.int32 and c["seqlens"].tolist() == (lengths + step + 1).tolist()
            assert c["causal"] is False
    assert len(calls) == 4 * cfg.num_hidden_layers
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flash.runner.kv_cache.k, masked.runner.kv_cache.k, rtol=1e-5, atol=1e-5)


def test_flash_step_does_not_depend_on_kv_len(monkeypatch):
    """What a graph captures (kv_len = max_seq_len) equals the eager step (kv_len = live) bitwise."""
    cfg = make_config("qwen2")
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=32))
    eng.load_weights(make_hf_model(cfg).named_parameters())
    monkeypatch.setattr(flash_decode, "_kernel", lambda: reference_flash([]))
    eng.runner.flash_decode = True
    prompts, lengths = torch.randint(0, VOCAB, (2, 6)), torch.tensor([6, 4])
    eng.runner.prefill(prompts, lengths)
    tokens = torch.tensor([1, 2])
    with torch.inference_mode():
        live = eng.runner.decode_eager(tokens, lengths, int(lengths.max()) + 1)
        graph_like = eng.runner.decode_eager(tokens, lengths, eng.runner.max_seq_len)
    assert torch.equal(live, graph_like)


# ---- GPU -----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(flash_decode._kernel() is None, reason="flash-attn not installed")
def test_real_flash_decode_in_graphs_matches_sdpa():
    cfg = make_config("qwen2")  # head_dim 16: a multiple of 8, as flash-attn wants
    hf = make_hf_model(cfg)
    engines = {}
    for use in (True, False):
        flash_decode.USE_FLASH_DECODE = use
        try:
            eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=64, dtype=torch.bfloat16, device="cuda"))
        finally:
            flash_decode.USE_FLASH_DECODE = True
        eng.load_weights(hf.named_parameters())
        assert eng.runner.flash_decode is use and eng.runner.graphs is not None
        engines[use] = eng
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 11, 7, 5]).cuda()
    prompts = torch.randint(0, VOCAB, (4, 11), generator=g).cuda()
    tokens = torch.randint(0, VOCAB, (5, 4), generator=g).cuda()
    out = {}
    for use, eng in engines.items():
        steps = [eng.runner.prefill(prompts, lengths)]
        for s in range(5):
            steps.append(eng.runner.decode(tokens[s], lengths + s, int(lengths.max()) + s + 1).clone())
        out[use] = steps
        assert eng.runner.graphs.replays == 5
    for a, b in zip(out[True], out[False]):
        # bf16, two attention kernels: a rounding apart per layer
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))
