"""Engine vs transformers: logits (prefill, decode, padded), greedy generation, log-probs."""

import random

import _seeds
import pytest
import torch

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.layers import attention, cpu_linear
from tests.rollout.conftest import VOCAB, make_config, make_hf_model


def _engine(cfg, hf, *, max_batch_size=4, dtype=torch.float32, compile_decode=False, **kw):
    spec = EngineSpec(max_batch_size=max_batch_size, max_seq_len=64, dtype=dtype, compile_decode=compile_decode)
    engine = RolloutEngine(cfg, spec, **kw)
    engine.load_weights(hf.named_parameters())
    return engine


def _use_linear_kernel(monkeypatch, kernel: str) -> None:
    """Route every engine linear (the test models are tiny) through oneDNN, or none."""
    if kernel == "onednn":
        if not cpu_linear._onednn_serves(torch.float32):
            pytest.skip("oneDNN inner product unavailable in this torch build")
        monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_WEIGHT_ELEMENTS", 0)
    else:
        monkeypatch.setattr(cpu_linear, "USE_ONEDNN", False)


def _close(ours, ref):
    ref = ref.to(torch.float32)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("linear_kernel", ["aten", "onednn"])
def test_prefill_logits_match_transformers(family, linear_kernel, monkeypatch):
    _use_linear_kernel(monkeypatch, linear_kernel)
    cfg = make_config(family)
    hf = make_hf_model(cfg)
    engine = _engine(cfg, hf)
    ref_model = make_hf_model(cfg).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 13), generator=g)
    for mask_kind in ("right", "left"):
        mask = torch.ones_like(ids)
        if mask_kind == "right":
            mask[1, 9:] = 0
        else:
            mask[2, :4] = 0
        with torch.no_grad():
            ref = ref_model(input_ids=ids, attention_mask=mask).logits
        ours = engine.logits(ids, mask)
        assert ours.dtype == torch.float32 and ours.shape == (3, 13, VOCAB)
        valid = mask.bool()
        _close(ours[valid], ref[valid])


@pytest.mark.parametrize("decode_kernel,linear_kernel", [("sdpa", "aten"), ("matmul", "onednn")])
def test_decode_logits_match_transformers(family, decode_kernel, linear_kernel, monkeypatch):
    """Prefill prompts of different lengths, then decode fixed tokens step by step (masked
    decode), through both CPU decode-attention kernels and both CPU linear kernels."""
    monkeypatch.setattr(attention, "CPU_MATMUL_DECODE_MIN_BATCH", 1 if decode_kernel == "matmul" else 10**9)
    _use_linear_kernel(monkeypatch, linear_kernel)
    cfg = make_config(family)
    engine = _engine(cfg, make_hf_model(cfg))
    ref_model = make_hf_model(cfg).double()
    g = torch.Generator().manual_seed(2)
    lengths = [5, 11, 8]
    full = torch.randint(0, VOCAB, (3, 11 + 6), generator=g)  # prompt then 6 decoded tokens
    prompts = torch.zeros(3, 11, dtype=torch.long)
    for b, n in enumerate(lengths):
        prompts[b, :n] = full[b, :n]
    lens = torch.tensor(lengths)
    with torch.no_grad():
        ref_rows = [ref_model(full[b:b + 1, :n + 6]).logits[0] for b, n in enumerate(lengths)]
    logits = engine.runner.prefill(prompts, lens)
    for step in range(6):
        ref = torch.stack([ref_rows[b][n + step - 1] for b, n in enumerate(lengths)])
        _close(logits, ref)
        tokens = full[torch.arange(3), lens + step]
        logits = engine.runner.decode(tokens, lens + step, int(lens.max()) + step + 1)


