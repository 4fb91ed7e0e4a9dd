"""Data parallel on CPU: 1 rank vs 2 ranks (FSDP2, gloo) on the default job's step.

Both configurations use 2 threads in all (1 process x 2 threads vs 2 ranks x 1 thread) on
the same global batch. On a 2-core machine, then, 2 ranks vs 1 process measures
*contention* (two processes sharing two cores, plus the collectives), not scaling: two
ranks cannot be faster than one, and the honest numbers are the overheads:

- the share of a 2-rank step spent in collectives (FSDP2 all-gathers / reduce-scatters,
  metric and statistics all-reduces, refit gathers), from the profiler's c10d events on
  rank 0 over one profiled step, divided by that step's wall time; goal <= 15% of the step;
- step seconds of 2 ranks vs 1 process, and refit seconds sharded (gather bucket by
  bucket) vs single-process (in-process copy).

Method: both configurations live at once (three processes: the 1-rank run and the two
ranks), each built once, and their steps are **interleaved** — a 1-rank step, then a 2-rank
step, then 1, 2, ... — while the other configuration waits idle on a queue, so load drifts
on a shared machine hit both alike. Each step is timed by the wall clock around the whole
``run.step`` (after a barrier on 2 ranks; the slowest rank's time), so it includes the
metric all-reduce at the end of the step that the phase timers do not see (the collective
share counts it). The first step of each is warm-up. The 1-minute load average before and
after the run goes into the JSON (``load``) and is printed.

Every number is measured in this run. ``--quick``: fewer steps.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import _machine  # noqa: E402
from _common import median, parse_args, report, row  # noqa: E402

COMM_MARKERS = ("c10d", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast",
                "gloo", "wait_tensor")
THREADS = 2  # in all, for either configuration
RESULT_TIMEOUT_S = 900  # one build or one step; past it a rank is taken as hung


def _overrides(out: str, steps: int) -> list[str]:
    return ["warm_start.steps=0", f"trainer.total_steps={steps}", "logging.tensorboard=false",
            "logging.plot=false", "logging.progress=false", "checkpoint.save=false",
            f"trainer.output_dir={out}"]


def _one_step(run, rng, world: int, profiled: bool) -> dict:
    import torch.distributed as dist

    if world > 1:
        dist.barrier()  # every rank starts the timed step together
    prof = None
    if profiled:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    m = run.step()
    wall = time.perf_counter() - t0
    out = {"wall": wall, "phases": sum(v for k, v in m.items() if k.startswith("time/")), "refit": m["time/refit_s"]}
    if prof is not None:
        prof.__exit__(None, None, None)
        comm = sum(e.self_cpu_time_total for e in prof.key_averages()
                   if any(k in e.key.lower() for k in COMM_MARKERS)) / 1e6
        out["comm_share"] = comm / wall
    return out


def _worker(rank: int, world: int, port: int, overrides: list[str], commands, results) -> None:
    """One rank of one configuration: build the run, then one step per command until "stop"."""
    run = None
    try:
        from hybridrl.config.io import load_config
        from hybridrl.distributed.context import init_from_env
        from hybridrl.job.build import build_run

        cfg = load_config(None, overrides + [f"trainer.run_name=w{world}", f"trainer.threads={THREADS // world}"])
        dp = None
        if world > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dp = init_from_env("cpu", timeout_s=RESULT_TIMEOUT_S)
        run = build_run(cfg, console=lambda s: None, dp=dp)
        if dp is not None:
            run.step.shard_for_data_parallel()
        rng = random.Random(1)
        run.step.start(rng, 1)  # the batch source draws every step's prompts from rng
        results.put({"rank": rank, "ready": True})
        while (command := commands.get()) != "stop":
            results.put({"rank": rank, **_one_step(run, rng, world, profiled=command == "profile")})
    except BaseException:  # noqa: BLE001 - hand the traceback to the parent, which raises
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if run is not None:
            run.log.close()
            run.step.scorer.close()
            run.directory.close()
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class _Config:
    """The ``world`` rank processes of one configuration, driven one step at a time."""

    def __init__(self, ctx, world: int, overrides: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.world, self.results = world, ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, overrides, self.commands[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def _collect(self) -> list[dict]:
        got = []
        while len(got) < self.world:
            try:
                got.append(self.results.get(timeout=RESULT_TIMEOUT_S))
            except queue.Empty:
                raise RuntimeError(f"{self.world}-rank run: no result in {RESULT_TIMEOUT_S} s "
                                   f"(alive: {[p.is_alive() for p in self.procs]})") from None
            if "error" in got[-1]:
                raise RuntimeError(f"{self.world}-rank run, rank {got[-1]['rank']} failed:\n{got[-1]['error']}")
        return sorted(got, key=lambda r: r["rank"])

    def ready(self) -> None:
        self._collect()

    def step(self, command: str = "step") -> dict:
        """One step on every rank: the slowest rank's wall time; rank 0's other fields."""
        for q in self.commands:
            q.put(command)
        got = self._collect()
        return {**got[0], "wall": max(r["wall"] for r in got)}

    def close(self) -> None:
        for q in self.commands:
            q.put("stop")
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def measure_interleaved(repeats: int, tmp: str) -> dict:
    """``{1: [step records], 2: [...], "order": [1, 2, 1, 2, ...], "comm_share": x}``:
    one warm-up step each (not returned), ``repeats`` interleaved steps of each, then one
    profiled 2-rank step for the collective share."""
    ctx = mp.get_context("spawn")
    overrides = _overrides(tmp, repeats + 2)
    configs = {w: _Config(ctx, w, overrides) for w in (1, 2)}
    try:
        for c in configs.values():
            c.ready()
        for c in configs.values():
            c.step()  # warm-up
        out: dict = {1: [], 2: [], "order": []}
        for _ in range(repeats):
            for w, c in configs.items():
                out[w].append(c.step())
                out["order"].append(w)
        out["comm_share"] = configs[2].step("profile")["comm_share"]
        return out
    finally:
        for c in configs.values():
            c.close()


def main() -> None:
    args = parse_args(__doc__, lambda ap: ap.add_argument(
        "--repeats", type=int, help="interleaved steps of each configuration after the warm-up (default 11; quick 3)"))
    _machine.mark_start()
    repeats = args.repeats or (3 if args.quick else 11)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure_interleaved(repeats, tmp)
    one, two = m[1], m[2]
    cores = _machine.cores()
    contention = (f"1 process x {THREADS} threads, same global batch (2 ranks x 1 thread on {cores} cores"
                  + (": contention, not scaling)" if cores <= THREADS else ")"))
    rows = [
        row(case="default job, 2 ranks", metric="collective share of step", ours=m["comm_share"], baseline=0.15,
            baseline_name="goal (<= 15%)", higher_is_better=False),
        row(case="default job", metric="step s (wall)", ours=median([s["wall"] for s in two]),
            baseline=median([s["wall"] for s in one]), baseline_name=contention, higher_is_better=False),
        row(case="default job", metric="refit s", ours=median([s["refit"] for s in two]),
            baseline=median([s["refit"] for s in one]), baseline_name="single-process in-place refit",
            higher_is_better=False),
    ]
    report(rows, args.json)
    for w, recs in ((1, one), (2, two)):
        print(f"{w} rank(s), per step: wall " + " ".join(f"{s['wall']:.3f}" for s in recs)
              + " s; phase timers " + " ".join(f"{s['phases']:.3f}" for s in recs) + " s")
    load = _machine.load()
    print(f"{repeats} interleaved steps each ({''.join(map(str, m['order']))}), after 1 warm-up; "
          f"1-minute load average before {load['before']}, after {load['after']} ({cores} cores)")


if __name__ == "__main__":
    main()
