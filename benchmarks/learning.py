"""Time-to-accuracy: hybridrl GRPO vs TRL's ``GRPOTrainer`` from the same warm start.

    pip install -e ".[bench]"          # trl + datasets, only for the baseline
    python benchmarks/learning.py [--quick] [--json PATH] [--budget S] [--every S] [--threads K] [--set KEY=VALUE ...]
    python benchmarks/learning.py --seeds 5 [--set KEY=VALUE ...]   # stability: the default job, five seeds

The default job (``hybridrl train`` with the defaults, plus any ``--set`` overrides) runs
its supervised warm start once; both sides then start RL from those same weights, and
held-out greedy accuracy is measured at equal training wall-clock checkpoints (every
``--every`` seconds up to ``--budget``; 30 s up to 300 s, ``--quick`` 5 s up to 15 s
from a 300-step warm start: a smoke run of the harness), printed side by side. The
headline row is the ratio of the times each side needs to reach TRL's best accuracy or
80 %, whichever is lower (time to the first checkpoint at or
above it; a side that never reaches it counts as the whole budget, making the ratio a
bound; if TRL never gets above the warm start, the target is our best, capped at 80 %).

Clocks. Each side's clock counts its own training work only:
  * ours: the wall time of every ``RLStep`` call (rollout, reward, update, refit);
  * TRL: wall time from ``on_train_begin``, minus the time spent inside our callback
    (our steps and every evaluation), so its data loading, logging and callbacks count.
The sides are interleaved: after each TRL step, ours steps until its clock catches up,
so load from other processes on a shared machine hits both alike. Accuracy at checkpoint
t is that of the weights after the first step ending at or after t (both sides alike).

Evaluation (outside both clocks): one separate engine, refit from the side's model, greedy
decoding of the held-out prompts, exact match of the decoded answer — the same function
for both sides.

Matched (from the config): model (``builtin_model`` config, seed, then the warm-start
weights), float32, prompts per step (TRL ``per_device_train_batch_size = P*N``, one
optimizer step per generation batch), samples per prompt (``num_generations``), max new
tokens, temperature/top-k/top-p, the optimizer (our ``make_adamw``: lr, betas, weight
decay) and the LR schedule (TRL gets a ``LambdaLR`` over our actor's own schedule
function), trainer.total_steps (both stop there: the schedule's end; a side that gets
there before the budget keeps its final accuracy), grad clip, PPO clip epsilons,
KL (TRL ``beta`` = ``algo.kl.coef``, k3 loss, both), loss aggregation (token-mean = TRL
``dapo``, seq-mean-token-mean = ``grpo``, seq-mean-token-sum-norm = ``dr_grpo``), group-std
scaling (``scale_rewards``), exact-match reward, threads.

Differs (each framework's design; printed): our built-in engine vs ``model.generate``; any
of our options TRL lacks (DAPO dynamic sampling with refill, entropy bonus) stay on our
side — they are part of what the default job is.

``--seeds N`` instead runs the default job itself (``hybridrl.job.loop.train``) for
trainer.seed 0..N-1 and prints each warm-start and final accuracy and its seconds.
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report, row, trl_side_inputs  # noqa: E402

from hybridrl.config import Config  # noqa: E402
from hybridrl.config.io import load_config  # noqa: E402

TRL_NAME = "trl GRPOTrainer"
TARGET_CAP = 0.8
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


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
                                     bucket_bytes=64 << 20, verify_refit=False)
        self.seconds = 0.0

    def __call__(self, model: torch.nn.Module) -> float:
        from hybridrl.rewards.registry import exact_match

        t0 = time.perf_counter()
        self.worker.refit(model)
        out = self.worker.greedy(self.eval_set.prompts)
        texts = self.tokenizer.batch_decode(out.response_token_ids, skip_special_tokens=True)
        acc = sum(exact_match(t, a) for t, a in zip(texts, self.eval_set.answers)) / max(len(texts), 1)
        self.seconds += time.perf_counter() - t0
        return acc


# ---- the two sides ---------------------------------------------------------------------
class Curve:
    """Accuracy at the wall-clock checkpoints ``every, 2*every, ... <= budget`` (plus 0)."""

    def __init__(self, budget: float, every: float, warm_acc: float):
        self.budget, self.every = budget, every
        self.points: list[tuple[float, float, int]] = [(0.0, warm_acc, 0)]  # (checkpoint s, acc, steps)

    def next_due(self) -> float:
        return self.points[-1][0] + self.every

    def due(self, clock: float) -> bool:
        nxt = self.next_due()
        return nxt <= self.budget + 1e-9 and clock >= nxt

    def done(self) -> bool:
        return self.next_due() > self.budget + 1e-9

    def finish(self, evaluate, model, steps: int) -> None:
        """The side stopped (its schedule ended) before the budget: its model no longer
        changes, so the remaining checkpoints hold its final accuracy."""
        if self.done():
            return
        acc = evaluate(model)
        while not self.done():
            self.points.append((self.next_due(), acc, steps))


class OursSide:
    """Our RL steps on a built run, with the step clock and the checkpoint curve."""

    def __init__(self, run, evaluate: Evaluator, curve: Curve):
        self.run, self.evaluate, self.curve = run, evaluate, curve
        self.rng = random.Random(run.cfg.trainer.seed + 1)
        self.clock, self.steps = 0.0, 0

    def step(self) -> None:
        t0 = time.perf_counter()
        self.run.step(self.rng)
        self.clock += time.perf_counter() - t0
        self.steps += 1
        while self.curve.due(self.clock):
            self.curve.points.append((self.curve.next_due(), self.evaluate(self.run.policy), self.steps))

    def run_until(self, clock: float) -> None:
        while (self.clock < min(clock, self.curve.budget) and not self.curve.done()
               and self.steps < self.run.cfg.trainer.total_steps):
            self.step()
        if self.steps >= self.run.cfg.trainer.total_steps:
            self.curve.finish(self.evaluate, self.run.policy, self.steps)


def build_trl_side(cfg: Config, run, warm_state: dict, *, output_dir: str, on_step_end):
    """A ``GRPOTrainer`` matched to ``cfg`` (see the module docstring) on a model holding
    ``warm_state``; ``on_step_end(trainer, control)`` runs after each of its steps."""
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
        bf16=False, fp16=False, seed=t.seed, max_steps=t.total_steps, dataloader_num_workers=0,
        per_device_train_batch_size=cfg.batch.prompts_per_step * r.n, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=r.n, num_iterations=1, max_completion_length=r.max_tokens,
        temperature=r.temperature, top_k=max(r.top_k, 0), top_p=r.top_p, beta=a.kl.coef,
        epsilon=a.policy_loss.clip_ratio_low, epsilon_high=a.policy_loss.clip_ratio_high,
        loss_type=LOSS_TYPES[a.loss_agg_mode], scale_rewards="group" if a.advantage.norm_by_std else "none",
        mask_truncated_completions=False, learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        weight_decay=o.weight_decay, max_grad_norm=o.grad_clip, log_completions=False, disable_dropout=True,
        disable_tqdm=True,
    )
    # the same optimizer implementation and the same LR schedule function as our actor's
    optimizer = make_adamw(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, run.step.actor.scheduler.lr_lambdas[0])

    class Interleave(TrainerCallback):
        def on_step_end(self, _args, _state, control, **_):
            on_step_end(control)

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=args, train_dataset=data,
                          processing_class=run.tokenizer, callbacks=[Interleave()], optimizers=(optimizer, scheduler))
    return trainer, model


# ---- results ---------------------------------------------------------------------------
def time_to(points: list[tuple[float, float, int]], target: float) -> float | None:
    """Seconds of the first checkpoint after the start (t > 0) at or above ``target``
    (None: never within the budget)."""
    for t, acc, _ in points:
        if t > 0 and acc >= target - 1e-12:
            return t
    return None


def headline(ours: list, trl: list, budget: float) -> dict:
    """The target is TRL's best accuracy after the start, capped at 80 %; if TRL never got
    above the warm start, ours' best (capped) instead, which TRL then never reaches. The
    times both sides need to reach it and their ratio TRL / ours (> 1: ours faster); a side
    that never reaches it counts as the whole budget, making the ratio a bound."""
    warm = ours[0][1]
    best_trl = max(acc for t, acc, _ in trl if t > 0)
    target = min(best_trl, TARGET_CAP)
    if target <= warm:  # TRL never improved on the warm start
        target = min(max(acc for t, acc, _ in ours if t > 0), TARGET_CAP)
        if target <= warm:
            return {"target": target, "ours": None, "trl": None, "ratio": float("nan"),
                    "bound": "neither side improved on the warm start"}
    t_ours, t_trl = time_to(ours, target), time_to(trl, target)
    bound = ""
    if t_ours is None:
        t_ours, bound = budget, "<="  # ours never got there: the ratio is at most this
    if t_trl is None:
        t_trl, bound = budget, ">="  # TRL never got there: the ratio is at least this
    return {"target": target, "ours": t_ours, "trl": t_trl, "ratio": t_trl / t_ours, "bound": bound}


def side_by_side(ours: list, trl: list) -> str:
    lines = [f"{'t (s)':>6} {'ours acc':>9} {'ours steps':>10} {'trl acc':>8} {'trl steps':>9}"]
    for (t, a, s), (_, b, u) in zip(ours, trl):
        lines.append(f"{t:>6.0f} {a:>9.3f} {s:>10d} {b:>8.3f} {u:>9d}")
    return "\n".join(lines)


# ---- modes -----------------------------------------------------------------------------
QUICK_SFT_STEPS = 300

def compare(args, overrides: list[str]) -> list[dict]:
    from hybridrl.job.build import build_run
    from hybridrl.job.loop import _attach_reference, warm_start

    budget = args.budget or (15.0 if args.quick else 300.0)
    every = args.every or (5.0 if args.quick else 30.0)
    tmp = tempfile.mkdtemp(prefix="hybridrl_bench_learning_")
    if args.quick:  # a smoke run of the harness: a short warm start (the default's takes ~1.5 min)
        overrides = [f"warm_start.steps={QUICK_SFT_STEPS}", *overrides]
    cfg = bench_config(threads=args.threads, output_dir=tmp, overrides=overrides)
    torch.set_num_threads(args.threads)
    run = build_run(cfg, console=lambda s: None)
    try:
        t0 = time.perf_counter()
        warm_start(run, cfg)
        sft_s = time.perf_counter() - t0
        warm_state = {k: v.detach().clone() for k, v in run.policy.state_dict().items()}
        _attach_reference(run, cfg)
        evaluate = Evaluator(run)
        warm_acc = evaluate(run.policy)
        ours = OursSide(run, evaluate, Curve(budget, every, warm_acc))
        trl_curve = Curve(budget, every, warm_acc)
        clock = {"start": None, "excluded": 0.0, "steps": 0}
        holder: dict = {}

        def on_step_end(control) -> None:
            t_in = time.perf_counter()
            trl_clock = t_in - clock["start"] - clock["excluded"]
            clock["steps"] += 1
            while trl_curve.due(trl_clock):
                trl_curve.points.append((trl_curve.next_due(), evaluate(holder["model"]), clock["steps"]))
            ours.run_until(trl_clock)
            if trl_curve.done():
                control.should_training_stop = True
            clock["excluded"] += time.perf_counter() - t_in

        trainer, trl_model = build_trl_side(cfg, run, warm_state, output_dir=tmp, on_step_end=on_step_end)
        holder["model"] = trl_model
        from transformers import TrainerCallback

        class Start(TrainerCallback):
            def on_train_begin(self, *_a, **_k):
                clock["start"] = time.perf_counter()

        trainer.add_callback(Start())
        d = cfg.algo.dapo
        print(f"default job: {run.describe_model()}; batch {cfg.batch.prompts_per_step}x{cfg.rollout.n}, "
              f"max_tokens {cfg.rollout.max_tokens}, lr {cfg.optim.lr} (warm-up {cfg.optim.warmup_steps}), "
              f"KL {cfg.algo.kl.coef}, threads {torch.get_num_threads()}; ours also: dynamic sampling "
              f"{d.dynamic_sampling} (refill {d.refill_rounds}), entropy bonus {cfg.algo.policy_loss.entropy_coeff}",
              flush=True)
        print(f"warm start: {cfg.warm_start.steps} supervised steps in {sft_s:.1f}s, held-out accuracy "
              f"{warm_acc:.3f} (both sides start here); budget {budget:.0f}s per side, checkpoints every "
              f"{every:.0f}s", flush=True)
        trainer.train()
        trl_curve.finish(evaluate, trl_model, clock["steps"])  # TRL reached trainer.total_steps first
        ours.run_until(budget)
    finally:
        run.log.close()
        run.step.scorer.close()
        if hasattr(run, "directory"):
            run.directory.close()
    print(side_by_side(ours.curve.points, trl_curve.points))
    h = headline(ours.curve.points, trl_curve.points, budget)
    rows = [row(case=f"t={t:.0f}s", metric="held-out accuracy", ours=a, baseline=b, baseline_name=TRL_NAME,
                higher_is_better=True) for (t, a, _), (_, b, _) in zip(ours.curve.points[1:], trl_curve.points[1:])]
    if h["ours"] is not None and not math.isnan(h["ratio"]):
        rows.append(row(case=f"time to {h['target']:.0%}{' (' + h['bound'] + ' bound)' if h['bound'] else ''}",
                        metric="seconds", ours=h["ours"], baseline=h["trl"], baseline_name=TRL_NAME,
                        higher_is_better=False))
    report(rows, args.json)
    steps_o, steps_t = ours.curve.points[-1][2], trl_curve.points[-1][2]
    print(f"steps in {budget:.0f}s: ours {steps_o} ({budget / max(steps_o, 1):.3f} s/step), TRL {steps_t} "
          f"({budget / max(steps_t, 1):.3f} s/step); evaluation time (outside the clocks) {evaluate.seconds:.1f}s")
    if math.isnan(h["ratio"]):
        print(f"headline: target {h['target']:.3f}: {h['bound']}")
    else:
        print(f"headline: time to {h['target']:.3f} (min of TRL's best and {TARGET_CAP:.0%}): ours {h['ours']:.0f}s, "
              f"TRL {h['trl']:.0f}s -> {h['bound']}{h['ratio']:.2f}x faster (goal 2x)")
    return rows


def seeds(args, overrides: list[str]) -> list[dict]:
    """The default job itself for trainer.seed 0..N-1: warm-start and final accuracy, seconds."""
    from hybridrl.job.loop import train

    tmp = tempfile.mkdtemp(prefix="hybridrl_bench_seeds_")
    rows, finals = [], []
    for s in range(args.seeds):
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
    print(f"min final accuracy over {args.seeds} seeds: {min(finals):.3f} (goal: all >= 0.85)")
    return rows


def _add_options(ap) -> None:
    ap.add_argument("--budget", type=float, help="training seconds per side (default 300; quick 15)")
    ap.add_argument("--every", type=float, help="checkpoint interval in seconds (default 30; quick 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both sides")
    ap.add_argument("--seeds", type=int, default=0, help="run the default job for this many seeds instead")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted config override for the job (repeatable), e.g. --set optim.lr=3e-4")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], _add_options)
    warnings.filterwarnings("ignore")  # deprecation chatter from transformers/trl, not results
    if args.seeds:
        seeds(args, args.overrides)
    else:
        compare(args, args.overrides)


if __name__ == "__main__":
    main()
