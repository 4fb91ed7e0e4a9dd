"""Overlapped RL (``trainer.mode``): step throughput and time-to-accuracy, sync vs
one-step-off vs async, one trainer process and one rollout process on this machine.

    python benchmarks/async.py [--quick] [--json PATH] [--steps K] [--latency-ms MS]
    python benchmarks/async.py --parity 3 [--json PATH]      # learning parity, the full default job
    python benchmarks/async.py --agent-parity 3 [--json PATH]  # learning parity, the calculator agent demo

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

Agent rows (after the default job's; ``--agent-latency-ms ''`` skips them): the calculator
agent demo (``examples/calculator_agent.yaml``: multi-turn episodes, the policy may call
add(a, b) in a worker process) shrunk to ``--agent-steps`` RL steps (default 20; quick 2)
after a ``--agent-warm-start``-step warm start (default the example's 400: about two thirds
of the episodes call the tool and the reward is far from 0, as in the demo; 150 steps give
a third, all of them wrong, reward 0 — another shape; quick 40), every other setting the
example's. The four agent cases share one warm start (run by the first, its weights loaded
by the others: the same starting policy, one warm start's time). Two knobs emulate a cluster, the same on every
side: every engine step of a training rollout lasts >= ``--agent-latency-ms`` (default 3:
generation then takes about as long as training, 1.2x here, the case overlap is for — the
case name prints the ratio measured in the sync run; 6 ms gave 1.7x) and every environment / tool call >=
``--env-latency-ms`` (default 100: a remote tool such as search or code execution).

  * ``async s=1 steps/s``: ours ``trainer.mode=async`` (staleness 1, the worker and trainer
    one core each as above) against the baseline ``trainer.mode=sync`` with the example's
    defaults (how a user runs it: ``trainer.threads=1``, ``env.overlap=true``); plus the
    async step time against the ideal overlap max(generation, training) of the sync run.
  * ``tool time hidden``: sync mode three times at the same decode latency — tools with
    ``env.overlap=true`` (R_ov), with ``env.overlap=false`` (R_no: the turns that finished
    at an engine step get their tool results before the next step, so every tool round
    stalls decoding) and without tool time (``env.latency_ms=0``, R_0); R_* the median
    ``time/rollout_s`` per step. The tool time a step pays without overlap is R_no - R_0;
    with overlap R_ov - R_0 of it is still paid, so the share hidden is
    1 - (R_ov - R_0) / (R_no - R_0) (1 = all tool time behind decoding, 0 = none; it can
    fall outside [0, 1] by noise). Every env call counts — the opening reset, the tool calls
    and the step that scores the final answer — and in sync mode two rounds per step have
    nothing to hide behind: the resets (nothing decodes before they return) and the last
    episode's closing step (nothing decodes after it): the share's ideal is at most about
    1 - 2 ``--env-latency-ms`` / (R_no - R_0) (printed) — less when most episodes call the
    tool at about the same turn, as here: then the tool round too has little left to decode
    beside it.

``--agent-parity N``: N seeds of the calculator demo as a user runs it (the example config
unchanged: 400 warm-start steps, 60 RL steps; no emulated latency), ``trainer.mode=sync``
against ``trainer.mode=async pipeline.max_staleness=1`` (the pipeline's defaults), final
held-out accuracy of each and their difference per seed (within 2 points is the goal).
Minutes per run; not part of ``--quick``.
"""

from __future__ import annotations

import statistics
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import goal_line, parse_args, report, row  # noqa: E402

SYNC = "hybridrl trainer.mode=sync (one process, trainer.threads=0: both cores)"
OURS = ["pipeline.placement=disaggregated", "pipeline.workers=1", "trainer.threads=1", "pipeline.worker_threads=1"]
AGENT_CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "calculator_agent.yaml")
AGENT_SYNC = ("hybridrl train --config examples/calculator_agent.yaml trainer.mode=sync (the example's defaults: "
              "trainer.threads=1, env.overlap=true)")
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
    rollout_s: list[float] = field(default_factory=list)  # the rollout phase alone (time/rollout_s)
    tool_calls: list[float] = field(default_factory=list)  # agent runs: tool calls per episode (agent/tool_calls)
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


def train_case(overrides: list[str], out: str, name: str, config: str | None = None) -> Run:
    """``hybridrl train [--config config] overrides`` in this process, its step clocks read off."""
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    cfg = load_config(config, overrides + [f"trainer.output_dir={out}", f"trainer.run_name={name}",
                                         "checkpoint.save=false", "checkpoint.resume=off", "logging.progress=false",
                                         "logging.tensorboard=false", "logging.plot=false"])
    result = train(cfg)
    run = Run(final_accuracy=result.final_accuracy or 0.0)
    for r in result.history:
        if "reward/mean" in r:
            run.step_s.append(sum(v for k, v in r.items() if k.startswith("time/") and k.endswith("_s")))
            run.generate_s.append(r.get("time/rollout_s", 0.0) + r.get("time/reward_s", 0.0))
            run.rollout_s.append(r.get("time/rollout_s", 0.0))
            if "agent/tool_calls" in r:
                run.tool_calls.append(r["agent/tool_calls"])
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


