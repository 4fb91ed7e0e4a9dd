"""Seconds per GRPO step: hybridrl's ``rl_step`` vs TRL's ``GRPOTrainer``, in one run.

    pip install -e ".[bench]"          # trl + datasets, only for the baseline
    python benchmarks/step.py [--quick] [--json PATH] [--prompts P --n N --max-tokens T --steps S --threads K]

Both sides train the built-in tiny Qwen2 (random init, same config and seed, hence the
same initial weights) on hybridrl's arithmetic prompts with the char tokenizer, and the
steps are **interleaved**: a TRL step, then one of ours (run from a TRL callback, outside
TRL's timed window), and so on, so load from other processes hits both alike. The first
step of each side is warm-up and not counted; medians of the rest are reported, plus the
best (minimum) step, the least load-sensitive estimate on a shared machine, and the median
of the paired per-step ratios.

Matched:
  * model: ``builtin_model`` with ``cfg.model`` and ``cfg.trainer.seed``; float32 (TRL ``bf16=False``).
  * batch: P prompts x N samples per prompt (``num_generations``), one optimizer step per
    generation batch on both sides (ours ``mini_batch_size = P*N``, ppo_epochs 1; TRL
    ``per_device_train_batch_size = P*N``, gradient_accumulation_steps 1,
    steps_per_generation 1, num_iterations 1).
  * sampling: temperature 1, no top-k / top-p, the same max new tokens, stop at eos.
  * prompts: TRL gets the prompt texts; its own tokenization (``_tokenize_prompts``, the
    char tokenizer prepends ``<bos>``) gives exactly our prompt ids (checked, every prompt).
  * reward: ``hybridrl.rewards.exact_match`` on the decoded response (special tokens skipped).
  * loss: PPO clip 0.2/0.2, token-mean over the batch (TRL ``loss_type="dapo"``), group-std
    advantages (``scale_rewards="group"``), no KL (ours kl_coef 0, TRL ``beta=0``);
    AdamW lr 2e-4, betas (0.9, 0.99), no weight decay, grad clip 1.0, constant LR.
  * threads: ``torch.set_num_threads(--threads)`` for the whole process.
  * no gradient checkpointing on either side (TRL's config defaults it to on; a user of a
    model this small turns it off); neither side uses torch.compile. Each row's
    ``baseline_name`` says what TRL ran with (version, checkpointing, compile, attention,
    generator), read off the trainer at run time.

Differs (by design of each framework):
  * rollout: ours is the built-in engine (paged KV cache, continuous batching); TRL calls
    ``model.generate`` on the training model (left-padded, HF dynamic cache).
  * ours recomputes the old log-probs with the trainer (``time/log_probs_s``, also gives
    entropy and the rollout/trainer mismatch) and refits the engine weights
    (``time/refit_s``); TRL on-policy (num_iterations 1, aligned steps) skips the old
    log-prob pass and has no second copy of the weights. Both are inside our step time.
  * ours scores rewards in a timeout-guarded runner; TRL calls the function directly.
  * TRL's step window is ``on_step_begin``..``on_step_end`` (it excludes the data-loader
    fetch of the prompt dicts, which is negligible); ours is the wall time of ``rl_step``.
  * response lengths follow each side's own samples (random init: most hit max tokens);
    the mean lengths are printed so a mismatch is visible.

Phase rows: rollout+reward (ours ``time/rollout_s``, which scores each group while later
ones still decode, vs TRL ``_generate_single_turn`` plus ``_calculate_rewards``) and
update (ours ``time/update_s`` vs TRL step minus
``_prepare_inputs``: the loss forward, backward and optimizer step). TRL's phases are
timed by wrapping those bound methods on the trainer instance.
"""

from __future__ import annotations

import functools
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, parse_args, report, row, trl_side_inputs  # noqa: E402

from hybridrl.config import Config  # noqa: E402
from hybridrl.config.io import build_config  # noqa: E402

WARMUP_STEPS = 1
OURS_PHASES = ("rollout", "log_probs", "advantages", "update", "refit")  # scoring runs inside "rollout"


