"""Crash consistency of the standard agentic recipe: an **async agentic run at 2 ranks**
(calculator tool episodes, 2 FSDP ranks, a rollout worker process per rank with its own
environment workers) is SIGKILLed at a random moment and resumed: every (step, group) of
every rank is trained exactly once, in the plan's order — checked against the hand-derived
prompt plan (each rank trains its contiguous share of every step's draw) — and no rank,
rollout worker or environment process outlives the killed launcher."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

import _seeds

STEPS, PROMPTS, TRAIN = 10, 4, 200
JOB = ["--config", "examples/calculator_agent.yaml", "warm_start.steps=10", f"trainer.total_steps={STEPS}",
       "trainer.eval_every=100", "checkpoint.every=1", "checkpoint.keep_last=2", "logging.tensorboard=false",
       "logging.plot=false", "logging.progress=false", f"data.train_size={TRAIN}", "data.eval_size=4",
       f"batch.prompts_per_step={PROMPTS}", "rollout.n=2", "rollout.max_tokens=16", "launcher.nproc_per_node=2",
       "trainer.mode=async", "pipeline.max_staleness=2", "rollout.step_latency_ms=10", "env.latency_ms=20"]
ROOT = Path(__file__).resolve().parents[2]


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "hybridrl", "train", *JOB, f"trainer.output_dir={out}", "trainer.run_name=run"]


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()), default=0)


def _descendants(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def planned_shares(steps: int, ranks: int, seed: int = 0) -> list[list[tuple[int, int, int]]]:
    """``(step, group, training-set row)`` each rank trains, derived by hand: the loop's prompt
    RNG is ``random.Random(trainer.seed + 1)``; each step draws ``PROMPTS`` rows without
    replacement, then one seed per row (``RLStep._draw``); rank r keeps the r-th contiguous
    share, its groups numbered from 0."""
    rng, per = random.Random(seed + 1), PROMPTS // ranks
    out: list[list] = [[] for _ in range(ranks)]
    for s in range(1, steps + 1):
        rows = rng.sample(range(TRAIN), PROMPTS)
        [rng.randrange(2**62) for _ in rows]
        for r in range(ranks):
            out[r].extend((s, g, row) for g, row in enumerate(rows[r * per:(r + 1) * per]))
    return out


def test_sigkill_of_an_async_agentic_run_at_two_ranks_then_resume_trains_every_group_once(tmp_path: Path) -> None:
    kill_after = random.Random(_seeds.fresh_seed()).uniform(2, 6)  # steps done, fractional: mid-step as often as between
    proc = subprocess.Popen(_cmd(tmp_path), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, seen = time.monotonic() + 400, set()
    while _steps_done(tmp_path / "run") < int(kill_after) and proc.poll() is None and time.monotonic() < deadline:
        seen |= set(_descendants(proc.pid))
        time.sleep(0.05)
    time.sleep((kill_after % 1) * 0.5)
    seen |= set(_descendants(proc.pid))
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    assert _steps_done(tmp_path / "run") < STEPS, "the run finished before it could be killed"
    # the launcher's ranks, each rank's rollout worker and the environment / reward workers
    assert len(seen) >= 6, f"expected ranks, rollout workers and environment workers; saw {len(seen)} processes"
    gone = time.monotonic() + 60
    while any(map(_alive, seen)) and time.monotonic() < gone:
        time.sleep(0.1)
    left = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:160] for p in seen if _alive(p)]
    assert not left, f"processes outlived the killed launcher: {left}"

    resumed = subprocess.run(_cmd(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert "resumed from" in out and "finished prompt groups restored" in out, out[-3000:]

    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=True)
    ranks = state["step"]["source"]["ranks"]
    assert len(ranks) == 2
    for r, (source, want) in enumerate(zip(ranks, planned_shares(STEPS, 2))):
        consumed = [tuple(x) for x in source["consumed"].tolist()]
        assert len(consumed) == len({(s, g) for s, g, _ in consumed}), f"rank {r}: a prompt group was trained twice"
        assert sorted(consumed) == sorted(want), f"rank {r}: a prompt was lost or trained out of plan"
        assert consumed == want, f"rank {r}: trained out of step order"
