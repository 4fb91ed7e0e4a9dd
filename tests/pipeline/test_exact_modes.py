"""``rollout.exact`` in the modes its first engine refused (agents, several ranks), now that
the built-in engine itself is batch-invariant (``tests/exact/test_engine_exact.py``).

Each run sets ``rollout.exact_recompute=true``: every step also runs the trainer's old-log-
prob pass and *fails the job* if a single response token's log-prob differs from the
engine's by one bit (``RLStep._check_exact``). So a passing run is a bitwise check on every
sampled token of every step — multi-turn episodes with tool messages (their KV continued
from a retained prefix or re-prefilled), and each rank's engine against its own FSDP2
shard of the trainer.
"""

from __future__ import annotations

from pathlib import Path

import _seeds
import pytest
from _composition import run_job

EXACT = ["rollout.exact=true", "rollout.exact_recompute=true"]


def _checked(run) -> None:
    steps = run.steps()
    assert steps and all(r["actor/exact_mismatched_tokens"] == 0.0 for r in steps), run.label()
    assert all(r["actor/tis_ratio_mean"] == 1.0 for r in steps if "actor/tis_ratio_mean" in r), run.label()


def test_agent_episodes_with_tool_turns_are_bitwise(tmp_path: Path, monkeypatch) -> None:
    seed = _seeds.fresh_seed()
    run = run_job(tmp_path, "agent", "agent", EXACT, seed=seed, monkeypatch=monkeypatch)
    _checked(run)
    assert any(r["agent/tool_calls"] > 0 and r["agent/turns"] > 1 for r in run.steps()), \
        f"{run.label()}: no episode reached a second turn, the multi-turn path was not checked"


def test_two_ranks_each_engine_against_its_own_scoring(tmp_path: Path, monkeypatch) -> None:
    seed = _seeds.fresh_seed()
    run = run_job(tmp_path, "two", "single_turn", EXACT, seed=seed, monkeypatch=monkeypatch, ranks=2)
    _checked(run)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_language_job_is_bitwise(tmp_path: Path, monkeypatch, arch: str) -> None:
    """A VL policy on the shapes task: pictures through the engine's tower and the trainer's,
    every token checked, the update differentiating through the exact attention."""
    seed = _seeds.fresh_seed()
    vl = ["data.task=shapes", "data.max_prompt_length=64", "rollout.max_tokens=3", f"model.arch={arch}"]
    run = run_job(tmp_path, arch, "single_turn", vl + EXACT, seed=seed, monkeypatch=monkeypatch)
    _checked(run)
    assert any(r["actor/grad_norm"] > 0 for r in run.steps()), f"{run.label()}: no gradient"
