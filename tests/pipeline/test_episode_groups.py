"""Agent groups (``pipeline/tasks.py``: ``EpisodeGroups``) when environments fail: an
environment that raises on reset or on a step (real worker processes, ``EnvPool``) ends its
episode, which is then left out of training (all-zero loss mask) and out of its group's GRPO
baseline, and counted. The advantages the step computes from the groups' batch are checked
against a hand computation over the surviving episodes of each group."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest
import torch
import transformers

import _seeds
from hybridrl import algos
from hybridrl.agents.chat_render import ChatRenderer
from hybridrl.agents.env_pool import EnvPool
from hybridrl.agents.episodes import EpisodeLimits, EpisodeRunner
from hybridrl.data.chat_tokenizer import END, build_chat_char_tokenizer
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.pipeline.tasks import EpisodeGroups
from hybridrl.trainer.prompts import PromptSet

SCRIPTED = f"{Path(__file__).resolve().parents[1] / 'agents' / 'envs_for_tests.py'}:Scripted"
N, TURNS, MAX_TOKENS = 4, 2, 32


class IndexedEpisodes:
    """The real pool, each reset's row tagged with its episode's index in its group (the
    runner's episode ids end in ``-{j}``), so the scripted environment knows which it plays."""

    def __init__(self, pool: EnvPool):
        self.pool = pool

    def reset(self, episode_ids: list[str], rows: list[dict]):
        return self.pool.reset(episode_ids, [{**row, "episode": int(e.rsplit("-", 1)[1])}
                                             for e, row in zip(episode_ids, rows)])

    def __getattr__(self, name):
        return getattr(self.pool, name)


@pytest.fixture(scope="module")
def tok():
    return build_chat_char_tokenizer()


@pytest.fixture
def engine(tok):  # weights from the test's seed (the suite seeds torch before each test)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        # every token's embedding gets a constant 1.0 in dimension 0 (the rest ~N(0, 0.02)): after the final norm
        # that dimension is ~sqrt(hidden) at every position, whatever the layers add; the end-of-turn row reads it
        # as a logit ~log(vocab) where the others are ~N(0, 0.1): p(end) ~ 1/2 at every token (measured 0.47-0.50),
        # so a turn ends within MAX_TOKENS but for a chance ~0.53**32 = 2e-9 and every episode plays its script
        model.model.embed_tokens.weight[:, 0] = 1.0
        end_row = torch.zeros(cfg.hidden_size)
        end_row[0] = math.log(len(tok)) / math.sqrt(cfg.hidden_size)
        model.lm_head.weight[tok.convert_tokens_to_ids(END)] = end_row
    eng = RolloutEngine(model.config, EngineSpec(max_batch_size=16, max_seq_len=512))
    eng.load_weights(model.named_parameters())
    return eng


def _script(rng: random.Random, group: int) -> dict:
    """Distinct turn rewards per episode; some episodes fail (group 0: one on reset, one on a
    step, so both paths run every time), always leaving two survivors with different outcomes."""
    rewards = {j: [rng.choice([-1.0, -0.5, 0.0, 0.25, 1.0, 2.0]) for _ in range(TURNS)] for j in range(N)}
    while len({sum(r) for r in rewards.values()}) < N:  # distinct outcomes: every surviving pair has a spread
        rewards[rng.randrange(N)][rng.randrange(TURNS)] += 0.125
    if group == 0:
        failing = rng.sample(range(N), 2)
        return {"rewards": rewards, "fail": {failing[0]: 0, failing[1]: rng.randint(1, TURNS)}}
    return {"rewards": rewards, "fail": {j: rng.randint(0, TURNS) for j in rng.sample(range(N), rng.randint(0, 2))}}


def test_failed_episodes_end_train_nothing_and_stay_out_of_their_groups_baseline(tok, engine):
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    scripts = [_script(rng, g) for g in range(3)]
    texts = [f"task {g}" for g in range(3)]
    train_set = PromptSet([tok.encode(t) for t in texts], scripts, texts)
    with EnvPool(SCRIPTED, workers=2, timeout_s=600) as pool:  # timeout: a hang guard, never reached
        runner = EpisodeRunner(engine, IndexedEpisodes(pool), ChatRenderer(tok), tok,
                               SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), EpisodeLimits(max_turns=TURNS))
        groups = EpisodeGroups(train_set, scorer=None, n=N, pad_id=0, reward_reads=None, discount=1.0,
                               failure_reward=0.0)
        batch_idx = [2, 0, 1]  # the step's draw order, not the set's
        rows = [{"prompt": train_set.prompt_texts[i], "answer": train_set.answers[i]} for i in batch_idx]
        trajs = runner.run(rows, N, [rng.randrange(2**62) for _ in batch_idx])
        per = [trajs[g * N:(g + 1) * N] for g in range(len(batch_idx))]
        sb = groups.assemble(batch_idx, per, [groups.score(i, per[g]) for g, i in enumerate(batch_idx)],
                             torch.device("cpu"))
        assert pool.running == [], f"seed {seed}: an ended episode's environment state is still held"

    where = f"seed {seed}, scripts {[scripts[i] for i in batch_idx]}"
    assert len(trajs) == len(batch_idx) * N, where
    failed = []
    for b, t in enumerate(trajs):
        group, j = divmod(b, N)
        fail = scripts[batch_idx[group]]["fail"].get(j)
        if fail is None:
            assert t.status == "ok" and t.num_turns == TURNS, (where, b, t.status, t.failure)
            continue
        failed.append(b)
        assert t.status == "failed", (where, b, t.status)
        assert "failed on purpose" in t.failure and ("reset" if fail == 0 else "step") in t.failure, (where, t.failure)
        assert t.num_turns == fail, (where, b, t.num_turns)  # it ended where it failed: no turn after
    assert failed and any(trajs[b].num_turns > 0 for b in failed), where  # a step failure had trained-looking tokens

    # left out of training: no loss mask on a failed row, the sampled mask on every other
    mask = sb.update_batch()["response_mask"]
    for b, t in enumerate(trajs):
        trained = int(mask[b].sum())
        if b in failed:
            assert trained == 0, (where, b, trained)
        else:  # every turn sampled at least its end-of-turn token
            assert trained == t.trained_tokens >= TURNS, (where, b, trained)
    # counted (as reward failures of kind "episode failed")
    assert sb.failures == len(failed), where
    assert sb.episode_metrics["agent/failed"] == len(failed) / len(trajs), where

    # the baseline: GRPO over the sampler's rows (as RLStep.advantages runs it) against the
    # hand computation over each group's survivors: A = (s - mean) / (std + eps), unbiased std
    token_rewards = algos.scores_to_token_level_rewards(sb.scores, sb.rollouts.response_mask)
    adv, _ = algos.get_adv_estimator("grpo")(token_level_rewards=token_rewards,
                                             response_mask=sb.rollouts.response_mask, index=sb.index,
                                             norm_adv_by_std_in_grpo=True)
    for group in range(len(batch_idx)):
        script = scripts[batch_idx[group]]
        alive = [j for j in range(N) if j not in script["fail"]]
        outcomes = [sum(script["rewards"][j]) for j in alive]
        mean, std = statistics.fmean(outcomes), statistics.stdev(outcomes)
        for j in alive:
            b = group * N + j
            expected = (sum(script["rewards"][j]) - mean) / (std + algos.advantages.GRPO_EPS)
            got = adv[b][mask[b].bool()]
            assert float(sb.scores[b]) == sum(script["rewards"][j]), (where, b)
            # float32: the scores (multiples of 1/8) are exact, mean and std a few roundings (~1e-7 relative)
            torch.testing.assert_close(got, torch.full_like(got, expected), rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{where}, row {b}: {m}")
    for b in failed:
        assert not adv[b].any(), (where, b)
