"""Golden regression: short seeded runs must reproduce recorded metrics bitwise (CPU float32).

Why bitwise: every refactor of the step (component wiring, config plumbing, the engine's
weight-update bracket) must be behaviour-neutral, and "close enough" hides a reordered
reduction or a skipped phase. Timing metrics are excluded (the only non-deterministic
values). One torch thread: at two, a threaded CPU reduction is not bitwise reproducible
run to run, so the recipe pins ``trainer.threads=1``.

Bitwise holds only on the floating-point environment that recorded the numbers, and that
is more than torch's CPU capability: two machines that both report ``AVX512`` (and the
same torch) were seen to differ from step 1 on (the BLAS dispatches by vendor, not by
capability). So a recording is kept per *environment*:
``golden/<CAPABILITY>/<variant>/<case>.json``, where a variant names the environment's
fingerprint (``fp_fingerprint.py``: a hash of torch/transformers kernels on fixed inputs,
computed without hybridrl, so a hybridrl change cannot move it). A run passes when it
equals one recording of its capability and torch version bitwise. When none is equal:

- a recording with this machine's fingerprint exists: the change moved the numbers;
  fail with the differences against it;
- none has this fingerprint (a new kind of machine): say so in one line (a
  ``GoldenNotRecorded`` warning: which capability and fingerprint are missing, how to
  record them), then check what holds across CPU kernels, and fail if that does not:
  the logged steps and metric keys of the full run, and the portable run
  (``golden_portable.py``: the recipe's first steps from stored weights, within a
  tolerance measured across three kernel sets). A missing recording never makes the
  test weaker silently, nor red for a reason unrelated to the change.

The recording's default values are pinned in ``COMMON``: a later change of a default
(a task setting of the default job) does not re-record, the recipe stays under test.

Record this machine (a new environment, or a change of numbers that is intended and
explained in the commit):
    HYBRIDRL_RECORD_GOLDEN=1 python -m pytest tests/trainer/test_golden.py
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import golden_portable
from suite_warnings import GoldenNotRecorded
from fp_fingerprint import fingerprint

GOLDEN_DIR = Path(__file__).parent / "golden"
COMMON = ["warm_start.steps=40", "trainer.total_steps=20", "trainer.eval_every=10", "trainer.threads=1",
          "checkpoint.save=false", "logging.tensorboard=false", "logging.plot=false",
          "logging.progress=false", "data.train_size=2000", "data.eval_size=64",
          # the defaults of the recording; the default job's task settings changed since
          # (a slower, longer warm start from an imperfect teacher, pass@8 in the eval: see
          # README), the recipe under test did not
          "warm_start.lr=3e-3", "data.teacher_carry_slip=0", "eval.k=0"]
CASES = {
    # the default job (GRPO, on-policy, no reference), shortened
    "default": [],
    # PPO with a critic, KL as a reward penalty, 2 epochs over 4 mini-batches (old log-probs pass)
    "ppo_gae_kl_penalty": ["algo.advantage.estimator=gae", "algo.kl.coef=0.05", "algo.kl.use_loss=false",
                           "batch.mini_batch_size=64", "batch.ppo_epochs=2", "batch.prompts_per_step=32"],
    # ReMax (greedy baselines), KL loss, truncated IS, FP8 rollout weights, seq-mean aggregation
    "remax_kl_loss_tis_fp8": ["algo.advantage.estimator=remax", "algo.kl.coef=0.01", "algo.correction.tis_cap=2.0",
                              "rollout.quantization=fp8", "algo.loss_agg_mode=seq-mean-token-mean"],
}
RECORD_HINT = "HYBRIDRL_RECORD_GOLDEN=1 python -m pytest tests/trainer/test_golden.py"


@dataclass(frozen=True)
class FloatEnv:
    capability: str  # torch.backends.cpu.get_cpu_capability()
    torch: str
    fingerprint: str

    def describe(self) -> str:
        return f"CPU capability {self.capability}, torch {self.torch}, fingerprint {self.fingerprint}"


@functools.cache
def this_env() -> FloatEnv:
    return FloatEnv(torch.backends.cpu.get_cpu_capability(), torch.__version__, fingerprint())


@dataclass(frozen=True)
class Recording:
    path: Path
    fingerprint: str | None  # None: recorded before fingerprints (its machine is named in `machine`)
    torch: str
    rows: list


def recordings(case: str, capability: str | None = None) -> list[Recording]:
    """Every recording of ``case`` (of one capability, or of all)."""
    found = []
    for path in sorted(GOLDEN_DIR.glob(f"{capability or '*'}/*/{case}.json")):
        data = json.loads(path.read_text())
        found.append(Recording(path, data.get("fingerprint"), data["torch"], data["rows"]))
    return found


def _is_timing(key: str) -> bool:
    return key.startswith(("time/", "perf/")) or key.endswith("_seconds")


def run_overrides(overrides: list[str], out_dir: Path) -> list[dict]:
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    cfg = load_config(None, overrides + [f"trainer.output_dir={out_dir}"])
    result = train(cfg)
    return [{k: v for k, v in row.items() if not _is_timing(k)} for row in result.history]


def run_case(overrides: list[str], out_dir: Path) -> list[dict]:
    return run_overrides(COMMON + overrides, out_dir)


def _equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def bitwise_differences(rows: list[dict], want: list[dict]) -> list[str]:
    """Why ``rows`` is not ``want`` bit for bit (new metrics may be added; every recorded
    one must still be logged, unchanged); empty when equal."""
    if len(rows) != len(want):
        return [f"{len(rows)} logged steps, recorded {len(want)}"]
    problems = []
    for got, rec in zip(rows, want):
        missing = set(rec) - set(got)
        if missing:
            problems.append(f"step {rec['step']}: metrics no longer logged: {sorted(missing)}")
        bad = {k: (got[k], rec[k]) for k in rec if k in got and not _equal(got[k], rec[k])}
        if bad:
            problems.append(f"step {rec['step']}: metrics differ (got, recorded): {bad}")
    return problems


def judge(case: str, rows: list[dict], env: FloatEnv, overrides: list[str], tmp_path: Path) -> None:
    """Pass, or raise AssertionError, by the rules in the module docstring. ``overrides``
    are the case's recipe (the portable run uses them when no recording applies)."""
    mine = [r for r in recordings(case, env.capability) if r.torch == env.torch]
    if any(not bitwise_differences(rows, r.rows) for r in mine):
        return
    same_env = [r for r in mine if r.fingerprint == env.fingerprint]
    if same_env:
        problems = bitwise_differences(rows, same_env[0].rows)
        raise AssertionError(f"{case}: differs from {same_env[0].path} (this machine's environment): "
                             + "; ".join(problems[:2]))
    known = ", ".join(str(r.path.parent.relative_to(GOLDEN_DIR)) for r in recordings(case)) or "none"
    warnings.warn(GoldenNotRecorded(
        f"golden {case}: no recording for this machine ({env.describe()}; recorded: {known}), so the bitwise "
        f"check cannot run here and the portable check runs instead; to record this machine: {RECORD_HINT}"))
    structure = [p for p in (golden_portable.compare(rows, r.rows, rtol=math.inf, atol=math.inf)
                             for r in recordings(case)[:1]) for p in p]
    assert not structure, f"{case}: the run's steps or metric keys changed: {structure[:3]}"
    want = json.loads((golden_portable.PORTABLE_DIR / f"{case}.json").read_text())["rows"]
    got = golden_portable.run_portable(overrides, COMMON, tmp_path / "portable")
    problems = golden_portable.compare(got, want)
    assert not problems, (f"{case}: the portable run (golden_portable.py) differs beyond rounding "
                          f"(rtol {golden_portable.RTOL}): " + "; ".join(problems[:4]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, tmp_path: Path) -> None:
    rows = run_case(CASES[case], tmp_path)
    env = this_env()
    if os.environ.get("HYBRIDRL_RECORD_GOLDEN"):
        path = GOLDEN_DIR / env.capability / env.fingerprint / f"{case}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cpu_capability": env.capability, "torch": env.torch,
                                    "fingerprint": env.fingerprint, "machine": _machine(),
                                    "overrides": CASES[case], "rows": rows}, indent=1))
        pytest.skip(f"recorded {path}")
    judge(case, rows, env, CASES[case], tmp_path)


