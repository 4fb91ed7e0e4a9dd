"""``trainer.mode=async`` at ``pipeline.max_staleness=0`` is synchronous training, bit for
bit, on this machine: the same tiny job run both ways in this process must log the same
metrics at every step and end with the same weights.

This holds on any machine (one thread, same kernels for both runs): unlike the golden test
(``tests/trainer/test_golden.py``), it needs no recording of this floating-point environment,
so it never falls back to a tolerance. The reward is a function of the sampled text with
spread inside each group (``_hashed_reward.py``), so every step's update is nonzero and a
batch sampled differently would train differently.
"""

from __future__ import annotations

import math
from pathlib import Path

import _seeds
import pytest
import torch
from _async_run import ASYNC_JOB

HERE = Path(__file__).resolve().parent
SYNC_JOB = [o for o in ASYNC_JOB if o != "trainer.mode=async"]
STEPS = 3
COMMON = [f"trainer.total_steps={STEPS}", f"reward.functions={HERE / '_hashed_reward.py'}:score",
          "algo.kl.coef=0.02", "pipeline.worker_threads=1"]
# the size of the trainer's own engine refit: an async run publishes to its workers instead
SYNC_ONLY = {"refit/bytes"}


def _run(tmp_path: Path, name: str, overrides: list[str]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    result = train(load_config(None, overrides + [f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}"]))
    rows = [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and not k.endswith("_seconds")}
            for row in result.history]
    return rows, load_file(str(tmp_path / name / "checkpoint" / "model.safetensors"))


def _differences(got: list[dict], want: list[dict]) -> list[str]:
    """Every recorded value of ``want`` must be in ``got``, bit for bit (NaN equals NaN)."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} vs {[r['step'] for r in want]}"]
    same = lambda a, b: a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return [f"step {w['step']} {k}: {g.get(k, 'missing')!r} vs {w[k]!r}"
            for g, w in zip(got, want) for k in w if not same(g.get(k), w[k])]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_async_at_staleness_0_equals_sync_bit_for_bit(tmp_path: Path, placement: str) -> None:
    seed = _seeds.fresh_seed()
    job = SYNC_JOB + COMMON + [f"trainer.seed={seed}"]
    sync_rows, sync_weights = _run(tmp_path, "sync", job)
    async_rows, async_weights = _run(tmp_path, "async", job + ["trainer.mode=async", "pipeline.max_staleness=0",
                                                               f"pipeline.placement={placement}"])
    trained = [r for r in sync_rows if "reward/mean" in r]
    assert len(trained) == STEPS and any(r["actor/grad_norm"] > 0 for r in trained), (seed, trained)
    assert all(r.get("async/staleness_max") == 0.0 for r in async_rows if "reward/mean" in r), seed
    sync_keys, async_keys = ({k for r in rows for k in r} for rows in (sync_rows, async_rows))
    assert all(k.startswith("async/") for k in async_keys - sync_keys), (seed, sorted(async_keys - sync_keys))
    assert sync_keys - async_keys <= SYNC_ONLY, (seed, sorted(sync_keys - async_keys))
    problems = _differences(async_rows, [{k: v for k, v in r.items() if k not in SYNC_ONLY} for r in sync_rows])
    assert not problems, f"seed {seed}: async at staleness 0 differs from sync: {problems[:4]}"
    assert sync_weights.keys() == async_weights.keys()
    moved = [k for k in sync_weights if not torch.equal(sync_weights[k], async_weights[k])]
    assert not moved, f"seed {seed}: final weights differ: {moved[:4]}"
