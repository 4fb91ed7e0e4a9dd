"""Time-to-accuracy: hybridrl GRPO vs TRL's ``GRPOTrainer`` from the same warm start, over seeds.

    pip install -e ".[bench]"          # trl + datasets, only for the baseline
    python benchmarks/learning.py [--quick] [--json PATH] [--seeds N] [--steps K] [--eval-every E]
                                  [--threads K] [--set KEY=VALUE ...]
    python benchmarks/learning.py --stability 5 [--set KEY=VALUE ...]   # the default job itself, five seeds

For each of ``--seeds N`` seeds (trainer.seed 0..N-1; default 3, ``--quick`` 2) the default
job (``hybridrl train`` with the defaults, plus any ``--set`` overrides) runs its supervised
warm start; both sides then start RL from those same weights and train the same number of
steps (``--steps``, default trainer.total_steps; ``--quick`` 12 steps from a 300-step warm
start: a smoke run of the harness). Held-out greedy accuracy is evaluated on both sides at
the same steps, every ``--eval-every`` steps (default 5; quick 3) and after the last, and
every training step's seconds are recorded: each side has, per seed, an accuracy-vs-step
and an accuracy-vs-training-time curve.

Targets: 70 / 80 / 90 % held-out accuracy (those above every seed's warm start that, in
every seed, at least one side reaches); if there is none, targets relative to the warm
start: 50 / 80 / 90 % of the way from it to the lower of the two sides' best accuracy
(both reach those by construction). The time, and the step, at which a side first reaches
a target is linearly interpolated between the two evaluations around the crossing; a side
that never reaches it counts as its whole run (the row says so: the ratio is then a bound).
Reported per target: the median over seeds and the spread (min, max) of both sides' times
and steps; the ratio TRL / ours of the median times next to the ratio of the steps needed
(~1 when both algorithms learn alike per step) and the per-step time ratio (the time ratio
equals it when the steps ratio is 1). Accuracy per evaluated step is printed side by side
(median and range over seeds). With ``--json PATH`` a plot is written next to it (same
stem, ``.png``): accuracy vs training seconds and vs step, median and min-max band.

Clocks. Each side's step time counts its own training work only:
  * ours: the wall time of every ``RLStep`` call (rollout, reward, update, refit);
  * TRL: wall time from ``on_train_begin`` (for its first step) or from the end of our
    work inside its previous ``on_step_end``, to its ``on_step_end``: its data loading,
    logging and callbacks count.
The sides are interleaved step by step: inside TRL's ``on_step_end`` of step i ours runs
its step i, then both are evaluated if i is an evaluation step, all outside TRL's clock,
so load from other processes on a shared machine hits both alike.

Evaluation (outside both clocks): one separate engine, refit from the side's model, greedy
decoding of the held-out prompts, exact match of the decoded answer — the same function
for both sides.

Matched (from the config): model (``builtin_model`` config, seed, then the warm-start
weights), float32, prompts per step (TRL ``per_device_train_batch_size = P*N``, one
optimizer step per generation batch), samples per prompt (``num_generations``), max new
tokens, temperature/top-k/top-p, the optimizer (our ``make_adamw``: lr, betas, weight
decay) and the LR schedule (TRL gets a ``LambdaLR`` over our actor's own schedule
function, which runs over trainer.total_steps), the number of steps, grad clip, PPO clip
epsilons, KL (TRL ``beta`` = ``algo.kl.coef``, k3 loss, both), loss aggregation
(token-mean = TRL ``dapo``, seq-mean-token-mean = ``grpo``, seq-mean-token-sum-norm =
``dr_grpo``), group-std scaling (``scale_rewards``), exact-match reward, threads; no
gradient checkpointing (TRL's config defaults it to on; a user of a model this small turns
it off) and no torch.compile on either side. The rows' ``baseline_name`` says what TRL ran
with (version, checkpointing, compile, attention, generator), read off the trainer.

Differs (each framework's design; printed): our built-in engine vs ``model.generate``; any
of our options TRL lacks (DAPO dynamic sampling with refill, entropy bonus) stay on our
side — they are part of what the default job is.

``--stability N`` instead runs the default job itself (``hybridrl.job.loop.train``) for
trainer.seed 0..N-1 and prints each warm-start and final accuracy and its seconds.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report, row, trl_side_inputs  # noqa: E402
from step import trl_baseline_name  # noqa: E402

from hybridrl.config import Config  # noqa: E402
from hybridrl.config.io import load_config  # noqa: E402

TARGETS = (0.7, 0.8, 0.9)  # held-out accuracy
RELATIVE = (0.5, 0.8, 0.9)  # of the way from the warm start to the lower side's best (the fallback)
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
QUICK = dict(seeds=2, steps=12, eval_every=3, sft_steps=300)
DEFAULT = dict(seeds=3, eval_every=5)
ACC_ROWS = 10  # accuracy rows in the JSON: about this many evaluated steps, the last included


def bench_config(*, threads: int, output_dir: str, run_name: str = "bench_learning",
                 overrides: list[str] | None = None) -> Config:
    """The default job (plus ``overrides``), writing nothing but into ``output_dir``."""
    return load_config(None, [*(overrides or []), f"trainer.threads={threads}", f"trainer.output_dir={output_dir}",
                              f"trainer.run_name={run_name}", "checkpoint.save=false",
                              "logging.tensorboard=false", "logging.plot=false", "logging.progress=false"])


# ---- evaluation (one function for both sides) ------------------------------------------
class Evaluator:
    """Held-out greedy exact-match accuracy of any model with the run's architecture,
    through an engine of its own (refit from the model before each evaluation)."""

    def __init__(self, run):
        from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
        from hybridrl.trainer.rollout_worker import RolloutWorker
        from hybridrl.trainer.weight_sync import WeightSyncSpec

        cfg, model = run.cfg, run.policy
        self.tokenizer, self.eval_set = run.tokenizer, run.eval_set
        max_prompt = max(len(p) for p in self.eval_set.prompts)
        engine = RolloutEngine(model.config, EngineSpec(max_batch_size=min(max(len(self.eval_set.prompts), 1), 256),
                                                        max_seq_len=max_prompt + cfg.rollout.max_tokens,
                                                        dtype=next(model.parameters()).dtype,
                                                        device=next(model.parameters()).device))
        eos = self.tokenizer.eos_token_id
        sampling = SamplingParams(temperature=0.0, max_tokens=cfg.rollout.max_tokens,
                                  stop_token_ids=(eos,) if eos is not None else ())
        self.worker = RolloutWorker(engine, sampling, device=next(model.parameters()).device,
                                     sync=WeightSyncSpec(bucket_bytes=64 << 20, verify=False))
        self.seconds = 0.0

    def __call__(self, model: torch.nn.Module) -> float:
        from hybridrl.rewards.registry import exact_match

        t0 = time.perf_counter()
        self.worker.push(model, self.worker.version + 1)
        out = self.worker.greedy(self.eval_set.prompts)
        texts = self.tokenizer.batch_decode(out.response_token_ids, skip_special_tokens=True)
        acc = sum(exact_match(t, a) for t, a in zip(texts, self.eval_set.answers)) / max(len(texts), 1)
        self.seconds += time.perf_counter() - t0
        return acc


# ---- the two sides ---------------------------------------------------------------------
class Side:
    """One side's run: the seconds of each training step and the held-out accuracy at the
    evaluated steps, starting with ``(0, warm start accuracy)``."""

    def __init__(self, warm_acc: float):
        self.step_s: list[float] = []
        self.evals: list[tuple[int, float]] = [(0, float(warm_acc))]

    @property
    def steps(self) -> int:
        return len(self.step_s)

    def seconds(self) -> float:
        """Training seconds of the whole run."""
        return float(sum(self.step_s))

    def per_step(self) -> float:
        return self.seconds() / max(self.steps, 1)

    def best(self) -> float:
        return max(a for _, a in self.evals)

    def points(self) -> list[tuple[int, float, float]]:
        """``(step, training seconds so far, accuracy)`` at each evaluation."""
        cum = [0.0]
        for s in self.step_s:
            cum.append(cum[-1] + s)
        return [(k, cum[k], a) for k, a in self.evals]


def eval_due(step: int, every: int, last: int) -> bool:
    """Evaluate after this step: every ``every`` steps and after the last."""
    return step % every == 0 or step == last


class OursSide:
    """Our RL steps on a built run, each step's seconds recorded in ``side``."""

    def __init__(self, run, warm_acc: float):
        self.run = run
        self.rng = random.Random(run.cfg.trainer.seed + 1)
        self.side = Side(warm_acc)
        run.step.start(self.rng, 1)  # after the warm start: the batch source draws every step's prompts from rng

    def step(self) -> None:
        t0 = time.perf_counter()
        self.run.step()
        self.side.step_s.append(time.perf_counter() - t0)


