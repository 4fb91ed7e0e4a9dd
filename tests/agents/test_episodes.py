"""Episodes token-in/token-out with Qwen's real BPE and ChatML templates: the trained ids are
the sampled ids turn by turn, the mask is 0 exactly on environment spans, the trainer's
log-probs on the sampled tokens equal the engine's, and the template check catches
templates that rewrite the history."""

from __future__ import annotations

import random

import pytest
import torch

from hybridrl.agents.chat_render import ChatRenderer, TemplateError, check_template
from hybridrl.agents.episodes import EpisodeLimits, EpisodeRunner, truncate_middle
from hybridrl.agents.types import EnvStep
from hybridrl.rollout import SamplingParams
from tests.agents.qwen_chat import QWEN3_STYLE, TRIMS, qwen_tokenizer
from tests.agents.tiny_agent import EchoEnv, Recording, tiny_engine


def test_trained_ids_are_the_sampled_ids_and_the_mask_is_zero_on_environment_spans(tok, model):
    engine = Recording(tiny_engine(model))
    renderer = ChatRenderer(tok)
    env = EchoEnv(seed=random.randrange(1 << 30))
    runner = EpisodeRunner(engine, env, renderer, tok, SamplingParams(temperature=1.0, max_tokens=24),
                           EpisodeLimits(max_turns=5, tool_response_tokens=16))
    rows = [{"prompt": "Compute 12 + 30 with the tool."}, {"prompt": "Say hello in French."}]
    trajs = runner.run(rows, n=2, seeds=[random.randrange(1 << 30) for _ in rows])
    assert len(trajs) == 4 and any(t.num_turns > 1 for t in trajs)
    for t in trajs:
        sampled_mask = [0] * len(t.ids)
        for k, (a, b) in enumerate(t.turns):
            out = engine.outputs[f"{t.episode_id}/t{k}"]
            assert t.ids[a:b] == out.token_ids  # exactly what the engine sampled
            assert t.logprobs[a:b] == out.logprobs and t.versions[a:b] == out.token_versions
            sampled_mask[a:b] = [1] * (b - a)
            if k + 1 < len(t.turns):  # between turns: the tool message rendered on its own, never trained
                env_span = t.ids[b:t.turns[k + 1][0]]
                assert env_span and tok.decode(env_span).startswith("\n<|im_start|>user\n<tool_response>")
        assert t.loss_mask == sampled_mask
        if t.status == "ok":  # the whole episode re-rendered by the template is the appended ids
            msgs = [{"role": "user", "content": rows[t.row]["prompt"]}]
            text = tok.decode(t.ids[len(t.prompt_ids):])
            assert tok.decode(t.ids).startswith(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
            assert text.count("<|im_end|>") >= t.num_turns


def test_the_trainers_log_probs_on_sampled_tokens_equal_the_engines(tok, model):
    """The trainer's own batched log-prob pass over the step's rollouts (padded, several
    episodes, environment spans masked) against the engine's sampling log-probs, fp32."""
    from hybridrl.agents.trajectory import trajectories_to_rollouts
    from hybridrl.trainer.logprobs import logprobs_in_microbatches

    engine = tiny_engine(model)
    runner = EpisodeRunner(engine, EchoEnv(seed=1), ChatRenderer(tok), tok,
                           SamplingParams(temperature=1.0, max_tokens=16), EpisodeLimits(max_turns=4))
    trajs = runner.run([{"prompt": "Hi there, use the echo tool."}, {"prompt": "Again."}], n=2,
                       seeds=[random.randrange(1 << 30) for _ in range(2)])
    ro = trajectories_to_rollouts(trajs, pad_token_id=tok.pad_token_id)
    trained, _ = logprobs_in_microbatches(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                          temperature=1.0, max_tokens=4096)
    mask = ro.response_mask.bool()
    assert int(mask.sum()) == sum(t.trained_tokens for t in trajs) > 0
    torch.testing.assert_close(trained[mask], ro.logprobs[mask], rtol=0, atol=1e-5)
    for b, t in enumerate(trajs):  # the environment spans are in the sequence, never in the mask
        assert ro.input_ids[b, :len(t.ids)].tolist() == t.ids and ro.response_mask[b, len(t.ids):].sum() == 0


def test_the_template_check_passes_chatml_and_names_what_rewriting_templates_do(tok):
    check_template(ChatRenderer(tok))
    with pytest.raises(TemplateError, match="strips the <think> blocks") as e:
        check_template(ChatRenderer(qwen_tokenizer(QWEN3_STYLE)), "qwen3-style")
    assert "\n" not in str(e.value) and "prefix-preserving template" in str(e.value)
    with pytest.raises(TemplateError, match="trims the whitespace") as e:
        check_template(ChatRenderer(qwen_tokenizer(TRIMS)), "trimming")
    assert "\n" not in str(e.value)


def test_tool_responses_are_cut_in_the_middle_and_an_exact_fit_is_kept(tok):
    ids = tok.encode(" ".join(str(i) for i in range(200)), add_special_tokens=False)
    same, marker = truncate_middle(ids, len(ids), tok)
    assert same == ids and marker is None
    cut, marker = truncate_middle(ids, 40, tok)
    assert len(cut) <= 40 and cut[:5] == ids[:5] and cut[-5:] == ids[-5:] and "tokens cut" in tok.decode(cut)


def test_turn_and_context_limits_end_episodes_truncated(tok, model):
    engine = tiny_engine(model, max_seq_len=160)

    class Endless(EchoEnv):
        def step(self, items):
            return [EnvStep(messages=[{"role": "tool", "name": "echo", "content": "more " * 8}]) for _ in items]

    for limits, why in ((EpisodeLimits(max_turns=2), "turns"), (EpisodeLimits(max_turns=50), "context")):
        runner = EpisodeRunner(engine, Endless(seed=0), ChatRenderer(tok), tok,
                               SamplingParams(temperature=0.0, max_tokens=8), limits)
        (t,) = runner.run([{"prompt": "go"}], n=1, seeds=[3])
        assert t.status == "truncated"
        assert t.num_turns == 2 if why == "turns" else len(t.ids) < 160
    assert not engine.has_unfinished_requests() and not engine.scheduler.prefixes.entries  # nothing left behind
