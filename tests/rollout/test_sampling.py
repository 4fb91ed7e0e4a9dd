"""Sampling: seeded reproducibility, batch independence, top-k/top-p support, frequencies."""

import torch
from scipy import stats

from hybridrl.rollout import SamplingParams
from hybridrl.rollout.layers.sampler import SamplingTensors, make_uniforms, sample
from tests.rollout.conftest import make_config, make_hf_model
from hybridrl.rollout import EngineSpec, RolloutEngine


def _engine():
    cfg = make_config("qwen3")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=48))
    engine.load_weights(make_hf_model(cfg).named_parameters())
    return engine


def test_seeded_sampling_reproducible_and_batch_independent():
    engine = _engine()
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=123)
    alone = engine.generate([[1, 2, 3]], p)
    again = engine.generate([[1, 2, 3]], p)
    assert alone.response_token_ids == again.response_token_ids
    mixed = engine.generate([[9, 9, 9, 9, 9, 9], [1, 2, 3], [4]],
                            [SamplingParams(seed=5, max_tokens=3), p, SamplingParams(seed=6, max_tokens=20)])
    assert mixed.response_token_ids[1] == alone.response_token_ids[0]
    other_seed = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=12, seed=124))
    assert other_seed.response_token_ids != alone.response_token_ids
    n2 = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=12, seed=123, n=2))
    assert len(n2.response_token_ids) == 2 and n2.response_token_ids[0] == alone.response_token_ids[0]
    assert n2.response_token_ids[1] != n2.response_token_ids[0]


def _tensors(B, V, temperature, top_k, top_p, steps, seed):
    return SamplingTensors(
        temperature=torch.full((B, 1), temperature), top_k=torch.full((B, 1), top_k if top_k > 0 else V),
        top_p=torch.full((B, 1), top_p), uniforms=make_uniforms([seed + b for b in range(B)], steps, "cpu"),
        all_greedy=False, use_top_k_top_p=top_k > 0 or top_p < 1)


def _expected_probs(logits, temperature, top_k, top_p):
    """Reference: HF-style warpers (top-k, then top-p over the renormalized rest), float64."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    p_sorted = probs[order]
    if top_k > 0:
        p_sorted[top_k:] = 0
    p_sorted = p_sorted / p_sorted.sum()
    before = p_sorted.cumsum(0) - p_sorted
    p_sorted[before >= top_p] = 0
    out = torch.zeros_like(probs)
    out[order] = p_sorted / p_sorted.sum()
    return out


def test_sample_frequencies_chi_square():
    V, B, steps = 12, 400, 10
    logits_row = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 1.5
    logits = logits_row.expand(B, V).contiguous()
    for temperature, top_k, top_p in [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (1.0, 6, 0.7)]:
        st = _tensors(B, V, temperature, top_k, top_p, steps, seed=1000)
        tokens = torch.cat([sample(logits, st, s)[0] for s in range(steps)])
        expected = _expected_probs(logits_row, temperature, top_k, top_p)
        allowed = expected > 0
        counts = torch.bincount(tokens, minlength=V).double()
        assert counts[~allowed].sum() == 0, "sampled a token outside the top-k/top-p set"
        result = stats.chisquare(counts[allowed].numpy(), (expected[allowed] * tokens.numel()).numpy())
        assert result.pvalue > 1e-3, (temperature, top_k, top_p, result)


def test_logprobs_are_before_truncation_and_greedy_is_argmax():
    V, B = 30, 6
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(4))
    st = _tensors(B, V, 0.8, 3, 0.9, 1, seed=0)
    tokens, logprobs = sample(logits, st, 0)
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, ref)
    top3 = logits.topk(3, dim=-1).indices
    assert (tokens[:, None] == top3).any(-1).all()
    st.temperature[2] = 0.0
    tokens, logprobs = sample(logits, st, 0)
    assert tokens[2] == logits[2].argmax()
    torch.testing.assert_close(logprobs[2], torch.log_softmax(logits[2], -1).max())


def test_engine_top_k_only_allowed_tokens():
    engine = _engine()
    prompt = [5, 17, 33]
    out = engine.generate([prompt] * 8, SamplingParams(temperature=1.5, top_k=2, max_tokens=1, seed=3, n=4))
    first = {r[0] for r in out.response_token_ids}
    logits = engine.logits(torch.tensor([prompt]), torch.ones(1, 3, dtype=torch.long))[0, -1]
    assert first <= set(logits.topk(2).indices.tolist())