def build_trl_side(cfg: Config, run, warm_state: dict, *, steps: int, output_dir: str, on_train_begin, on_step_end):
    """A ``GRPOTrainer`` matched to ``cfg`` (see the module docstring) on a model holding
    ``warm_state``, training ``steps`` steps; ``on_train_begin()`` and
    ``on_step_end(control)`` run from its callbacks."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"benchmarks/learning.py needs the bench extra for its baseline: "
                         f"pip install -e '.[bench]' ({e})")
    from transformers import TrainerCallback

    from hybridrl.trainer.actor import make_adamw

    r, t, a, o = cfg.rollout, cfg.trainer, cfg.algo, cfg.optim
    if a.loss_agg_mode not in LOSS_TYPES:
        raise SystemExit(f"algo.loss_agg_mode={a.loss_agg_mode} has no TRL loss_type counterpart "
                         f"(matched: {', '.join(LOSS_TYPES)})")
    model, data, exact_match_reward = trl_side_inputs(cfg, run, "benchmarks/learning.py")
    model.load_state_dict(warm_state)

    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**9,
        bf16=False, fp16=False, seed=t.seed, max_steps=steps, dataloader_num_workers=0,
        per_device_train_batch_size=cfg.batch.prompts_per_step * r.n, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=r.n, num_iterations=1, max_completion_length=r.max_tokens,
        temperature=r.temperature, top_k=max(r.top_k, 0), top_p=r.top_p, beta=a.kl.coef,
        epsilon=a.policy_loss.clip_ratio_low, epsilon_high=a.policy_loss.clip_ratio_high,
        loss_type=LOSS_TYPES[a.loss_agg_mode], scale_rewards="group" if a.advantage.norm_by_std else "none",
        mask_truncated_completions=False, learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        weight_decay=o.weight_decay, max_grad_norm=o.grad_clip, log_completions=False, disable_dropout=True,
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default is True: it would recompute every layer in the update
    )
    # the same optimizer implementation and the same LR schedule function as our actor's
    optimizer = make_adamw(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, run.step.actor.scheduler.lr_lambdas[0])

    class Interleave(TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            on_train_begin()

        def on_step_end(self, _args, _state, control, **_):
            on_step_end(control)

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=args, train_dataset=data,
                          processing_class=run.tokenizer, callbacks=[Interleave()], optimizers=(optimizer, scheduler))
    return trainer, model


@dataclass
class SeedResult:
    seed: int
    warm_acc: float
    sft_s: float
    ours: Side
    trl: Side
    trl_name: str  # what TRL ran with, its version first (step.trl_baseline_name)
    eval_s: float = 0.0


def run_seed(cfg: Config, *, steps: int, every: int, output_dir: str) -> SeedResult:
    """Warm start, then both sides for ``steps`` steps, interleaved step by step, both
    evaluated at the same steps."""
    from hybridrl.job.build import build_run
    from hybridrl.job.loop import _attach_reference, warm_start

    run = build_run(cfg, console=lambda s: None)
    try:
        t0 = time.perf_counter()
        warm_start(run, cfg)
        sft_s = time.perf_counter() - t0
        warm_state = {k: v.detach().clone() for k, v in run.policy.state_dict().items()}
        _attach_reference(run, cfg)
        evaluate = Evaluator(run)
        warm_acc = evaluate(run.policy)
        ours, trl = OursSide(run, warm_acc), Side(warm_acc)
        state: dict = {"mark": None, "model": None}

        def on_train_begin() -> None:
            state["mark"] = time.perf_counter()

        def on_step_end(control) -> None:
            trl.step_s.append(time.perf_counter() - state["mark"])
            k = trl.steps
            ours.step()
            if eval_due(k, every, steps):
                trl.evals.append((k, evaluate(state["model"])))
                ours.side.evals.append((k, evaluate(run.policy)))
            if k >= steps:
                control.should_training_stop = True
            state["mark"] = time.perf_counter()

        trainer, state["model"] = build_trl_side(cfg, run, warm_state, steps=steps, output_dir=output_dir,
                                                 on_train_begin=on_train_begin, on_step_end=on_step_end)
        trainer.train()
        if trl.steps != steps or ours.side.steps != steps:
            raise SystemExit(f"benchmarks/learning.py: seed {cfg.trainer.seed}: TRL ran {trl.steps} steps, "
                             f"ours {ours.side.steps}; expected {steps} each")
        name = trl_baseline_name(trainer)
    finally:
        run.log.close()
        run.step.scorer.close()
        if hasattr(run, "directory"):
            run.directory.close()
    return SeedResult(cfg.trainer.seed, warm_acc, sft_s, ours.side, trl, name, evaluate.seconds)


# ---- results ---------------------------------------------------------------------------
def crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x at which the piecewise-linear curve through ``(xs, ys)`` reaches
    ``target`` (None: never)."""
    target -= 1e-12
    if ys[0] >= target:
        return float(xs[0])
    for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:]):
        if y1 >= target:  # and y0 < target: the first crossing lies in this segment
            return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0))
    return None