def trl_baseline_name(trainer) -> str:
    """What TRL ran with, read off the trainer after it trained (for each row's ``baseline_name``):
    its version, gradient checkpointing, torch.compile, the attention kernel, the generator."""
    import trl

    args, model = trainer.args, trainer.model
    return (f"TRL {trl.__version__} GRPOTrainer, gradient checkpointing "
            f"{'on' if getattr(model, 'is_gradient_checkpointing', args.gradient_checkpointing) else 'off'}, "
            f"{'torch.compile' if args.torch_compile else 'eager'}, "
            f"{getattr(model.config, '_attn_implementation', None) or 'default'} attention, "
            f"{'vLLM' if args.use_vllm else 'HF generate'}")


def bench_config(*, prompts: int, n: int, max_tokens: int, threads: int, output_dir: str,
                 model: dict | None = None, data: dict | None = None) -> Config:
    """The default job at this batch, one optimizer step per rollout batch, no file output."""
    return build_config({
        "model": model or {},
        "data": data or {},
        "rollout": {"n": n, "max_tokens": max_tokens, "temperature": 1.0},
        "batch": {"prompts_per_step": prompts, "mini_batch_size": prompts * n, "ppo_epochs": 1},
        "trainer": {"threads": threads, "output_dir": output_dir, "run_name": "bench_step"},
        "warm_start": {"steps": 0}, "checkpoint": {"save": False},
        "logging": {"tensorboard": False, "plot": False, "progress": False},
    })


class OursSide:
    """``build_run`` once, then one ``rl_step`` per call; keeps each step's seconds."""

    def __init__(self, cfg: Config):
        from hybridrl.job.build import build_run

        self.cfg = cfg
        self.run = build_run(cfg, console=lambda s: None)
        self.rng = random.Random(cfg.trainer.seed + 1)
        self.run.step.start(self.rng, 1)  # the batch source draws every step's prompts from rng
        self.steps: list[dict[str, float]] = []

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        m = self.run.step()
        rec = {"step": time.perf_counter() - t0, "length": m["response/length_mean"],
               **{p: m[f"time/{p}_s"] for p in OURS_PHASES}}
        rec["rollout+reward"] = rec["rollout"]
        rec["other"] = rec["step"] - sum(rec[p] for p in OURS_PHASES)  # advantages, masks, metrics
        self.steps.append(rec)
        return rec

    def close(self) -> None:
        self.run.step.close()
        self.run.log.close()
        self.run.step.scorer.close()


def measure_ours(cfg: Config, steps: int) -> list[dict[str, float]]:
    """Our side alone (no TRL): per-step seconds of ``steps`` steps, warm-up included."""
    side = OursSide(cfg)
    try:
        for _ in range(steps):
            side.step()
    finally:
        side.close()
    return side.steps


def _timed_method(obj, name: str, acc: dict[str, float], on_call=None) -> None:
    """Wrap the bound method ``obj.name`` (this instance only) to add its seconds to ``acc[name]``."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        if on_call is not None:
            on_call(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def build_trl(cfg: Config, run, *, steps: int, output_dir: str, after_step):
    """A ``GRPOTrainer`` matched to ``cfg`` (see the module docstring); ``after_step()`` runs
    after each of its steps, outside the timed window. Returns (trainer, per-step records)."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"benchmarks/step.py needs the bench extra for its baseline: pip install -e '.[bench]' ({e})")
    from transformers import TrainerCallback

    r, t = cfg.rollout, cfg.trainer
    model, data, exact_match_reward = trl_side_inputs(cfg, run, "benchmarks/step.py")

    batch = cfg.batch.prompts_per_step * r.n
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**9,
        bf16=False, fp16=False, seed=t.seed, max_steps=steps, dataloader_num_workers=0,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=r.n, num_iterations=1, max_completion_length=r.max_tokens,
        temperature=r.temperature, top_k=0, top_p=1.0, beta=0.0, epsilon=cfg.algo.policy_loss.clip_ratio_low,
        epsilon_high=cfg.algo.policy_loss.clip_ratio_high, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, learning_rate=cfg.optim.lr, adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1], weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.grad_clip,
        lr_scheduler_type="constant", warmup_steps=0, log_completions=False, disable_dropout=True, disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default is True: it would recompute every layer in the update
    )
    records: list[dict[str, float]] = []
    acc: dict[str, float] = {}
    lengths: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            acc.clear()
            lengths.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_s = time.perf_counter() - self.t0
            prep = acc.get("_prepare_inputs", 0.0)
            rollout, reward = acc.get("_generate_single_turn", 0.0), acc.get("_calculate_rewards", 0.0)
            records.append({"step": step_s, "rollout": rollout, "reward": reward, "rollout+reward": rollout + reward,
                            "prepare": prep, "update": step_s - prep, "length": sum(lengths) / max(len(lengths), 1)})
            after_step()

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=args, train_dataset=data,
                          processing_class=run.tokenizer, callbacks=[StepTimer()])
    for name in ("_prepare_inputs", "_generate_single_turn"):
        _timed_method(trainer, name, acc)
    _timed_method(trainer, "_calculate_rewards", acc,
                  on_call=lambda inputs, prompts, completions, ids: lengths.extend(len(c) for c in ids))
    return trainer, records, model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())