# the thread on the default recipe, the worker process (shared-memory refits) on PPO with a
# critic and an old-log-prob pass: each placement and each recipe once
@pytest.mark.parametrize("case,placement", [("default", "colocated"), ("ppo_gae_kl_penalty", "disaggregated")])
def test_staleness_0_is_synchronous_training(case: str, placement: str, tmp_path: Path) -> None:
    """``trainer.mode=async`` with ``pipeline.max_staleness=0``: the rollout worker (a thread,
    or a process refit through shared memory) generates each step only after the previous
    update, so the run must be the synchronous recording, bit for bit (the pipeline's own
    ``async/*`` metrics are extra keys)."""
    overrides = CASES[case] + ["trainer.mode=async", "pipeline.max_staleness=0", f"pipeline.placement={placement}"]
    rows = run_case(overrides, tmp_path)
    assert all(row.get("async/staleness_max", 0.0) == 0.0 for row in rows)
    judge(case, rows, this_env(), overrides, tmp_path)


def _machine() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- the rules themselves, on one case (its recorded rows stand in for a fresh full run) --

PPO = "ppo_gae_kl_penalty"
ELSEWHERE = FloatEnv("NEON", torch.__version__, "0" * 16)  # a capability nothing is recorded for


def test_an_unrecorded_machine_says_so_and_passes_the_unchanged_recipe(tmp_path: Path) -> None:
    rows = recordings(PPO)[0].rows
    with pytest.warns(GoldenNotRecorded, match=r"no recording for this machine \(CPU capability NEON.*"
                                               r"HYBRIDRL_RECORD_GOLDEN=1"):
        judge(PPO, rows, ELSEWHERE, CASES[PPO], tmp_path)