def reach(side: Side, level: float) -> tuple[float, float, bool]:
    """``(training seconds, step, reached)`` when ``side`` first reaches ``level``,
    interpolated between evaluations; never reached: its whole run and False."""
    steps, secs, accs = zip(*side.points())
    t = crossing(list(secs), list(accs), level)
    if t is None:
        return side.seconds(), float(side.steps), False
    return t, crossing(list(steps), list(accs), level), True


@dataclass
class Target:
    """Both sides' times and steps to one target, per seed used."""
    label: str
    levels: list[float]
    seeds: list[int]
    ours_s: list[float] = field(default_factory=list)
    trl_s: list[float] = field(default_factory=list)
    ours_steps: list[float] = field(default_factory=list)
    trl_steps: list[float] = field(default_factory=list)
    ours_missed: int = 0  # seeds where the side never reached it (its time: the whole run)
    trl_missed: int = 0

    @property
    def bound(self) -> str:
        """'' (exact), '>=' (TRL missed it somewhere: the ratio is at least), '<=' (ours missed) or '?' (both)."""
        return {(0, 0): "", (0, 1): ">=", (1, 0): "<="}.get((min(self.ours_missed, 1), min(self.trl_missed, 1)), "?")

    def case(self) -> str:
        missed = [f"{who} missed it in {m}/{len(self.seeds)} seeds" for who, m in
                  (("ours", self.ours_missed), ("TRL", self.trl_missed)) if m]
        return f"time to {self.label}" + (f" ({'; '.join(missed)}: {self.bound} bound)" if missed else "")


