"""CUDA-graph decode: replay == eager, also after an in-place weight refit (GPU only)."""

import pytest
import torch

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from tests.rollout.conftest import VOCAB, make_config, make_hf_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engines(family="qwen3", seed=0):
    cfg = make_config(family)
    weights = dict(make_hf_model(cfg, seed=seed).named_parameters())
    graph = RolloutEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=64, device="cuda"))
    eager = RolloutEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=64, device="cuda"), enforce_eager=True)
    graph.load_weights(weights.items())
    eager.load_weights(weights.items())
    assert graph.runner.graphs is not None and eager.runner.graphs is None
    return cfg, graph, eager


def _decode_both(graph, eager, B, seed):
    """Same prefill + 5 decode steps on both engines; returns the per-step logits pairs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (B,), generator=g).cuda()
    ids = torch.randint(0, VOCAB, (B, 12), generator=g).cuda()
    tokens = torch.randint(0, VOCAB, (5, B), generator=g).cuda()
    pairs = []
    for engine in (graph, eager):
        out = [engine.runner.prefill(ids, lengths)]
        for step in range(5):
            out.append(engine.runner.decode(tokens[step], lengths + step, int(lengths.max()) + step + 1).clone())
        pairs.append(out)
    return list(zip(*pairs))


@pytest.mark.parametrize("B", [1, 3, 8])  # 3 pads up to the captured size 4
def test_replay_equals_eager(B):
    _, graph, eager = _engines()
    for ours, ref in _decode_both(graph, eager, B, seed=B):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_replay_after_in_place_refit_uses_new_weights():
    cfg, graph, eager = _engines(seed=0)
    addresses = {n: t.data_ptr() for n, t in graph.named_state_tensors()}
    new = dict(make_hf_model(cfg, seed=1).named_parameters())
    graph.load_weights(new.items())
    eager.load_weights(new.items())
    assert {n: t.data_ptr() for n, t in graph.named_state_tensors()} == addresses
    for ours, ref in _decode_both(graph, eager, 4, seed=7):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert graph.generate(prompts, p).response_token_ids == eager.generate(prompts, p).response_token_ids


def test_bf16_graph_generate_runs():
    cfg = make_config("llama")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32, dtype=torch.bfloat16, device="cuda"))
    engine.load_weights(make_hf_model(cfg).named_parameters())
    out = engine.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=8, seed=0))
    assert all(len(r) == 8 for r in out.response_token_ids)
    assert out.logprobs.dtype == torch.float32 and torch.isfinite(out.logprobs).all()


def test_continuous_batching_replays_graphs_across_buckets_and_refits():
    """Requests joining and leaving (the decode batch moves between captured bucket sizes),
    a refit mid-generation (recompute), and a second refit: the graph engine's tokens and
    log-probs equal the eager engine's, every decode of the graph engine was a replay, and
    no address the graphs hold moved."""
    cfg, graph, eager = _engines(seed=0)
    addresses = {n: t.data_ptr() for n, t in graph.named_state_tensors()}
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(13)]
    params = [SamplingParams(temperature=1.0, max_tokens=int(torch.randint(2, 30, (1,), generator=g)), seed=i)
              for i in range(13)]
    new = dict(make_hf_model(cfg, seed=1).named_parameters())
    results = []
    for engine in (graph, eager):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        outs = {}
        for step in range(200):
            if step == 6:
                engine.load_weights(new.items())  # held, recomputed, continued
            outs.update({o.request_id: o for o in engine.step().finished})
            if len(outs) == 13:
                break
        results.append([outs[f"r{i}"] for i in range(13)])
    replays = graph.runner.graphs.replays
    assert replays > 0
    for a, b in zip(*results):
        assert a.token_ids == b.token_ids and a.token_versions == b.token_versions
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
    assert {n: t.data_ptr() for n, t in graph.named_state_tensors()} == addresses
