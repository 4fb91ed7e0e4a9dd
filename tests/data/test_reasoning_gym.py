"""reasoning-gym as a task source (data/reasoning_gym.py) and verifier (rewards/reasoning_gym.py)."""

import json
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'hybridrl[reasoning]')")

from hybridrl.config import ConfigError  # noqa: E402
from hybridrl.config.io import load_config  # noqa: E402
from hybridrl.data.reasoning_gym import ReasoningGymAnswer, draw_splits  # noqa: E402
from hybridrl.rewards import RewardRunner  # noqa: E402

MIXED = "reasoning_gym:chain_sum,basic_arithmetic"
SMALL = {"chain_sum": {"max_digits": 1, "max_terms": 2}}  # 200 distinct questions: the dedup has work to do
TINY = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
    "model.intermediate_size=64", "rollout.n=4", "rollout.max_tokens=6", "batch.prompts_per_step=4",
    "warm_start.batch_size=8", "warm_start.steps=3", "trainer.total_steps=2", "trainer.eval_every=2",
    "data.train_size=64", "data.eval_size=8", "logging.progress=false", "reward.workers=1", "eval.k=2",
]


def _questions(items):
    return [a.entry["question"] for a in items]


def test_splits_disjoint_mixed_and_reproducible():
    train, held_out = draw_splits(MIXED, SMALL, train_size=300, eval_size=60, seed=3)
    tq, eq = _questions(train), _questions(held_out)
    assert len(eq) == 60 and len(set(eq)) == 60
    assert len(set(tq)) == len(tq) and not set(tq) & set(eq)
    # round-robin: chain_sum ran out of questions (200 less the held-out), basic_arithmetic fills in
    assert [a.dataset for a in train[:4]] == ["chain_sum", "basic_arithmetic"] * 2
    assert 100 < sum(a.dataset == "chain_sum" for a in train) <= 200 - 30
    again, again_eval = draw_splits(MIXED, SMALL, train_size=300, eval_size=60, seed=3)
    assert _questions(again) == tq and _questions(again_eval) == eq
    assert [a.entry for a in again] == [a.entry for a in train]
    other, _ = draw_splits(MIXED, SMALL, train_size=300, eval_size=60, seed=4)
    assert _questions(other) != tq


def test_answer_pickles_and_reward_scores():
    from hybridrl.rewards.reasoning_gym import reasoning_gym_reward

    (item,), _ = draw_splits("reasoning_gym:chain_sum", {}, train_size=1, eval_size=0, seed=0)
    item = pickle.loads(pickle.dumps(item))
    gold = item.entry["answer"]
    assert str(item) == gold
    assert reasoning_gym_reward(f" {gold}", item) == 1.0
    assert reasoning_gym_reward(f"so <answer>{gold}</answer>", item) == 1.0
    assert reasoning_gym_reward("<answer>x</answer>", item) == 0.0
    item.tagged = True  # the prompt asked for tags: an untagged response has no answer
    assert reasoning_gym_reward(gold, item) == 0.0


def test_scorer_failure_costs_only_that_sample():
    (good,), _ = draw_splits("reasoning_gym:chain_sum", {}, train_size=1, eval_size=0, seed=0)
    broken = ReasoningGymAnswer("chain_sum", {"question": "?", "metadata": {}})  # no 'answer': score_answer raises
    answers = [good, broken, "not a reasoning-gym answer", good]
    responses = [good.entry["answer"], "1", "1", "wrong"]
    reports = []
    with RewardRunner("reasoning_gym", workers=1, timeout_s=60, report=reports.append) as runner:
        batch = runner.score(responses, answers, ["p"] * 4)
    assert batch.scores == [1.0, 0.0, 0.0, 0.0]
    assert dict(batch.failures) == {"raised KeyError": 1, "raised TypeError": 1}
    assert len(reports) == 2 and all("\n" not in r for r in reports)


@pytest.mark.parametrize("override, expected", [
    ("data.task=reasoning_gym:chain_sums", "did you mean 'chain_sum'?"),
    ("data.task=reasoning_gym:,", "name at least one dataset"),
    ("data.reasoning_gym.chain_sum.min_termz=2", "unknown setting; chain_sum takes min_terms"),
    ("data.reasoning_gym.chain_sum.seed=2", "set by data.seed"),
    ("data.reasoning_gym.chain_sum.min_terms=0", "rejected by reasoning-gym"),
    ("data.reasoning_gym.gcd.min_numbers=2", "not a dataset of data.task"),
])
def test_bad_names_and_settings_are_one_line(override, expected):
    task = [] if override.startswith("data.task") else ["data.task=reasoning_gym:chain_sum"]
    with pytest.raises(ConfigError) as e:
        load_config(None, task + [override])
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_without_the_package_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'hybridrl\[reasoning\]'$"):
        load_config(None, ["data.task=reasoning_gym:chain_sum"])


def test_import_hybridrl_does_not_import_reasoning_gym():
    code = ("import sys, hybridrl, hybridrl.rewards, hybridrl.config.io as io; io.load_config(None, []); "
            "assert 'reasoning_gym' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_two_tasks_train_through_the_build_path(tmp_path):
    from hybridrl.job import loop

    cfg = load_config(None, TINY + [f"data.task={MIXED}", f"trainer.output_dir={tmp_path}", "trainer.run_name=rg"])
    assert cfg.reward.functions == "reasoning_gym"  # the task's default reward
    captured = {}
    real_build = loop.build_run

    def spy(*a, **k):
        captured["run"] = run = real_build(*a, **k)
        return run

    loop.build_run = spy
    try:
        result = loop.train(cfg)
    finally:
        loop.build_run = real_build
    run = captured["run"]
    assert {a.dataset for a in run.step.train_set.answers} == {"chain_sum", "basic_arithmetic"}
    assert not {a.entry["question"] for a in run.step.train_set.answers} & set(run.eval_set.prompt_texts)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r.get("reward/failures", 0) == 0 for r in steps)


def test_small_question_space_is_split_not_starved():
    train, held_out = draw_splits("reasoning_gym:chain_sum", SMALL, train_size=20000, eval_size=256, seed=0)
    tq, eq = _questions(train), _questions(held_out)
    assert not set(tq) & set(eq) and len(set(tq)) == len(tq)
    assert len(eq) <= len(tq) <= len(eq) + 1 and len(tq) + len(eq) > 150  # of 200 questions