@contextmanager
def shared_warm_start():
    """Within the ``with``: the first run's warm start is run, its weights kept, and every
    later run loads them instead of repeating it (identical starting policies, one warm
    start's time instead of one per case). Patches ``hybridrl.job.loop.warm_start``, which
    ends by publishing the weights to the run's rollout engines; so does the replacement."""
    import hybridrl.job.loop as loop

    real, kept = loop.warm_start, {}

    def warm_start(run, cfg):
        if "state" not in kept:
            real(run, cfg)
            kept["state"] = {k: v.detach().clone() for k, v in run.policy.state_dict().items()}
            return
        run.policy.load_state_dict(kept["state"])
        run.step.source.publish(run.policy)

    loop.warm_start = warm_start
    try:
        yield
    finally:
        loop.warm_start = real


def hidden_share(overlap_s: float, no_overlap_s: float, no_tools_s: float) -> float:
    """Share of the tool time hidden behind decoding: 1 - (R_ov - R_0) / (R_no - R_0) (module
    docstring); nan when the tools cost nothing measurable (R_no <= R_0)."""
    paid = no_overlap_s - no_tools_s
    return 1.0 - (overlap_s - no_tools_s) / paid if paid > 0 else float("nan")


def agent(args, out: str) -> list[dict]:
    """The calculator agent demo, shrunk: async vs sync steps/s with slow decoding and slow
    tools, and the share of tool time that ``env.overlap`` hides (sync mode)."""
    quick = args.quick
    steps = args.agent_steps or (2 if quick else 20)
    warm = args.agent_warm_start if args.agent_warm_start is not None else (40 if quick else 400)
    decode_ms = args.agent_latency_ms[0]
    tool_ms = args.env_latency_ms
    base = [f"trainer.total_steps={steps}", f"trainer.eval_every={steps}", f"warm_start.steps={warm}",
            f"trainer.seed={args.seed}", f"rollout.step_latency_ms={decode_ms:g}",
            *(["data.train_size=500", "data.eval_size=8"] if quick else ["data.train_size=1000", "data.eval_size=32"])]
    tools = [f"env.latency_ms={tool_ms:g}"]
    cases = {  # run name -> overrides (all of them on the example's config)
        "agent_sync": base + tools + ["trainer.mode=sync"],
        "agent_async_s1": base + tools + MODES["async s=1"],
        "agent_sync_no_overlap": base + tools + ["trainer.mode=sync", "env.overlap=false"],
        "agent_sync_no_tools": base + ["trainer.mode=sync", "env.latency_ms=0"],
    }
    runs = {}
    with shared_warm_start():
        for i, (name, overrides) in enumerate(cases.items()):
            print(f"agent case {i + 1}/{len(cases)}: {name} ({steps} steps, warm start {warm}"
                  f"{'' if i == 0 else ' shared with the first case'})", flush=True)
            runs[name] = r = train_case(overrides, out, name, config=AGENT_CONFIG)
            print(f"{name}: {r.steps_per_s:.3f} steps/s, rollout {statistics.median(r.rollout_s):.3f} s/step "
                  f"(median), {statistics.fmean(r.tool_calls or [0.0]):.2f} tool calls per episode, "
                  f"final accuracy {r.final_accuracy:.3f}", flush=True)
    s_run, a_run = runs["agent_sync"], runs["agent_async_s1"]
    gen = statistics.median(s_run.generate_s)
    train_s = statistics.median([t - g for t, g in zip(s_run.step_s, s_run.generate_s)])
    knobs = f"decode step >= {decode_ms:g} ms, tools >= {tool_ms:g} ms"
    case = f"calculator agent, {knobs} (generation {gen / train_s:.1f}x training)"
    rows = [row(case=case, metric="async s=1 steps/s", ours=a_run.steps_per_s, baseline=s_run.steps_per_s,
                baseline_name=AGENT_SYNC + f", same knobs ({knobs})", higher_is_better=True),
            row(case=case, metric="async s=1 step s (overlap)", ours=statistics.median(a_run.step_s),
                baseline=max(gen, train_s), higher_is_better=False,
                baseline_name=f"ideal overlap: max(generation {gen:.3f} s, training {train_s:.3f} s) of the sync run "
                              f"(their sum {gen + train_s:.3f} s)")]
    print(goal_line(f"calculator agent async vs sync, {knobs} (generation {gen / train_s:.1f}x training)",
                    a_run.steps_per_s / s_run.steps_per_s, 1.5))
    r_ov, r_no, r_0 = (statistics.median(runs[k].rollout_s)
                       for k in ("agent_sync", "agent_sync_no_overlap", "agent_sync_no_tools"))
    share = hidden_share(r_ov, r_no, r_0)
    ideal = hidden_share(r_0 + 2 * tool_ms / 1000, r_no, r_0)  # the opening and the closing round left visible
    case = f"calculator agent sync, {knobs}"
    rows.append(row(case=case, metric="rollout s/step, env.overlap=true", ours=r_ov, baseline=r_no,
                    higher_is_better=False,
                    baseline_name=f"env.overlap=false, same knobs (no tool time, env.latency_ms=0: {r_0:.3f} s)"))
    rows.append(row(case=case, metric="tool time hidden (share)", ours=share, baseline=1.0, higher_is_better=True,
                    baseline_name=f"all of it (1 - (R_ov - R_0) / (R_no - R_0) with R_ov {r_ov:.3f}, R_no {r_no:.3f}, "
                                  f"R_0 {r_0:.3f} s; env.overlap=false hides 0; the opening and closing env rounds "
                                  f"of a step cap it near {ideal:.2f})"))
    print(f"tool time hidden by env.overlap: {share:.2f} (R_ov {r_ov:.3f} s, R_no {r_no:.3f} s, R_0 {r_0:.3f} s; "
          f"about {ideal:.2f} if only a step's opening and closing env rounds stayed visible)")
    return rows


