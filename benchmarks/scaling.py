"""Data parallel on CPU: 1 rank vs 2 ranks (FSDP2, gloo) on the default job's step.

On a 2-core machine two ranks cannot be faster than one (each gets one core for half the
work), so the honest numbers are the overheads:

- the share of a 2-rank step spent in collectives (FSDP2 all-gathers / reduce-scatters,
  metric and statistics all-reduces, refit gathers), from the profiler's c10d events on
  rank 0; goal ≤ 15% of the step;
- step seconds of 1 vs 2 ranks, and refit seconds sharded (gather bucket by bucket) vs
  single-process (in-process copy).

Every number is measured in this run. ``--quick``: fewer steps.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, parse_args, report, row  # noqa: E402

COMM_MARKERS = ("c10d", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast",
                "gloo", "wait_tensor")


def _overrides(out: str, steps: int) -> list[str]:
    return ["warm_start.steps=0", f"trainer.total_steps={steps}", "logging.tensorboard=false",
            "logging.plot=false", "logging.progress=false", "checkpoint.save=false",
            f"trainer.output_dir={out}"]


def _rank(rank: int, world: int, port: int, overrides: list[str], steps: int, out: str) -> None:
    from hybridrl.config.io import load_config
    from hybridrl.distributed.context import init_from_env
    from hybridrl.job.build import build_run

    cfg = load_config(None, overrides + [f"trainer.run_name=w{world}", f"trainer.threads={max(1, 2 // world)}"])
    dp = None
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dp = init_from_env("cpu", timeout_s=300)
    run = build_run(cfg, console=lambda s: None, dp=dp)
    if dp is not None:
        run.step.shard_for_data_parallel()
    rng = random.Random(1)
    step_s, refit_s = [], []
    for _ in range(steps):
        m = run.step(rng)
        step_s.append(sum(v for k, v in m.items() if k.startswith("time/")))
        refit_s.append(m["time/refit_s"])
    comm_share = 0.0
    if dp is not None:  # one profiled step: time inside collectives / step time
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            m = run.step(rng)
        total = sum(v for k, v in m.items() if k.startswith("time/"))
        comm = sum(e.self_cpu_time_total for e in prof.key_averages()
                   if any(k in e.key.lower() for k in COMM_MARKERS)) / 1e6
        comm_share = comm / total
    run.log.close()
    run.step.scorer.close()
    run.directory.close()
    if rank == 0:
        torch.save({"step": step_s[1:], "refit": refit_s[1:], "comm_share": comm_share}, out)


def _measure(world: int, steps: int, tmp: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp, f"w{world}.pt")
    mp.spawn(_rank, args=(world, port, _overrides(tmp, steps), steps, out), nprocs=world, join=True)
    return torch.load(out)


def main() -> None:
    args = parse_args(__doc__)
    steps = 4 if args.quick else 12
    with tempfile.TemporaryDirectory() as tmp:
        one, two = _measure(1, steps, tmp), _measure(2, steps, tmp)
    rows = [
        row(case="default job, 2 ranks", metric="collective share of step", ours=two["comm_share"], baseline=0.15,
            baseline_name="goal (<= 15%)", higher_is_better=False),
        row(case="default job", metric="step s", ours=median(two["step"]), baseline=median(one["step"]),
            baseline_name="1 process (2 threads), same global batch", higher_is_better=False),
        row(case="default job", metric="refit s", ours=median(two["refit"]), baseline=median(one["refit"]),
            baseline_name="single-process in-place refit", higher_is_better=False),
    ]
    report(rows, args.json)


if __name__ == "__main__":
    main()