def target_result(results: list[SeedResult], label: str, levels: list[float | None]) -> Target | None:
    """``levels[i]``: the target for ``results[i]`` (None: that seed is left out). None when
    no seed is left, or when in some seed neither side reaches it."""
    used = [(r, lv) for r, lv in zip(results, levels) if lv is not None]
    if not used:
        return None
    out = Target(label, [lv for _, lv in used], [r.seed for r, _ in used])
    for r, lv in used:
        (to, so, ok_o), (tt, st, ok_t) = reach(r.ours, lv), reach(r.trl, lv)
        if not (ok_o or ok_t):
            return None
        out.ours_s.append(to)
        out.trl_s.append(tt)
        out.ours_steps.append(so)
        out.trl_steps.append(st)
        out.ours_missed += not ok_o
        out.trl_missed += not ok_t
    return out


def choose_targets(results: list[SeedResult]) -> list[Target]:
    """The absolute targets (:data:`TARGETS`) above every warm start that some side reaches
    in every seed; if none, the relative ones (:data:`RELATIVE` of the way from each seed's
    warm start to the lower of the two sides' best; seeds where that is no gain are left out)."""
    top_warm = max(r.warm_acc for r in results)
    out = [t for level in TARGETS if level > top_warm + 1e-9
           and (t := target_result(results, f"{level:.0%}", [level] * len(results))) is not None]
    if out:
        return out
    for f in RELATIVE:
        levels = []
        for r in results:
            gain = min(r.ours.best(), r.trl.best()) - r.warm_acc
            levels.append(r.warm_acc + f * gain if gain > 1e-9 else None)
        t = target_result(results, f"{f:.0%} of the gain", levels)
        if t is not None:
            out.append(t)
    return out


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("inf")