def agent_parity(args, out: str) -> list[dict]:
    """The calculator demo as a user runs it (the example config), per seed: final held-out
    accuracy of sync vs async staleness 1 and their difference."""
    finals: dict[str, list[float]] = {"sync": [], "async s=1": []}
    modes = {"sync": ["trainer.mode=sync"], "async s=1": ["trainer.mode=async", "pipeline.max_staleness=1"]}
    for seed in range(args.agent_parity):
        for name, extra in modes.items():
            print(f"calculator demo seed {seed} {name} ...", flush=True)
            run = train_case([f"trainer.seed={seed}", *extra], out,
                             f"agent_parity_{seed}_{name.replace(' ', '_').replace('=', '')}", config=AGENT_CONFIG)
            finals[name].append(run.final_accuracy)
        s, a = finals["sync"][-1], finals["async s=1"][-1]
        print(f"calculator demo seed {seed}: sync {s:.3f}, async s=1 {a:.3f}, difference {100 * (a - s):+.1f} points",
              flush=True)
    diffs = [100 * (a - s) for s, a in zip(finals["sync"], finals["async s=1"])]
    print(f"calculator demo, {args.agent_parity} seeds: largest |async - sync| {max(map(abs, diffs)):.1f} points "
          f"(goal <= 2: {'met' if max(map(abs, diffs)) <= 2 else 'NOT met'})")
    per_seed = ", ".join(f"seed {i}: {s:.3f} vs {a:.3f} ({d:+.1f})"
                         for i, (s, a, d) in enumerate(zip(finals["sync"], finals["async s=1"], diffs)))
    return [row(case=f"calculator agent demo (examples/calculator_agent.yaml), {args.agent_parity} seeds",
                metric=f"async s=1 {stat} final acc", ours=fn(finals["async s=1"]), baseline=fn(finals["sync"]),
                baseline_name=f"trainer.mode=sync; per seed sync vs async (points): {per_seed}", higher_is_better=True)
            for stat, fn in (("median", statistics.median), ("mean", statistics.fmean))]


def main() -> None:
    def extra(ap):
        ap.add_argument("--steps", type=int, default=0, help="RL steps per case (default 60; quick 8)")
        ap.add_argument("--eval-every", type=int, default=0)
        ap.add_argument("--latency-ms", type=lambda text: [float(x) for x in text.split(",") if x], default=[15.0, 30.0],
                        help="cluster-like cases: rollout.step_latency_ms values, comma-separated (quick: the first)")
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--parity", type=int, default=0, metavar="SEEDS", help="learning parity over SEEDS seeds")
        ap.add_argument("--agent-latency-ms", type=lambda text: [float(x) for x in text.split(",") if x],
                        default=[3.0], help="agent rows: rollout.step_latency_ms (the first value; empty = skip them)")
        ap.add_argument("--env-latency-ms", type=float, default=100.0, help="agent rows: env.latency_ms")
        ap.add_argument("--agent-steps", type=int, default=0,
                        help="agent rows: RL steps per case (default 20; quick 2)")
        ap.add_argument("--agent-warm-start", type=int, default=None,
                        help="agent rows: warm-start steps (default 400, the example's; quick 40)")
        ap.add_argument("--agent-only", action="store_true", help="only the agent rows (not the default job's)")
        ap.add_argument("--agent-parity", type=int, default=0, metavar="SEEDS",
                        help="learning parity of the calculator agent demo (sync vs async s=1) over SEEDS seeds")

    args = parse_args(__doc__, extra)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-async-") as out:
        if args.parity or args.agent_parity:
            rows = (parity(args, out) if args.parity else []) + (agent_parity(args, out) if args.agent_parity else [])
        else:
            rows = [] if args.agent_only else throughput(args, out)
            rows += agent(args, out) if args.agent_latency_ms else []
    report(rows, args.json)


if __name__ == "__main__":
    main()
