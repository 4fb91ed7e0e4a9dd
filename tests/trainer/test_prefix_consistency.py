"""What RL needs of the two forwards, on every family, checked by construction:

- **length independence**: the trainer's log-prob of a token (and the engine's prefill
  logits) do not depend on what follows it or on the rows it is batched with;
- **decode == prefill**: the log-probs the engine reports while sampling equal its own
  prefill of the same tokens;
- **engine == trainer**: those sampling log-probs equal the trainer's on the sampled tokens.

Each draws a fresh seed (printed in every failure message; DeepSeek-V3 / V4 configs drawn from
it: ``tests/rollout/_deepseek.py``, ``_deepseek_v4.py``, V4 with 1-32 indexer heads and
``index_topk`` below and above the block count). Batches mix short and long rows; generations
cross several of V4's compression blocks. fp32 throughout: the forwards differ only in the
order of float32 sums (~1e-6 in a log-prob here); the bound is 1e-5, or twice 32 ulps of the
largest logit's magnitude — of its dot product's absolute sum ``sum_i |h_i||W_ji|`` where the
model shows it, since rounding scales with that, not with a result cancellation made small
(a llama draw measured 1.14e-5 with logits near 1) — far below what a real difference costs
(a wrong indexer pick measured 0.2-2 nats).
"""
from __future__ import annotations

import random

import pytest
import torch

from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy
from tests.rollout import _deepseek as ds
from tests.rollout import _deepseek_v4 as v4
from tests.rollout._deepseek import fresh_seed
from tests.rollout.conftest import make_config, make_hf_model
from tests.rollout.test_moe import make_moe_config

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v4"]
TOL = 1e-5  # fp32 log-probs, see the module docstring


def _logit_tol(logits: torch.Tensor) -> float:
    """Whole-vocabulary logits of two prefills whose GEMMs saw other row counts: each logit
    is a float32 dot product of activations rounded differently, so the difference scales
    with the logits' magnitude: 32 ulps of the largest (seen: up to 8)."""
    return 32 * torch.finfo(torch.float32).eps * float(logits.abs().max())


def _logprob_tol(logits: torch.Tensor, condition: float = 0.0) -> float:
    """A log-prob ``z_t - logsumexp(z)`` moves by at most twice the largest logit error; 1e-5
    below that (the decode and prefill kernels differ only in the order of float32 sums).
    ``condition``: the largest ``sum_i |h_i| |W_ji|`` of the head's dot products
    (:func:`_head_condition`): a float32 dot product's rounding error scales with it, not
    with its result, which cancellation can make small while the error is not."""
    scale = max(float(logits.abs().max()), condition)
    return max(TOL, 2 * 32 * torch.finfo(torch.float32).eps * scale)


def _head_condition(hf, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """``max_{t,j} sum_i |h_ti| |W_ji|`` over the LM head's inputs ``h`` (the final hidden
    states) and weight ``W``: the magnitude a logit's rounding error is proportional to."""
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    h, w = out.hidden_states[-1], hf.get_output_embeddings().weight
    if h.shape[-1] != w.shape[-1]:  # a head with its own mixing first (DeepSeek-V4's hyper-connections)
        return 0.0
    return float((h[mask.bool()].abs().double() @ w.abs().double().T).max())
MAX_SEQ = 160


def _model(family: str, seed: int):
    """(hf config, transformers model) of ``family``, drawn from ``seed`` where the family has
    a drawer; V4 with few indexer heads half of the time (ties at 0 are then common)."""
    if family == "deepseek_v4":
        heads = {} if seed % 2 else {"index_n_heads": 1 + seed % 3}
        return v4.drawn(seed, probe_len=MAX_SEQ, max_position_embeddings=2 * MAX_SEQ, **heads)
    if family == "deepseek_v3":
        cfg = ds.draw_config(random.Random(seed), max_position_embeddings=2 * MAX_SEQ)
        return cfg, ds.hf_model(cfg, seed % 1000)
    make = make_moe_config if family.endswith("_moe") else make_config
    rng = random.Random(seed)
    cfg = make(family, max_position_embeddings=2 * MAX_SEQ, **_drawn_fields(family, rng))
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": rng.choice([1e4, 1e6])}  # transformers 5 reads it there
    kw = {"experts_implementation": "eager"} if family.endswith("_moe") else {}
    return cfg, make_hf_model(cfg, seed % 1000, **kw)


def _drawn_fields(family: str, rng: random.Random) -> dict:
    """The fields that change a dense / MoE computation, drawn: KV heads (MHA, GQA, MQA),
    norm epsilon, tied head (rope theta: ``_model``); MoE: experts, top-k, renormalization, sparse step."""
    fields = dict(num_key_value_heads=rng.choice([1, 2, 4]), rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-2]),
                  tie_word_embeddings=rng.random() < 0.5)
    if family.endswith("_moe"):
        fields.update(num_experts=rng.choice([4, 8]), num_experts_per_tok=rng.randint(1, 3),
                      norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=rng.choice([1, 2]))
    return fields