def target_line(t: Target, results: list[SeedResult]) -> str:
    """The printed summary of one target: both sides' median time [range], the ratio of the
    medians, the median of the per-seed ratios, the steps ratio and the per-step time ratio."""
    by_seed = {r.seed: r for r in results}
    per_step = _med([_ratio(by_seed[s].trl.per_step(), by_seed[s].ours.per_step()) for s in t.seeds])
    seed_ratios = [_ratio(b, a) for a, b in zip(t.ours_s, t.trl_s)]
    levels = f"{min(t.levels):.3f}" + (f"-{max(t.levels):.3f}" if max(t.levels) > min(t.levels) else "")
    return (f"{t.case()} (level {levels}"
            + f", {len(t.seeds)} seeds): ours {_med(t.ours_s):.2f} s [{min(t.ours_s):.2f}-{max(t.ours_s):.2f}], "
            f"TRL {_med(t.trl_s):.2f} s [{min(t.trl_s):.2f}-{max(t.trl_s):.2f}] -> {t.bound}"
            f"{_ratio(_med(t.trl_s), _med(t.ours_s)):.2f}x (per-seed ratios: median {_med(seed_ratios):.2f}x, "
            f"{min(seed_ratios):.2f}-{max(seed_ratios):.2f}x); steps: ours {_med(t.ours_steps):.1f}, "
            f"TRL {_med(t.trl_steps):.1f} (TRL/ours {_ratio(_med(t.trl_steps), _med(t.ours_steps)):.2f}x); "
            f"per-step time TRL/ours {per_step:.2f}x")


def accuracy_table(results: list[SeedResult]) -> str:
    """Accuracy per evaluated step, side by side: median [min-max] over seeds, and each
    side's median training seconds at that step."""
    n = len(results)
    lines = [f"{'step':>5} {'ours acc (median [range])':>26} {'ours s':>7} {'TRL acc (median [range])':>26} "
             f"{'TRL s':>7}   ({n} seed{'s' if n > 1 else ''})"]
    cols = [(r.ours.points(), r.trl.points()) for r in results]
    for i, (step, _, _) in enumerate(cols[0][0]):
        cells = []
        for side in (0, 1):
            accs = [c[side][i][2] for c in cols]
            secs = [c[side][i][1] for c in cols]
            cells.append(f"{_med(accs):>9.3f} [{min(accs):.3f}-{max(accs):.3f}] {_med(secs):>7.2f}")
        lines.append(f"{step:>5} {cells[0]:>34} {cells[1]:>34}")
    return "\n".join(lines)