def test_aligned_decode_equals_masked_decode():
    """Equal-length rows decode without a mask and with slice writes; same logits, same cache."""
    cfg = make_config("qwen2")
    hf = make_hf_model(cfg)
    a, b = _engine(cfg, hf), _engine(cfg, hf)
    g = torch.Generator().manual_seed(3)
    prompts, lens = torch.randint(0, VOCAB, (3, 7), generator=g), torch.full((3,), 7)
    la, lb = a.runner.prefill(prompts, lens), b.runner.prefill(prompts, lens)
    for step in range(4):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
        tokens = la.argmax(-1)
        la = a.runner.decode(tokens, lens + step, 7 + step + 1)
        lb = b.runner.decode(tokens, lens + step, 7 + step + 1, aligned=True)
    torch.testing.assert_close(a.runner.kv_cache.k, b.runner.kv_cache.k, rtol=1e-5, atol=1e-5)
    # ... and the aligned step really takes the cheap path: slice writes, no index_put_.
    with torch.profiler.profile() as prof:
        b.runner.decode(tokens, lens + 4, 7 + 4 + 1, aligned=True)
    assert "aten::index_put_" not in {e.key for e in prof.key_averages()}


def test_shared_prompts_prefill_once_same_samples():
    """n samples of a prompt (one prefill, cache rows copied) sample exactly what separate
    requests with the same seeds sample."""
    cfg = make_config("qwen2")
    engine = _engine(cfg, make_hf_model(cfg), max_batch_size=8)
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    shared = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=5, n=3))
    seeds = [5, (5 * 1_000_003 + 1) % 2**62, (5 * 1_000_003 + 2) % 2**62]
    for i, p in enumerate(prompts):
        for j, seed in enumerate(seeds):
            alone = engine.generate([p], SamplingParams(temperature=1.0, max_tokens=6, seed=seed))
            assert shared.response_token_ids[3 * i + j] == alone.response_token_ids[0]
            torch.testing.assert_close(torch.tensor(shared.response_logprobs[3 * i + j]),
                                       torch.tensor(alone.response_logprobs[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_decode_matches_eager():
    """EngineSpec(compile_decode=True) (torch.compile of the decode step) samples what eager mode samples."""
    cfg = make_config("qwen2")
    hf = make_hf_model(cfg)
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38]]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1, stop_token_ids=(7,))
    eager = _engine(cfg, hf).generate(prompts, params)
    compiled = _engine(cfg, hf, compile_decode=True).generate(prompts, params)
    assert compiled.response_token_ids == eager.response_token_ids
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=1e-4, atol=1e-4)


def test_greedy_matches_transformers_generate(family):
    cfg = make_config(family)
    hf = make_hf_model(cfg)
    engine = _engine(cfg, hf)
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, response, reason in zip(prompts, out.response_token_ids, out.finish_reasons):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0,
                          eos_token_id=None)
        assert response == ref[0, len(prompt):].tolist()
        assert reason == "length"
    assert len(set(tuple(r) for r in out.response_token_ids)) == 3  # not degenerate


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_trainer_recomputation(temperature):
    cfg = make_config("qwen3")
    hf = make_hf_model(cfg)
    engine = _engine(cfg, hf)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]
    params = SamplingParams(temperature=temperature, max_tokens=10, seed=7, top_k=20, top_p=0.9)
    out = engine.generate(prompts, params)
    with torch.no_grad():
        logits = hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.double()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[:, :-1] / t, dim=-1).gather(-1, out.input_ids[:, 1:, None])[..., 0]
    expected = torch.zeros_like(out.logprobs, dtype=torch.float64)
    expected[:, 1:] = logp
    expected = expected * out.response_mask
    torch.testing.assert_close(out.logprobs.double(), expected, rtol=0, atol=2e-4)
    for b, p in enumerate(prompts):  # alignment per docs/interfaces.md
        n = len(out.response_token_ids[b])
        assert out.input_ids[b, :len(p)].tolist() == p
        assert out.input_ids[b, len(p):len(p) + n].tolist() == out.response_token_ids[b]
        assert out.response_mask[b].sum() == n and out.attention_mask[b].sum() == len(p) + n
        torch.testing.assert_close(out.logprobs[b, len(p):len(p) + n], torch.tensor(out.response_logprobs[b]))


