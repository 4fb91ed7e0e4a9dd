"""On-policy distillation's numerics against independent references: the teacher's scoring
pass (our engine, float32) against transformers' forward of the same checkpoint in float64
at the rollout temperature; the generalized JSD against its definition in float64; and the
loss normalization of both modes (advantage through the policy loss, the JSD term) against
hand-derived values for every ``algo.loss_agg_mode``. Configs and inputs drawn per run."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybridrl.algos import LOSS_AGG_MODES, LossAggregation
from hybridrl.algos.distill import generalized_jsd, shifted_jsd
from hybridrl.config import AlgoConfig, BatchConfig, OptimConfig
from hybridrl.config.algo import DistillConfig
from hybridrl.config.model import ModelConfig
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
from hybridrl.trainer.actor import Actor
from hybridrl.trainer.teacher import Distiller, Teacher
from tests._seeds import fresh_seed

EPS32 = torch.finfo(torch.float32).eps


def _teacher_dir(tmp_path, rng: random.Random):
    """A random Qwen2 teacher (sizes drawn) saved with the built-in tokenizer; (dir, hf model, tokenizer)."""
    tok = builtin_tokenizer()
    heads = rng.choice([2, 4])
    spec = ModelConfig(hidden_size=heads * rng.choice([8, 16]), num_hidden_layers=rng.randint(1, 3),
                       num_attention_heads=heads, num_key_value_heads=rng.choice([1, heads]),
                       intermediate_size=rng.choice([32, 96]), tie_word_embeddings=rng.random() < 0.5)
    hf = builtin_model(tok, spec, seed=rng.randrange(2**31))
    with torch.no_grad():  # larger logits than the init's: a peaked distribution, not a uniform one
        hf.get_output_embeddings().weight.mul_(rng.uniform(2.0, 8.0))
    path = tmp_path / "teacher"
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, hf, tok


def _rows(rng: random.Random, vocab: int, count: int):
    """Right-padded rows mixing short and long: (input_ids, attention_mask, response_mask)."""
    lengths = [rng.choice([rng.randint(3, 6), rng.randint(20, 40)]) for _ in range(count)]
    L = max(lengths)
    ids = torch.zeros(count, L, dtype=torch.long)
    att, resp = torch.zeros(count, L, dtype=torch.long), torch.zeros(count, L)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.tensor([rng.randrange(3, vocab) for _ in range(n)])
        att[b, :n] = 1
        resp[b, rng.randint(1, n - 1):n] = 1.0  # a prompt of >= 1 token, then the response
    return ids, att, resp


def _reference_log_probs(hf, ids, att, temperature: float) -> torch.Tensor:
    """float64 transformers forward, one row at a time without padding: log p(ids[t] | ids[:t])."""
    model = hf.double()
    out = torch.zeros(ids.shape, dtype=torch.float64)
    t = 1.0 if temperature == 0 else temperature
    with torch.no_grad():
        for b in range(ids.shape[0]):
            n = int(att[b].sum())
            logits = model(input_ids=ids[b:b + 1, :n]).logits[0].double()
            logp = torch.log_softmax(logits[:-1] / t, dim=-1)
            out[b, 1:n] = logp.gather(-1, ids[b, 1:n, None])[:, 0]
    hf.float()
    return out


@pytest.mark.parametrize("temperature", [0.0, "drawn"])
def test_teacher_log_probs_equal_a_float64_forward_at_the_rollout_temperature(tmp_path, temperature):
    seed = fresh_seed()
    rng = random.Random(seed)
    temperature = rng.uniform(0.4, 1.6) if temperature == "drawn" else temperature
    path, hf, tok = _teacher_dir(tmp_path, rng)
    ids, att, resp = _rows(rng, len(tok), 6)
    distill = DistillConfig(teacher=str(path))
    teacher = Teacher.from_config(distill, tok, temperature=temperature, max_seq_len=ids.shape[1], device="cpu",
                                  max_tokens_per_microbatch=rng.choice([16, 64, 4096]))
    ours = teacher.log_probs(ids, att, resp)
    ref = _reference_log_probs(hf, ids, att, temperature) * resp.double()
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=att).logits
    # a float32 log-prob z_t/T - logsumexp(z/T) moves by at most twice its logits' error
    # (a few ulps of the largest |logit|/T per layer; 64 ulps leaves room for the layers)
    tol = max(1e-5, 2 * 64 * EPS32 * float(logits.abs().max()) / (temperature or 1.0))
    err = float((ours.double() - ref).abs().max())
    assert err <= tol, f"seed {seed}: teacher log-probs differ from float64 by {err:.3g} > {tol:.3g} (T={temperature})"
    assert torch.all(ours[resp == 0] == 0), f"seed {seed}: non-response positions must be 0"


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    rng = random.Random(fresh_seed())
    path, _, tok = _teacher_dir(tmp_path, rng)
    from hybridrl.data.chat_tokenizer import build_chat_char_tokenizer

    other = build_chat_char_tokenizer()
    with pytest.raises(ValueError) as e:
        Teacher.from_config(DistillConfig(teacher=str(path)), other, temperature=1.0, max_seq_len=16, device="cpu",
                            max_tokens_per_microbatch=64)
    msg = str(e.value)
    assert "\n" not in msg and "algo.distill.teacher" in msg and "same tokenizer" in msg
    with pytest.raises(ValueError, match="no Hugging Face checkpoint"):
        Teacher.from_config(DistillConfig(teacher=str(tmp_path / "nowhere")), tok, temperature=1.0, max_seq_len=16,
                            device="cpu", max_tokens_per_microbatch=64)


def _jsd64(s_logits, t_logits, beta, temperature):
    """The definition: m = beta t + (1 - beta) s; beta KL(t||m) + (1 - beta) KL(s||m)."""
    T = 1.0 if temperature == 0 else temperature
    s = torch.softmax(s_logits.double() / T, -1)
    t = torch.softmax(t_logits.double() / T, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = beta * t + (1 - beta) * s
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 1.0, "drawn"])
def test_generalized_jsd_is_its_definition(beta):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    beta = float(torch.rand((), generator=g)) if beta == "drawn" else beta
    temperature = 0.5 + float(torch.rand((), generator=g))
    s, t = torch.randn(3, 7, 11, generator=g) * 3, torch.randn(3, 7, 11, generator=g) * 3
    ours = generalized_jsd(s, t, beta=beta, temperature=temperature)
    ref = _jsd64(s, t, beta, temperature)
    assert torch.allclose(ours.double(), ref, atol=1e-5, rtol=1e-4), f"seed {seed}, beta {beta}"
    assert float(ours.min()) >= -1e-6, f"seed {seed}: a divergence is never negative"


def _hand_agg(values: torch.Tensor, mask: torch.Tensor, mode: str, scale: float) -> float:
    """``algo.loss_agg_mode`` written out with loops (docs/algorithms.md)."""
    rows = [[float(v) for v, m in zip(vr, mr) if m > 0] for vr, mr in zip(values.double(), mask)]
    rows = [r for r in rows if r]
    tokens = [x for r in rows for x in r]
    if mode == "token-mean":
        return math.fsum(tokens) / len(tokens)
    if mode == "token-sum":
        return math.fsum(tokens)
    if mode == "seq-mean-token-sum":
        return math.fsum(math.fsum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return math.fsum(math.fsum(r) / len(r) for r in rows) / len(rows)
    assert mode == "seq-mean-token-sum-norm"
    return math.fsum(math.fsum(r) / scale for r in rows) / len(rows)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_both_signals_are_normalized_as_the_loss_aggregation_says(tmp_path, mode):
    """advantage: the policy loss of one on-policy update (ratio 1) is agg(log pi_s - log pi_t)
    x coef; loss: the JSD term is agg(JSD) x coef — each against the loop above."""
    seed = fresh_seed()
    rng = random.Random(seed)
    temperature = rng.uniform(0.6, 1.4)
    path, hf, tok = _teacher_dir(tmp_path, rng)
    student = builtin_model(tok, ModelConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, intermediate_size=32), seed=rng.randrange(99))
    ids, att, resp = _rows(rng, len(tok), 5)
    coef, scale = rng.uniform(0.3, 2.0), float(ids.shape[1])
    teacher = Teacher.from_config(DistillConfig(teacher=str(path)), tok, temperature=temperature,
                                  max_seq_len=ids.shape[1], device="cpu", max_tokens_per_microbatch=4096)
    t_lp = _reference_log_probs(hf, ids, att, temperature)
    s_lp = _reference_log_probs(student, ids, att, temperature)

    # advantage mode, through the actor's policy loss
    cfg = DistillConfig(teacher=str(path), coef=coef)
    algo = AlgoConfig(loss_agg_mode=mode, distill=cfg)
    actor = Actor(student, optim=OptimConfig(lr=1e-12), algo=algo, temperature=temperature, loss_scale_factor=scale,
                  batch=BatchConfig(shared_prefix=False), distiller=Distiller(teacher, cfg))

    class Ro:  # the rollouts' fields the distiller reads; the student's own log-probs sampled
        input_ids, attention_mask, response_mask, logprobs = ids, att, resp, (s_lp * resp).float()

    adv, metrics = actor.distiller.advantages(torch.zeros_like(resp), Ro, None)
    batch = {"input_ids": ids, "attention_mask": att, "response_mask": resp, "advantages": adv}
    out = actor.update(batch, mini_batch_size=len(ids), epochs=1)
    want = coef * _hand_agg(s_lp - t_lp, resp, mode, scale)
    assert math.isclose(out["actor/pg_loss"], want, rel_tol=1e-4, abs_tol=1e-5), \
        f"seed {seed} {mode}: pg_loss {out['actor/pg_loss']} != hand {want}"
    assert metrics["distill/reverse_kl"] == pytest.approx(_hand_agg(s_lp - t_lp, resp, "token-mean", scale),
                                                          rel=1e-4, abs=1e-5)

    # loss mode: the JSD term of the same update
    beta = rng.random()
    cfg = DistillConfig(teacher=str(path), coef=coef, mode="loss", beta=beta)
    actor = Actor(student, optim=OptimConfig(lr=1e-12), algo=AlgoConfig(loss_agg_mode=mode, distill=cfg),
                  temperature=temperature, loss_scale_factor=scale, batch=BatchConfig(shared_prefix=False),
                  distiller=Distiller(teacher, cfg))
    with torch.no_grad():
        jsd = shifted_jsd(student(input_ids=ids, attention_mask=att).logits.double(),
                          hf(input_ids=ids, attention_mask=att).logits.double(), beta=beta, temperature=temperature)
    batch["advantages"] = torch.zeros_like(resp)
    out = actor.update(batch, mini_batch_size=len(ids), epochs=1)
    want = coef * _hand_agg(jsd, resp, mode, scale)
    assert math.isclose(out["distill/jsd_loss"], want, rel_tol=1e-4, abs_tol=1e-5), \
        f"seed {seed} {mode}: jsd term {out['distill/jsd_loss']} != hand {want}"
    agg = LossAggregation(mode=mode, loss_scale_factor=scale)
    assert math.isclose(float(agg(jsd.float(), resp)) * coef, want, rel_tol=1e-4, abs_tol=1e-5)


def test_groups_scored_as_they_finish_give_the_batch_its_teacher_log_probs(tmp_path):
    """The batch source scores each finished group with the teacher (overlapped with the rest
    of the rollout); the assembled step batch's ``teacher_log_prob`` is the teacher's pass
    over the whole batch (rows scored in other micro-batches: within float32 re-association)."""
    from hybridrl.pipeline.tasks import SingleTurnGroups
    from hybridrl.rewards import RewardRunner
    from hybridrl.rollout.engine import RolloutEngine
    from hybridrl.rollout.sampling_params import SamplingParams
    from hybridrl.trainer.prompts import PromptSet
    from hybridrl.trainer.scoring import RewardScorer

    seed = fresh_seed()
    rng = random.Random(seed)
    path, hf, tok = _teacher_dir(tmp_path, rng)
    teacher = Teacher.from_config(DistillConfig(teacher=str(path)), tok, temperature=1.0, max_seq_len=48,
                                  device="cpu", max_tokens_per_microbatch=4096)
    engine = RolloutEngine.from_pretrained(str(path), max_batch_size=8, max_seq_len=48)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    train = PromptSet(prompts, ["1"] * 3, ["p"] * 3)
    n = 3
    sampling = SamplingParams(n=n, max_tokens=rng.randint(4, 12), temperature=1.0, seed=seed)
    with RewardRunner("exact_match") as runner:
        groups = SingleTurnGroups(train, RewardScorer(runner, tok), sampling, pad_id=0, teacher=teacher)
        outputs, rewards = [], []
        for row in range(3):
            keys = [f"r{row}-{j}" for j in range(n)]
            for w in groups.work(row, seed + row, keys):
                engine.add_request(w.key, w.prompt, w.params)
            done = engine.run_until_finished(keys)
            outputs.append([done[k] for k in keys])
            rewards.append(groups.score(row, outputs[-1]))
        sb = groups.assemble([0, 1, 2], outputs, rewards, torch.device("cpu"))
    ro = sb.rollouts
    whole = teacher.log_probs(ro.input_ids, ro.attention_mask, ro.response_mask)
    got = sb.tensors["teacher_log_prob"]
    with torch.no_grad():
        logits = hf(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    tol = max(1e-5, 2 * 64 * EPS32 * float(logits.abs().max()))
    assert float((got - whole).abs().max()) <= tol, f"seed {seed}"
    assert torch.all(got[ro.response_mask == 0] == 0) and bool((got[ro.response_mask > 0] < 0).all()), f"seed {seed}"