def _engine(cfg, hf) -> RolloutEngine:
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=MAX_SEQ, dtype=torch.float32))
    eng.load_weights(named_trainer_tensors(hf))
    return eng


def _trainer_logprobs(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return compute_logprobs_entropy(hf, ids, mask, mask, options=ForwardOptions())[0]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_and_engine_prefill_do_not_depend_on_what_follows_or_the_batch(family):
    seed = fresh_seed()
    cfg, hf = _model(family, seed)
    g = torch.Generator().manual_seed(seed)
    L = 130
    ids = torch.randint(0, cfg.vocab_size, (2, L), generator=g)
    full = _trainer_logprobs(hf, ids[1:], torch.ones_like(ids[1:]))  # (1, L)
    eng = _engine(cfg, hf)
    with torch.no_grad():
        full_logits = eng.logits(ids[1:], torch.ones_like(ids[1:]))
    tol = _logprob_tol(full_logits, _head_condition(hf, ids[1:], torch.ones_like(ids[1:])))
    for cut in sorted(torch.randint(8, L, (3,), generator=g).tolist()):
        part = _trainer_logprobs(hf, ids[1:, :cut], torch.ones_like(ids[1:, :cut]))
        gap = _gap(part, full[:, :cut])
        assert gap < tol, f"seed {seed} {family}: trainer log-probs of a {cut}-token prefix move by {gap:.2e} ({tol:.1e})"
        with torch.no_grad():
            part_logits = eng.logits(ids[1:, :cut], torch.ones_like(ids[1:, :cut]))
        gap = _gap(part_logits, full_logits[:, :cut])
        assert gap < _logit_tol(full_logits), \
            f"seed {seed} {family}: engine prefill of a {cut}-token prefix moves by {gap:.2e} (logits)"
    short = int(torch.randint(5, 70, (1,), generator=g))  # row 0 short, row 1 long: one right-padded batch
    mask = torch.ones_like(ids)
    mask[0, short:] = 0
    batched = _trainer_logprobs(hf, ids, mask)
    alone = _trainer_logprobs(hf, ids[:1, :short], mask[:1, :short])
    gap = _gap(batched[0, :short], alone[0])
    assert gap < tol, f"seed {seed} {family}: trainer log-probs of a {short}-token row move by {gap:.2e} in a batch"
    with torch.no_grad():
        batched = eng.logits(ids, mask)[0, :short]
        alone = eng.logits(ids[:1, :short], mask[:1, :short])[0]
    gap = _gap(batched, alone)
    assert gap < _logit_tol(alone), \
        f"seed {seed} {family}: engine prefill of a {short}-token row moves by {gap:.2e} in a batch (logits)"


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_decode_equals_its_prefill_and_the_trainer(family):
    """4 prompts of 5-61 tokens, 64 sampled tokens each (through 4 engine rows)."""
    seed = fresh_seed()
    cfg, hf = _model(family, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 40, 61)]
    eng = _engine(cfg, hf)
    out = eng.generate(prompts, SamplingParams(max_tokens=64, temperature=1.0, seed=seed % 1000))
    scored = out.response_mask.bool() & out.attention_mask.bool()
    scored[:, 0] = False
    for b in range(len(prompts)):  # the engine's own prefill of each finished row
        n = int(out.attention_mask[b].sum())
        seq = out.input_ids[b:b + 1, :n]
        with torch.no_grad():
            logits = eng.logits(seq, torch.ones_like(seq))[0]
        prefill = logits.log_softmax(-1)[:-1].gather(-1, seq[0, 1:, None])[:, 0]
        resp = scored[b, 1:n]
        tol = _logprob_tol(logits, _head_condition(hf, seq, torch.ones_like(seq)))
        gap = _gap(prefill[resp], out.logprobs[b, 1:n][resp])
        assert gap < tol, f"seed {seed} {family} row {b}: decode vs prefill log-probs {gap:.2e} (allowed {tol:.1e})"
        trainer = _trainer_logprobs(hf, out.input_ids[b:b + 1, :n], out.attention_mask[b:b + 1, :n])[0, 1:]
        gap = _gap(trainer[resp], out.logprobs[b, 1:n][resp])
        assert gap < tol, f"seed {seed} {family} row {b}: engine sampling vs trainer log-probs {gap:.2e} ({tol:.1e})"
    trainer = _trainer_logprobs(hf, out.input_ids, out.attention_mask)  # the whole batch at once, too
    with torch.no_grad():
        tol = _logprob_tol(eng.logits(out.input_ids, out.attention_mask),
                           _head_condition(hf, out.input_ids, out.attention_mask))
    gap = _gap(trainer[scored], out.logprobs[scored])
    assert gap < tol, f"seed {seed} {family}: engine sampling vs trainer log-probs {gap:.2e} (allowed {tol:.1e})"