def test_an_unrecorded_machine_still_fails_a_changed_recipe(tmp_path: Path) -> None:
    rows = recordings(PPO)[0].rows
    changed = CASES[PPO] + ["algo.policy_loss.clip_ratio_low=0.25", "algo.policy_loss.clip_ratio_high=0.25"]
    with pytest.warns(GoldenNotRecorded), pytest.raises(AssertionError, match="pg_clipfrac"):
        judge(PPO, rows, ELSEWHERE, changed, tmp_path)


def test_an_unrecorded_machine_fails_a_run_that_lost_a_metric(tmp_path: Path) -> None:
    rows = [{k: v for k, v in row.items() if k != "actor/pg_clipfrac"} for row in recordings(PPO)[0].rows]
    with pytest.warns(GoldenNotRecorded), pytest.raises(AssertionError, match="no longer logged"):
        judge(PPO, rows, ELSEWHERE, CASES[PPO], tmp_path)


def test_a_recorded_machine_fails_any_change_of_bits(tmp_path: Path, monkeypatch) -> None:
    recorded = recordings(PPO)[0]
    env = FloatEnv("AVX512", recorded.torch, "f" * 16)
    same_machine = Recording(recorded.path, env.fingerprint, recorded.torch, recorded.rows)
    monkeypatch.setattr(sys.modules[__name__], "recordings", lambda case, capability=None: [same_machine])
    rows = [dict(row) for row in recorded.rows]
    rows[3]["actor/pg_loss"] = math.nextafter(rows[3]["actor/pg_loss"], math.inf)  # one ulp
    with pytest.raises(AssertionError, match="this machine's environment"):
        judge(PPO, rows, env, CASES[PPO], tmp_path)