def build_rows(results: list[SeedResult], targets: list[Target]) -> list[dict]:
    """The JSON rows: per target the median, min and max seconds and the median steps;
    the median seconds per step; held-out accuracy (median over seeds) at about
    :data:`ACC_ROWS` evaluated steps."""
    name, n = results[0].trl_name, len(results)
    rows = []
    for t in targets:
        k = len(t.seeds)
        for metric, fn in ((f"seconds, median of {k} seeds", _med), (f"seconds, min of {k} seeds", min),
                           (f"seconds, max of {k} seeds", max)):
            rows.append(row(case=t.case(), metric=metric, ours=fn(t.ours_s), baseline=fn(t.trl_s),
                            baseline_name=name, higher_is_better=False))
        rows.append(row(case=t.case(), metric=f"steps, median of {k} seeds", ours=_med(t.ours_steps),
                        baseline=_med(t.trl_steps), baseline_name=name, higher_is_better=False))
    rows.append(row(case=f"{results[0].ours.steps} steps", metric=f"s/step, median of {n} seeds",
                    ours=_med([r.ours.per_step() for r in results]), baseline=_med([r.trl.per_step() for r in results]),
                    baseline_name=name, higher_is_better=False))
    evals = [k for k, _ in results[0].ours.evals][1:]
    stride = max(1, -(-len(evals) // ACC_ROWS))
    picked = sorted(set(evals[stride - 1::stride]) | {evals[-1]}) if evals else []
    for k in picked:
        i = [s for s, _ in results[0].ours.evals].index(k)
        rows.append(row(case=f"step {k}", metric=f"held-out accuracy, median of {n} seeds",
                        ours=_med([r.ours.evals[i][1] for r in results]),
                        baseline=_med([r.trl.evals[i][1] for r in results]), baseline_name=name,
                        higher_is_better=True))
    return rows


def plot(results: list[SeedResult], targets: list[Target], path: Path) -> None:
    """Accuracy vs training seconds and vs step: the median over seeds and the min-max band
    (per seed, the curve is linear between evaluations and holds its last value after its run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(results)
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, get, color in (("hybridrl", lambda r: r.ours, "C0"), (results[0].trl_name, lambda r: r.trl, "C1")):
        pts = [get(r).points() for r in results]
        grid = np.linspace(0.0, max(p[-1][1] for p in pts), 400)
        by_time = np.array([np.interp(grid, [q[1] for q in p], [q[2] for q in p]) for p in pts])
        ax_t.plot(grid, np.median(by_time, axis=0), color=color, label=label)
        ax_t.fill_between(grid, by_time.min(axis=0), by_time.max(axis=0), color=color, alpha=0.2, linewidth=0)
        steps = [q[0] for q in pts[0]]
        by_step = np.array([[q[2] for q in p] for p in pts])
        ax_s.plot(steps, np.median(by_step, axis=0), color=color, marker=".", label=label)
        ax_s.fill_between(steps, by_step.min(axis=0), by_step.max(axis=0), color=color, alpha=0.2, linewidth=0)
    for t in targets:
        if len(set(t.levels)) == 1:  # an absolute target: one level for every seed
            for ax in (ax_t, ax_s):
                ax.axhline(t.levels[0], color="gray", linestyle=":", linewidth=0.8)
    ax_t.set_xlabel("training seconds (each side's own clock)")
    ax_s.set_xlabel("RL step")
    for ax in (ax_t, ax_s):
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    ax_t.legend(loc="best", fontsize=8)
    fig.suptitle(f"GRPO from the same warm start: median of {n} seed{'s' if n > 1 else ''}, band = min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- modes -----------------------------------------------------------------------------
def compare(args, overrides: list[str]) -> list[dict]:
    n_seeds = args.seeds or (QUICK["seeds"] if args.quick else DEFAULT["seeds"])
    every = args.eval_every or (QUICK["eval_every"] if args.quick else DEFAULT["eval_every"])
    tmp = tempfile.mkdtemp(prefix="hybridrl_bench_learning_")
    if args.quick:  # a smoke run of the harness: a short warm start (the default's takes ~1.5 min)
        overrides = [f"warm_start.steps={QUICK['sft_steps']}", *overrides]
    results: list[SeedResult] = []
    for seed in range(n_seeds):
        cfg = bench_config(threads=args.threads, output_dir=tmp, run_name=f"bench_learning_seed{seed}",
                           overrides=[*overrides, f"trainer.seed={seed}"])
        total = cfg.trainer.total_steps
        steps = min(args.steps or (QUICK["steps"] if args.quick else total), total)
        if seed == 0:
            d = cfg.algo.dapo
            print(f"default job: batch {cfg.batch.prompts_per_step}x{cfg.rollout.n}, max_tokens "
                  f"{cfg.rollout.max_tokens}, lr {cfg.optim.lr} (warm-up {cfg.optim.warmup_steps}, schedule over "
                  f"{total} steps), KL {cfg.algo.kl.coef}, threads {torch.get_num_threads()}; ours also: dynamic "
                  f"sampling {d.dynamic_sampling} (refill {d.refill_rounds}), entropy bonus "
                  f"{cfg.algo.policy_loss.entropy_coeff}; {n_seeds} seeds x {steps} steps per side, evaluated every "
                  f"{every} steps; warm start {cfg.warm_start.steps} supervised steps", flush=True)
        r = run_seed(cfg, steps=steps, every=every, output_dir=tmp)
        results.append(r)
        print(f"seed {seed}: warm start {r.warm_acc:.3f} ({r.sft_s:.1f}s); ours {r.ours.per_step():.3f} s/step, best "
              f"{r.ours.best():.3f}, final {r.ours.evals[-1][1]:.3f}; TRL {r.trl.per_step():.3f} s/step, best "
              f"{r.trl.best():.3f}, final {r.trl.evals[-1][1]:.3f}; evaluation {r.eval_s:.1f}s (outside the clocks)",
              flush=True)
    print(f"baseline: {results[0].trl_name}")
    print(accuracy_table(results))
    targets = choose_targets(results)
    rows = build_rows(results, targets)
    report(rows, args.json)
    per_step = _med([_ratio(r.trl.per_step(), r.ours.per_step()) for r in results])
    print(f"per-step time TRL/ours over the whole runs: {per_step:.2f}x (median of seeds; ours "
          f"{_med([r.ours.per_step() for r in results]):.3f} s, TRL {_med([r.trl.per_step() for r in results]):.3f} s)")
    if not targets:
        print("no target: neither side improved on the warm start")
    for t in targets:
        print(target_line(t, results))
    if args.json:
        png = Path(args.json).with_suffix(".png")
        plot(results, targets, png)
        print(f"wrote {png}")
    return rows


def stability(args, overrides: list[str]) -> list[dict]:
    """The default job itself for trainer.seed 0..N-1: warm-start and final accuracy, seconds."""
    from hybridrl.job.loop import train

    tmp = tempfile.mkdtemp(prefix="hybridrl_bench_seeds_")
    rows, finals = [], []
    for s in range(args.stability):
        cfg = bench_config(threads=args.threads, output_dir=tmp, run_name=f"seed{s}",
                           overrides=[*overrides, f"trainer.seed={s}"])
        res = train(cfg)
        finals.append(res.final_accuracy)
        steps = [r for r in res.history if r.get("step", 0) > 0 and any(k.startswith("time/") for k in r)]
        step_s = sum(v for r in steps for k, v in r.items() if k.startswith("time/")) / max(len(steps), 1)
        curve = " ".join(f"{r['step']}:{r['eval/accuracy']:.2f}" for r in res.history if "eval/accuracy" in r)
        print(f"seed {s}: warm start {res.warm_start_accuracy:.3f} -> final {res.final_accuracy:.3f} "
              f"(+{100 * (res.final_accuracy - res.warm_start_accuracy):.0f} points) in {res.seconds:.0f}s "
              f"({step_s:.3f} s per RL step)\n  eval curve (step:accuracy): {curve}", flush=True)
        rows.append(row(case=f"seed {s}", metric="final accuracy", ours=res.final_accuracy,
                        baseline=res.warm_start_accuracy, baseline_name="its warm start", higher_is_better=True))
    report(rows, args.json)
    print(f"min final accuracy over {args.stability} seeds: {min(finals):.3f} (goal: all >= 0.85)")
    return rows


def _add_options(ap) -> None:
    ap.add_argument("--seeds", type=int, help=f"seeds (trainer.seed 0..N-1) of the comparison "
                                              f"(default {DEFAULT['seeds']}; quick {QUICK['seeds']})")
    ap.add_argument("--steps", type=int,
                    help=f"RL steps per side (default trainer.total_steps; quick {QUICK['steps']})")
    ap.add_argument("--eval-every", type=int, help=f"evaluate both sides every this many steps "
                                                   f"(default {DEFAULT['eval_every']}; quick {QUICK['eval_every']})")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both sides")
    ap.add_argument("--stability", type=int, default=0, metavar="N",
                    help="instead: run the default job itself for trainer.seed 0..N-1")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted config override for the job (repeatable), e.g. --set optim.lr=3e-4")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], _add_options)
    warnings.filterwarnings("ignore")  # deprecation chatter from transformers/trl, not results
    torch.set_num_threads(args.threads)
    for name in ("seeds", "steps", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.stability:
        stability(args, args.overrides)
    else:
        compare(args, args.overrides)


if __name__ == "__main__":
    main()
