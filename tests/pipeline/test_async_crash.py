"""Crash consistency of an async run: SIGKILL at a random moment, resume, and every
prompt of the run is trained exactly once — none lost from the buffer of finished groups,
none twice — checked against the hand-derived prompt plan (``_async_run.planned_rows``)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

import _seeds
from _async_run import ASYNC_JOB, planned_rows

STEPS = 12
JOB = ASYNC_JOB + [f"trainer.total_steps={STEPS}", "checkpoint.every=1", "checkpoint.keep_last=2",
                   "pipeline.max_staleness=2", "rollout.step_latency_ms=15"]


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "hybridrl", "train", *JOB, f"trainer.output_dir={out}", "trainer.run_name=run"]


def _env() -> dict:
    tests = str(Path(__file__).parents[1] / "trainer")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()), default=0)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def test_sigkill_at_a_random_moment_then_resume_trains_every_prompt_once(tmp_path: Path) -> None:
    kill_after = random.Random(_seeds.fresh_seed()).uniform(2, 8)  # steps done, fractional: mid-step as often as between
    proc = subprocess.Popen(_cmd(tmp_path), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, workers, seen = time.monotonic() + 300, [], {}  # seen: step -> when it was first logged
    while (done := _steps_done(tmp_path / "run")) < int(kill_after) and proc.poll() is None \
            and time.monotonic() < deadline:
        seen.setdefault(done, time.monotonic())
        workers = workers or _children(proc.pid)
        time.sleep(0.02)
    # the fractional part of a step, in this machine's own step time (a fixed sleep let a fast
    # quiet machine finish all the remaining steps before the kill)
    steps = sorted(k for k in seen if k >= 1)
    step_s = (seen[steps[-1]] - seen[steps[0]]) / (steps[-1] - steps[0]) if len(steps) > 1 else 0.05
    time.sleep((kill_after % 1) * step_s)
    workers = workers or _children(proc.pid)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    assert _steps_done(tmp_path / "run") < STEPS, "the run finished before it could be killed"
    assert workers, "no rollout worker process was seen"
    gone = time.monotonic() + 60
    while any(map(_alive, workers)) and time.monotonic() < gone:
        time.sleep(0.1)
    assert not any(map(_alive, workers)), "a rollout worker outlived its killed trainer"

    resumed = subprocess.run(_cmd(tmp_path), env=_env(), capture_output=True, text=True, timeout=600)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-2000:]
    assert "resumed from" in out and "finished prompt groups restored" in out, out[-2000:]

    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=True)
    consumed = [tuple(x) for x in state["step"]["source"]["consumed"].tolist()]
    want = planned_rows(STEPS, prompts_per_step=4)
    assert len(consumed) == len(set((s, g) for s, g, _ in consumed)), "a prompt group was trained twice"
    assert sorted(consumed) == sorted(want), "a prompt was lost or trained out of plan"
    assert consumed == want  # and in the step order