def _add_options(ap) -> None:
    ap.add_argument("--prompts", type=int, help="prompts per step (default 32; quick 8)")
    ap.add_argument("--n", type=int, help="samples per prompt (default 8; quick 4)")
    ap.add_argument("--max-tokens", type=int, default=8, help="max new tokens (default job: 8)")
    ap.add_argument("--steps", type=int, help=f"steps per side incl. {WARMUP_STEPS} warm-up (default 6; quick 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both sides")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], _add_options)
    prompts = args.prompts or (8 if args.quick else 32)
    n = args.n or (4 if args.quick else 8)
    steps = args.steps or (3 if args.quick else 6)
    if steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps {steps}: need more than the {WARMUP_STEPS} warm-up step(s)")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # deprecation chatter from transformers/trl, not results
    tmp = tempfile.mkdtemp(prefix="hybridrl_bench_step_")
    cfg = bench_config(prompts=prompts, n=n, max_tokens=args.max_tokens, threads=args.threads, output_dir=tmp)
    ours = OursSide(cfg)
    trainer, trl_steps, trl_model = build_trl(cfg, ours.run, steps=steps, output_dir=tmp, after_step=ours.step)
    same = _same_weights(ours.run.policy, trl_model)
    print(f"batch {prompts}x{n}, max_tokens {args.max_tokens}, threads {torch.get_num_threads()}, "
          f"{steps} steps per side ({WARMUP_STEPS} warm-up), same initial weights: {same}", flush=True)
    trainer.train()
    ours.close()
    trl_name = trl_baseline_name(trainer)

    o, b = ours.steps[WARMUP_STEPS:], trl_steps[WARMUP_STEPS:]
    if not o or len(o) != len(b):
        raise SystemExit(f"benchmarks/step.py: measured {len(o)} steps of ours and {len(b)} of TRL; expected "
                         f"{steps - WARMUP_STEPS} each")
    med = {side: {k: median([s[k] for s in recs]) for k in recs[0]} for side, recs in (("ours", o), ("trl", b))}
    case = f"{prompts}x{n} T={args.max_tokens}"
    rows = [row(case=case, metric=f"{k} s", ours=med["ours"][k], baseline=med["trl"][k], baseline_name=trl_name,
                higher_is_better=False) for k in ("step", "rollout+reward", "update")]
    rows.append(row(case=case, metric="best step s", ours=min(s["step"] for s in o),
                    baseline=min(s["step"] for s in b), baseline_name=trl_name, higher_is_better=False))
    report(rows, args.json)
    mo, mt = med["ours"], med["trl"]
    print(f"ours, median s: " + ", ".join(f"{p} {mo[p]:.3f}" for p in OURS_PHASES)
          + f", other {mo['other']:.3f}; mean response length {mo['length']:.2f}")
    print(f"trl,  median s: generate {mt['rollout']:.3f}, reward {mt['reward']:.3f}, "
          f"rest of _prepare_inputs {mt['prepare'] - mt['rollout'] - mt['reward']:.3f}, "
          f"loss+backward+optimizer {mt['update']:.3f}; mean response length {mt['length']:.2f}")
    paired = median([t["step"] / s["step"] for s, t in zip(o, b)])
    print(f"paired per-step speedup (TRL step i / our step i, median; robust to load spikes): {paired:.2f}x")
    print("per step (s), ours: " + " ".join(f"{s['step']:.2f}" for s in ours.steps)
          + " | trl: " + " ".join(f"{s['step']:.2f}" for s in trl_steps))


if __name__ == "__main__":
    main()
