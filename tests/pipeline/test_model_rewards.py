"""Rewards from models in every mode of the batch source: a reward model and an LLM judge
are rewards like any other, scored per group as it finishes (``pipeline/tasks.py``), so the
pipeline's invariants hold with them (``test_composition.py``'s jobs and numbering):

- a reward model (its own tokenizer: the arithmetic character vocabulary, while the agent
  policy speaks the chat one): async at ``max_staleness=0`` is sync bit for bit, single-turn
  and agents (the agent's whole transcript scored, ``env.reward_input=transcript``);
- an LLM judge (verdict parser, served by its engine thread) in sync, one-step-off and async
  with agents and single-turn, and async on 2 ranks: every step's rewards are probabilities
  and no sample failed (the judge answers beside the rollout in every mode);
- the policy on vLLM, scored by the reward model.
"""

from __future__ import annotations

import json
from pathlib import Path

import _seeds
import pytest
import torch
from _composition import assert_bitwise_equal, run_job

from tests.rewards.judge_models import random_judge

AGENT_EXACT = ["env.overlap=false", "env.reward_input=transcript"]


def _reward_model(path: Path) -> str:
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from hybridrl.job.model_factory import builtin_tokenizer

    tok = builtin_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, initializer_range=0.3,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("scoring_models")
    return {"rm": _reward_model(out / "rm"), "judge": str(random_judge(out / "judge", seed=5))}


def _reward(kind: str, path: str) -> str:
    options = {"name": kind, "path": path}
    if kind == "judge":
        options.update(parser="verdict", max_batch_size=8, timeout_s=120)
    return f"reward.functions=[{json.dumps(options)}]"


def _extra(task: str, *more: str) -> list[str]:
    return (AGENT_EXACT if task == "agent" else []) + list(more)


@pytest.mark.parametrize("task", ["single_turn", "agent"])
def test_reward_model_async_at_staleness_zero_is_sync(tmp_path, monkeypatch, models, task) -> None:
    seed = _seeds.fresh_seed()
    extra = _extra(task, _reward("reward_model", models["rm"]))
    sync = run_job(tmp_path, "sync", task, extra, seed=seed, monkeypatch=monkeypatch)
    a = run_job(tmp_path, "async", task, extra + ["trainer.mode=async", "pipeline.max_staleness=0"],
                seed=seed, monkeypatch=monkeypatch)
    assert_bitwise_equal(sync, a)
    assert any(r["reward/std"] > 0 for r in sync.steps()), f"seed {seed}: the reward model scored all alike"
    assert all(r["reward/failures"] == 0 for r in sync.steps()), f"seed {seed}"


@pytest.mark.parametrize("mode, task, ranks", [("sync", "agent", 1), ("one_step_off", "single_turn", 1),
                                               ("async", "agent", 1), ("async", "single_turn", 2)])
def test_judge_in_every_mode(tmp_path, monkeypatch, models, mode, task, ranks) -> None:
    seed = _seeds.fresh_seed()
    extra = _extra(task, _reward("judge", models["judge"]), f"trainer.mode={mode}")
    run = run_job(tmp_path, f"{mode}_{task}", task, extra, seed=seed, monkeypatch=monkeypatch, ranks=ranks)
    for row in run.steps():
        assert row["reward/failures"] == 0, f"seed {seed}: {row['reward/failures']} judge failures"
        assert 0.0 < row["reward/mean"] < 1.0, f"seed {seed}: a verdict probability, got {row['reward/mean']}"


def _vllm_available() -> bool:
    try:
        from hybridrl.vllm_backend._import import vllm_available

        return vllm_available()
    except ImportError:
        return False


@pytest.mark.skipif(not _vllm_available(), reason="vLLM not installed (pip install 'hybridrl[vllm]')")
def test_reward_model_scores_a_vllm_policy(tmp_path, monkeypatch, models) -> None:
    seed = _seeds.fresh_seed()
    run = run_job(tmp_path, "vllm", "single_turn", ["rollout.backend=vllm", "model.hidden_size=64",
                                                     "model.intermediate_size=128",
                                                     _reward("reward_model", models["rm"])],
                  seed=seed, monkeypatch=monkeypatch)
    assert all(r["reward/failures"] == 0 for r in run.steps()), f"seed {seed}"
    assert any(r["reward/std"] > 0 for r in run.steps()), f"seed {seed}"