def test_stop_tokens_and_finish_reasons():
    cfg = make_config("llama")
    engine = _engine(cfg, make_hf_model(cfg))
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    stop = greedy.response_token_ids[0][4]  # force row 0 to stop at its 5th token (or earlier)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,)))
    first = greedy.response_token_ids[0].index(stop)
    assert out.response_token_ids[0] == greedy.response_token_ids[0][:first + 1]
    assert out.finish_reasons[0] == "stop"
    row1 = greedy.response_token_ids[1]
    expect1 = row1[:row1.index(stop) + 1] if stop in row1 else row1
    assert out.response_token_ids[1] == expect1
    assert out.finish_reasons[1] == ("stop" if stop in row1 else "length")


def test_bf16_close_to_float32():
    cfg = make_config("qwen2")
    hf = make_hf_model(cfg)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ref = _engine(cfg, hf).logits(ids, mask)
    ours = _engine(cfg, hf, dtype=torch.bfloat16).logits(ids, mask)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    out = _engine(cfg, hf, dtype=torch.bfloat16).generate([[1, 2, 3]], SamplingParams(max_tokens=5, seed=0))
    assert len(out.response_token_ids[0]) == 5


def _draw_dense(rng: random.Random):
    """A dense config drawn over what changes the computation: family, MHA / GQA / MQA,
    norm epsilon (up to 0.1, where a wrong eps shows), rope theta, Llama's attention / MLP
    biases, tied head, depth."""
    family = rng.choice(["llama", "qwen2", "qwen3"])
    heads = rng.choice([2, 4])
    fields = dict(num_attention_heads=heads, num_key_value_heads=rng.choice([1, heads // 2, heads]),
                  rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-3, 1e-1]), tie_word_embeddings=rng.random() < 0.5)
    if family == "llama":
        fields.update(attention_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.5)
    cfg = make_config(family, **fields)
    cfg.num_hidden_layers = rng.randint(1, 3)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * cfg.num_hidden_layers
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": rng.choice([500.0, 1e4, 1e6])}
    return cfg


@pytest.mark.parametrize("draw", range(3))
def test_drawn_dense_configs_match_transformers_in_fp32_and_bf16(draw):
    """Rows of 7, 30 and 60 tokens in one right-padded batch vs transformers on each row alone.
    fp32 vs transformers in float64: 1e-5 of the largest logit (measured <= 7e-7: the order of
    float32 sums). bf16 vs transformers in bf16: no further from float64 than 2x transformers'
    own bf16 error (measured 0.7-1.1x), a bound that follows bf16's 8-bit mantissa wherever it runs."""
    seed = _seeds.fresh_seed()
    cfg = _draw_dense(random.Random(seed))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 60), generator=g)
    lengths = [7, 30, 60]
    mask = (torch.arange(60)[None] < torch.tensor(lengths)[:, None]).long()
    ref64 = make_hf_model(cfg, seed % 1000).double()
    with torch.no_grad():
        want = torch.cat([ref64(input_ids=ids[b:b + 1, :n]).logits[0] for b, n in enumerate(lengths)])
    scale = float(want.abs().max())
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = make_hf_model(cfg, seed % 1000, dtype=dtype)
        engine = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=64, dtype=dtype))
        engine.load_weights(hf.named_parameters())
        got = engine.logits(ids, mask)
        got = torch.cat([got[b, :n] for b, n in enumerate(lengths)]).double()
        errors[dtype] = float((got - want).abs().max()) / scale
        if dtype == torch.bfloat16:
            with torch.no_grad():
                theirs = torch.cat([hf(input_ids=ids[b:b + 1, :n]).logits[0] for b, n in enumerate(lengths)])
            errors["transformers bf16"] = float((theirs.double() - want).abs().max()) / scale
    assert errors[torch.float32] < 1e-5, f"seed {seed}: {errors} ({cfg.to_diff_dict()})"
    assert errors[torch.bfloat16] < 2 * errors["transformers bf16"], f"seed {seed}: {errors} ({cfg.to_diff_dict()})"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_dense_activation_other_than_silu_is_refused_in_one_line(family):
    from hybridrl.rollout.model_config import parse_hf_config

    with pytest.raises(ValueError, match="hidden_act='gelu'") as err:
        parse_hf_config(make_config(family, hidden_act="gelu"))
    assert "\n" not in str(err.value)
