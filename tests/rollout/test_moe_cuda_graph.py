"""MoE decode under CUDA graphs: routing is data-dependent, shapes are static.

On CPU: the dispatch choice (grouped GEMM only where torch runs it without a host sync
during capture, the dense dispatch otherwise). On a GPU (marked ``cuda``, run by
scripts/gpu_check.sh): replay == eager for fp32 / bf16 MoE engines, and for MXFP4 experts
after three verified refits — the derived dequantized cache a captured graph reads is
refreshed in place, so replay follows the new weights."""

from types import SimpleNamespace

import pytest
import torch

from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.layers import moe_dispatch
from tests.rollout.test_moe import make_moe_config, make_moe_hf_model
from tests.rollout.test_cuda_graph import _decode_both  # prefill + 5 decode steps on both engines
from tests.rollout.test_moe_mxfp4 import perturb_experts



@pytest.mark.parametrize("dtype,fast_grouped,capturing,want", [
    (torch.float32, False, True, "dense"),  # torch's grouped GEMM would sync the host: not capturable
    (torch.bfloat16, False, True, "dense"),  # bf16 on a GPU before sm90: the same
    (torch.bfloat16, True, True, "grouped"),  # bf16 on sm90/sm100: capture-safe
    (torch.float32, False, False, "grouped"),  # eager: the grouped GEMM is fine (a sync is allowed)
    (torch.float64, False, True, "dense"),  # no grouped GEMM for float64 at all
    (torch.float64, False, False, "loop"),
])
def test_dispatch_choice_under_capture(monkeypatch, dtype, fast_grouped, capturing, want):
    monkeypatch.setattr(moe_dispatch, "IMPL", "auto")
    monkeypatch.setattr(moe_dispatch, "_capturing", lambda x: capturing)
    monkeypatch.setattr(moe_dispatch, "_cuda_fast_grouped", lambda device, dt: fast_grouped)
    if moe_dispatch._grouped_mm_fn() is None and want == "grouped":
        pytest.skip("this torch has no grouped GEMM")
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)  # decided from device and dtype only
    assert moe_dispatch._pick_impl(x) == want


def _engines(cfg, hf, dtype, quantization=None):
    spec = EngineSpec(max_batch_size=4, max_seq_len=64, dtype=dtype, device="cuda", quantization=quantization)
    graph, eager = RolloutEngine(cfg, spec), RolloutEngine(cfg, spec, enforce_eager=True)
    for engine in (graph, eager):
        engine.load_weights(hf.named_parameters())
    assert graph.runner.graphs is not None and eager.runner.graphs is None
    return graph, eager


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_replay_equals_eager(dtype, tol, B):
    cfg = make_moe_config("qwen3_moe")
    graph, eager = _engines(cfg, make_moe_hf_model(cfg), dtype)
    for ours, ref in _decode_both(graph, eager, B, seed=B):
        torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mxfp4_replay_follows_three_verified_refits():
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg).cuda()
    graph, eager = _engines(cfg, hf, torch.float32, quantization="mxfp4")
    addresses = {n: t.data_ptr() for n, t in graph.named_state_tensors()}
    caches = {n: c.tensor.data_ptr() for n, c in graph.named_derived_caches()}
    for step in range(3):
        perturb_experts(hf, seed=step)
        refit_from_model(graph, hf, verify=True)
        refit_from_model(eager, hf, verify=True)
        assert {n: t.data_ptr() for n, t in graph.named_state_tensors()} == addresses
        assert {n: c.tensor.data_ptr() for n, c in graph.named_derived_caches()} == caches
        for ours, ref in _decode_both(graph, eager, 3, seed=10 + step):
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    p = SamplingParams(temperature=0.9, max_tokens=12, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert graph.generate(prompts, p).response_token_ids == eager.generate(prompts, p).response_token_ids
