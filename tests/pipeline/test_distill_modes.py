"""On-policy distillation in every mode of the batch source: the teacher scores whatever
batch the source hands the step, so a run with ``algo.distill.teacher`` keeps the pipeline's
invariants (``test_composition.py``'s numbering):

1. async at ``max_staleness=0`` is sync bit for bit (single-turn and agent episodes; the
   teacher is a checkpoint of a tiny job of the same task, so it shares the policy's
   tokenizer, the chat char tokenizer for agents);
2. 2 ranks == 1 process (``mode=loss``: the divergence term under data parallelism is
   normalized by the global token count, as every loss).

Plus, on the agent runs, the teacher's signal covers the model's tokens only: the logged
reverse KL is a mean over the response mask, which excludes tool output; and ``mode=loss``
logs its term.
"""

from __future__ import annotations

import math
from pathlib import Path

import _seeds
import pytest
from _composition import TASKS, assert_bitwise_equal, assert_same_as_one_process, run_job

AGENT_EXACT = ["env.overlap=false"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> dict[str, str]:
    """A final checkpoint of a tiny job of each task (its own seed: another model than the students')."""
    out = tmp_path_factory.mktemp("teachers")
    with pytest.MonkeyPatch.context() as mp:
        return {task: str(run_job(out, f"teacher_{task}", task, ["checkpoint.save=true"], seed=12345,
                                  monkeypatch=mp, steps=2).dir / "checkpoint") for task in TASKS}


def _extra(task: str, teacher: str, *more: str) -> list[str]:
    return (AGENT_EXACT if task == "agent" else []) + [f"algo.distill.teacher={teacher}", *more]


@pytest.mark.parametrize("task", TASKS)
def test_distillation_async_at_staleness_zero_is_sync(tmp_path: Path, monkeypatch, teachers, task: str) -> None:
    seed = _seeds.fresh_seed()
    extra = _extra(task, teachers[task], "algo.distill.reward_coef=0.5")
    sync = run_job(tmp_path, "sync", task, extra, seed=seed, monkeypatch=monkeypatch)
    a = run_job(tmp_path, "async", task, extra + ["trainer.mode=async", "pipeline.max_staleness=0"],
                seed=seed, monkeypatch=monkeypatch)
    assert_bitwise_equal(sync, a)
    for row in sync.steps():
        kl = row["distill/reverse_kl"]
        assert math.isfinite(kl) and row["distill/teacher_log_prob"] < 0, f"seed {seed}: {row}"
    assert any(r["actor/grad_norm"] > 0 for r in sync.steps()), f"seed {seed}: no gradient, nothing compared"


def test_distillation_loss_two_ranks_equal_one_process(tmp_path: Path, monkeypatch, teachers) -> None:
    seed, task = _seeds.fresh_seed(), "single_turn"
    extra = _extra(task, teachers[task], "algo.distill.mode=loss", "algo.distill.beta=0.3")
    one = run_job(tmp_path, "one", task, extra, seed=seed, monkeypatch=monkeypatch)
    two = run_job(tmp_path, "two", task, extra, seed=seed, monkeypatch=monkeypatch, ranks=2)
    for row in one.steps():
        assert row["distill/jsd_loss"] > 0, f"seed {seed}: the divergence of two models is positive: {row}"
    notes = assert_same_as_one_process(one, two)
    for line in notes:
        print(f"note: {line}")
    first_one, first_two = one.steps()[0], two.steps()[0]
    tol = 1e-5 * max(1.0, abs(first_one["distill/jsd_loss"]))
    assert abs(first_one["distill/jsd_loss"] - first_two["distill/jsd_loss"]) <= tol, \
        f"seed {seed}: step 1's JSD term {first_two['distill/jsd_loss']} on 2 ranks, {first_one['distill/jsd_loss']} in one"
