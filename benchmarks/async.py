"""Overlapped RL (``trainer.mode``): step throughput and time-to-accuracy, sync vs
one-step-off vs async, one trainer process and one rollout process on this machine.

    python benchmarks/async.py [--quick] [--json PATH] [--steps K] [--latency-ms MS]
    python benchmarks/async.py --parity 3 [--json PATH]      # learning parity, the full default job

Each case is the default job (``hybridrl train``: the arithmetic task, GRPO) from the same
warm start, trained ``--steps`` RL steps (quick: 8 from a 100-step warm start, a smoke run):

  * baseline ``sync``: ``trainer.mode=sync``, one process on every core (``trainer.threads=0``:
    how a user runs it) — sample, score, train, refit in turn;
  * ours ``one_step_off`` and ``async`` (``pipeline.max_staleness=1``): the trainer process
    and one rollout worker process (``pipeline.placement=disaggregated``), one thread (core)
    each. (Two trainer threads next to the worker measured no faster: the worker's compute
    preempts one of them, and every parallel region waits for it.)

Clock: the trainer's step wall time (waiting for the batch included; held-out evals are
outside it and happen every ``--eval-every`` steps — the workers keep generating then, at
most ``max_staleness`` steps ahead, as they would on a cluster). Rows: RL steps/s, and
seconds to the accuracy the synchronous run reached (its last eval minus 2 points; not in
``--quick``, whose smoke run reaches no accuracy worth timing).

``--latency-ms MS[,MS...]`` (default 15,30; quick: the first; empty = skip) repeats sync and
async with every training-rollout engine step lasting at least MS milliseconds (``rollout.step_latency_ms``:
the rest slept, the core free meanwhile — the decode-step latency of a GPU cluster, the
same for both sides): at 15 ms generation takes about as long as training, at 30 ms about
twice as long, as in RL on a GPU cluster. There the ideal overlap is a step of ``max(generation, training)`` instead of
their sum (both read off the sync run's phase clocks); the row "overlap" prints the async
step time against that ideal (1.0 = perfect overlap).

``--parity N``: N seeds of the full default job (300 steps) for sync, async staleness 1 and
2 (held-out accuracy at the end, within 2 points of sync is the goal), plus async staleness
4 with and without the decoupled correction (``algo.correction.decoupled``) on seed 0.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import goal_line, parse_args, report, row  # noqa: E402

SYNC = "hybridrl trainer.mode=sync (one process, trainer.threads=0: both cores)"
OURS = ["pipeline.placement=disaggregated", "pipeline.workers=1", "trainer.threads=1", "pipeline.worker_threads=1"]
MODES = {
    "sync": ["trainer.mode=sync", "trainer.threads=0"],
    "one_step_off": ["trainer.mode=one_step_off", *OURS],
    "async s=1": ["trainer.mode=async", "pipeline.max_staleness=1", *OURS],
    "async s=2": ["trainer.mode=async", "pipeline.max_staleness=2", *OURS],
}


@dataclass
class Run:
    step_s: list[float] = field(default_factory=list)  # trainer wall time per step
    generate_s: list[float] = field(default_factory=list)  # rollout + reward phases (sync: the generation)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out accuracy)
    final_accuracy: float = 0.0

    @property
    def steps_per_s(self) -> float:
        return len(self.step_s) / sum(self.step_s)

    def seconds_to(self, target: float) -> float:
        """Trainer seconds until the first eval at or above ``target`` (the whole run if never)."""
        for step, acc in self.evals:
            if acc >= target:
                return sum(self.step_s[:step])
        return sum(self.step_s)


def train_case(overrides: list[str], out: str, name: str) -> Run:
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    cfg = load_config(None, overrides + [f"trainer.output_dir={out}", f"trainer.run_name={name}",
                                         "checkpoint.save=false", "checkpoint.resume=off", "logging.progress=false",
                                         "logging.tensorboard=false", "logging.plot=false"])
    result = train(cfg)
    run = Run(final_accuracy=result.final_accuracy or 0.0)
    for r in result.history:
        if "reward/mean" in r:
            run.step_s.append(sum(v for k, v in r.items() if k.startswith("time/") and k.endswith("_s")))
            run.generate_s.append(r.get("time/rollout_s", 0.0) + r.get("time/reward_s", 0.0))
        if "eval/accuracy" in r and r["step"] > 0:
            run.evals.append((r["step"], r["eval/accuracy"]))
    return run


def throughput(args, out: str) -> list[dict]:
    quick = args.quick
    steps = args.steps or (8 if quick else 60)
    base = [f"trainer.total_steps={steps}", f"trainer.eval_every={args.eval_every or (steps if quick else 10)}",
            f"warm_start.steps={100 if quick else 1000}", "eval.k=0", f"trainer.seed={args.seed}",
            *(["data.train_size=2000", "data.eval_size=64"] if quick else [])]
    modes = {k: v for k, v in MODES.items() if not (quick and k == "async s=2")}
    runs = {}
    for name, extra in modes.items():
        runs[name] = train_case(base + extra, out, name.replace(" ", "_").replace("=", ""))
        print(f"{name}: {runs[name].steps_per_s:.2f} steps/s, final accuracy {runs[name].final_accuracy:.3f}")
    rows, sync = [], runs["sync"]
    target = max(0.0, sync.final_accuracy - 0.02)
    case = f"default job, {steps} steps"
    for name, run in runs.items():
        if name == "sync":
            continue
        rows.append(row(case=case, metric=f"{name} steps/s", ours=run.steps_per_s, baseline=sync.steps_per_s,
                        baseline_name=SYNC, higher_is_better=True))
        if not quick:  # a smoke run's 8 steps from a 100-step warm start reach no accuracy worth timing
            rows.append(row(case=case, metric=f"{name} s to acc {target:.2f}", ours=run.seconds_to(target),
                            baseline=sync.seconds_to(target), baseline_name=SYNC, higher_is_better=False))
    latencies = args.latency_ms[:1] if quick else args.latency_ms
    for i, f in enumerate(latencies):
        slow = base + [f"rollout.step_latency_ms={f:g}"]
        s_run = train_case(slow + MODES["sync"], out, f"sync_slow{i}")
        a_run = train_case(slow + MODES["async s=1"], out, f"async_slow{i}")
        gen = statistics.median(s_run.generate_s)
        train_s = statistics.median([t - g for t, g in zip(s_run.step_s, s_run.generate_s)])
        case = f"decode step >= {f:g} ms (generation {gen / train_s:.1f}x training)"
        rows.append(row(case=case, metric="async s=1 steps/s", ours=a_run.steps_per_s, baseline=s_run.steps_per_s,
                        baseline_name=SYNC, higher_is_better=True))
        rows.append(row(case=case, metric="async s=1 step s (overlap)", ours=statistics.median(a_run.step_s),
                        baseline=max(gen, train_s), higher_is_better=False,
                        baseline_name=f"ideal overlap: max(generation {gen:.3f} s, training {train_s:.3f} s) of the "
                                      f"sync run (their sum {gen + train_s:.3f} s)"))
        print(goal_line(f"async vs sync, decode step >= {f:g} ms (generation {gen / train_s:.1f}x training)",
                        a_run.steps_per_s / s_run.steps_per_s, 1.5))
    return rows


def parity(args, out: str) -> list[dict]:
    """The full default job per seed: final held-out accuracy of sync vs async (s=1, 2), and
    the decoupled correction on / off at staleness 4 (seed 0)."""
    rows, finals = [], {}
    for seed in range(args.parity):
        for name in ("sync", "async s=1", "async s=2"):
            run = train_case([f"trainer.seed={seed}", *MODES[name]], out,
                             f"parity_{seed}_{name.replace(' ', '_').replace('=', '')}")
            finals.setdefault(name, []).append(run.final_accuracy)
            print(f"seed {seed} {name}: final accuracy {run.final_accuracy:.3f}")
    for name in ("async s=1", "async s=2"):
        rows.append(row(case=f"default job, {args.parity} seeds", metric=f"{name} median final acc",
                        ours=statistics.median(finals[name]), baseline=statistics.median(finals["sync"]),
                        baseline_name=SYNC + f"; per seed ours {finals[name]}, sync {finals['sync']}",
                        higher_is_better=True))
    stale = ["trainer.mode=async", "pipeline.max_staleness=4", *OURS]
    with_c = train_case(stale, out, "stale4_decoupled")
    without = train_case(stale + ["algo.correction.decoupled=false"], out, "stale4_uncorrected")
    rows.append(row(case="default job, staleness 4, seed 0", metric="final acc", ours=with_c.final_accuracy,
                    baseline=without.final_accuracy, higher_is_better=True,
                    baseline_name="async s=4 without the decoupled correction (algo.correction.decoupled=false)"))
    return rows


def main() -> None:
    def extra(ap):
        ap.add_argument("--steps", type=int, default=0, help="RL steps per case (default 60; quick 8)")
        ap.add_argument("--eval-every", type=int, default=0)
        ap.add_argument("--latency-ms", type=lambda text: [float(x) for x in text.split(",") if x], default=[15.0, 30.0],
                        help="cluster-like cases: rollout.step_latency_ms values, comma-separated (quick: the first)")
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--parity", type=int, default=0, metavar="SEEDS", help="learning parity over SEEDS seeds")

    args = parse_args(__doc__, extra)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-async-") as out:
        rows = parity(args, out) if args.parity else throughput(args, out)
    report(rows, args.json)


if __name__ == "__main__":
    main()
