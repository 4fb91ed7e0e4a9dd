"""Build every part of a run from a :class:`Config`: data, models, engine, reward, logs.

``RunParts`` is a plain bag of the objects the loop composes, plus the few small
operations that need several of them (refit, decode, critic update).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl import algos
from hybridrl.config import Config


@dataclass
class PromptSet:
    prompts: list[list[int]] = field(default_factory=list)
    answers: list[Any] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)

    def subset(self, idx: list[int]) -> "PromptSet":
        return PromptSet([self.prompts[i] for i in idx], [self.answers[i] for i in idx],
                         [self.prompt_texts[i] for i in idx])


@dataclass
class RunParts:
    cfg: Config
    run_dir: Path
    tokenizer: Any
    actor: Any
    engine: Any
    reward: Any
    train_set: PromptSet
    eval_set: PromptSet
    log: Any
    loss_spec: Any
    stop_ids: tuple[int, ...]
    pad_id: int
    torch_gen: torch.Generator
    sft_pairs: tuple[list[list[int]], list[list[int]]] | None = None
    ref_model: torch.nn.Module | None = None
    kl_ctrl: Any = None
    critic: torch.nn.Module | None = None
    critic_opt: torch.optim.Optimizer | None = None
    console: Callable[[str], None] = print

    def refit(self):
        from hybridrl.refit import refit_from_model

        t = self.cfg.trainer
        return refit_from_model(self.engine, self.actor.model, bucket_bytes=t.refit_bucket_mb << 20,
                                verify=t.refit_verify)

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)

    def describe_model(self) -> str:
        n = sum(p.numel() for p in self.actor.model.parameters())
        c = self.actor.model.config
        return f"{c.model_type}, {n / 1e6:.2f}M params, {c.num_hidden_layers} layers, hidden {c.hidden_size}"

    @property
    def device(self) -> torch.device:
        return next(self.actor.model.parameters()).device

    def save_checkpoint(self, *, config_yaml: str, step: int) -> Path:
        from hybridrl.trainer.checkpoint import save_checkpoint_atomic

        path = save_checkpoint_atomic(self.actor.model, self.tokenizer, self.run_dir / "checkpoint", step=step,
                                      extra_files={"hybridrl_config.yaml": config_yaml})
        if self.critic is not None:
            self.critic.save_pretrained(self.run_dir / "critic")
        return path

    @torch.no_grad()
    def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Old values ``[B, L]`` (0 outside the response), in token-budget micro-batches."""
        from hybridrl.attention.packing import make_microbatches

        self.critic.eval()
        out = torch.zeros_like(batch["response_mask"])
        lengths = batch["attention_mask"].sum(-1).tolist()
        for rows in make_microbatches(lengths, self.cfg.trainer.max_tokens_per_microbatch):
            width = max(lengths[i] for i in rows)
            v = self.critic.values(batch["input_ids"][rows, :width], batch["attention_mask"][rows, :width])
            out[rows, :width] = v * batch["response_mask"][rows, :width]
        return out

    def update_critic(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of clipped value regression over the batch, accumulated over
        token-budget micro-batches with the whole batch's normalizer."""
        from hybridrl.attention.packing import make_microbatches

        self.critic.train()
        a = self.cfg.algo
        lengths = batch["attention_mask"].sum(-1).tolist()
        micros = make_microbatches(lengths, self.cfg.trainer.max_tokens_per_microbatch)
        info = algos.GlobalBatchInfo.from_masks([batch["response_mask"][m] for m in micros])
        self.critic_opt.zero_grad(set_to_none=True)
        total, clipfrac = 0.0, 0.0
        for rows in micros:
            width = max(lengths[i] for i in rows)
            mb = {k: v[rows, :width] for k, v in batch.items() if v.dim() == 2}
            vpreds = self.critic.values(mb["input_ids"], mb["attention_mask"])
            loss, m = algos.compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                               cliprange_value=a.cliprange_value, loss_agg_mode="token-mean",
                                               global_batch_info=info)
            loss.backward()
            total += float(loss.detach())
            clipfrac += float(m["vf_clipfrac"]) * len(rows) / len(lengths)
        gn = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.optim.grad_clip)
        self.critic_opt.step()
        return {"critic/vf_loss": total, "critic/grad_norm": float(gn), "critic/vf_clipfrac": clipfrac}

    def greedy_baselines(self, prompts: list[list[int]], answers: list[Any], prompt_texts: list[str],
                         index: list[int]) -> torch.Tensor:
        """ReMax baseline: the reward of each prompt's greedy response, per row ``[B]``."""
        from hybridrl.rollout import SamplingParams

        out = self.engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=self.cfg.rollout.max_tokens,
                                                           stop_token_ids=self.stop_ids))
        texts = self.decode(out.response_token_ids)
        s = self.reward.score(texts, answers, prompt_texts).scores
        return torch.tensor([s[i] for i in index], dtype=torch.float32)


def _arithmetic_data(cfg: Config, tokenizer) -> tuple[PromptSet, PromptSet, tuple]:
    from hybridrl.data.arithmetic import arithmetic_splits
    from hybridrl.data.char_tokenizer import encode_prompt

    d = cfg.data
    train, ev = arithmetic_splits(num_digits=d.num_digits, operations=d.operations, train_size=d.train_size,
                                  eval_size=d.eval_size, seed=d.seed)

    def to_set(exs):
        return PromptSet([encode_prompt(tokenizer, e.prompt) for e in exs], [e.answer for e in exs],
                         [e.prompt for e in exs])

    tr = to_set(train)
    sft = (tr.prompts, [tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id] for a in tr.answers])
    return tr, to_set(ev), sft


def _file_data(cfg: Config, tokenizer, console) -> tuple[PromptSet, PromptSet]:
    from hybridrl.data.files import load_prompt_files

    d = cfg.data

    def load(files):
        recs, report = load_prompt_files(files, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                         max_prompt_length=d.max_prompt_length)
        console(f"data {', '.join(files)}: {report.summary()}")
        return PromptSet([r.prompt_ids for r in recs], [r.answer for r in recs],
                         [tokenizer.decode(r.prompt_ids, skip_special_tokens=True) for r in recs])

    train = load(d.train_files)
    if not train.prompts:
        raise ValueError(f"data.train_files {d.train_files}: no usable prompts (see the skip counts above)")
    if d.val_files:
        return train, load(d.val_files)
    rng = random.Random(d.seed)
    order = list(range(len(train.prompts)))
    rng.shuffle(order)
    n_eval = min(d.eval_size, max(1, len(order) // 20))
    ev_idx, tr_idx = order[:n_eval], order[n_eval:] or order

    return train.subset(tr_idx), train.subset(ev_idx)


def build_run(cfg: Config, console: Callable[[str], None] | None = None) -> RunParts:
    from hybridrl.rewards import RewardRunner, get_reward_fn
    from hybridrl.rollout import RolloutEngine
    from hybridrl.trainer.actor import Actor, PolicyLossSpec
    from hybridrl.trainer.metrics_log import MetricsLog
    from hybridrl.trainer.model_factory import DTYPES, builtin_model, builtin_tokenizer, load_pretrained

    if console is None:
        from tqdm.auto import tqdm

        console = tqdm.write  # prints above an active progress bar instead of through it
    t, m = cfg.trainer, cfg.model
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    dtype = DTYPES[m.dtype]
    reward = RewardRunner(get_reward_fn(cfg.reward.function), timeout_s=cfg.reward.timeout_s)
    if m.path:
        model, tokenizer = load_pretrained(m.path, dtype)
    else:
        tokenizer = builtin_tokenizer()
        model = builtin_model(tokenizer, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                              num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                              intermediate_size=m.intermediate_size, tie_word_embeddings=m.tie_word_embeddings,
                              seed=t.seed, dtype=dtype)
    model.to(t.device)
    sft = None
    if cfg.data.train_files:
        train_set, eval_set = _file_data(cfg, tokenizer, console)
    else:
        train_set, eval_set, sft = _arithmetic_data(cfg, tokenizer)
    run_dir = Path(t.output_dir) / t.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    # a reused run name starts clean: old metrics and event files would mix into the new curves
    for stale in ("metrics.jsonl", "curves.png"):
        if (run_dir / stale).exists():
            os.remove(run_dir / stale)
    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    max_prompt = max(len(p) for p in train_set.prompts + eval_set.prompts)
    engine = RolloutEngine(model.config, max_batch_size=min(t.prompts_per_step * cfg.rollout.n, 256),
                           max_seq_len=max_prompt + cfg.rollout.max_tokens, dtype=dtype, device=t.device,
                           quantization=cfg.rollout.quantization, enforce_eager=cfg.rollout.enforce_eager)
    a, o = cfg.algo, cfg.optim
    actor = Actor(model, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
                  grad_clip=o.grad_clip, max_tokens_per_microbatch=t.max_tokens_per_microbatch,
                  shared_prefix=t.shared_prefix)
    spec = PolicyLossSpec(policy_loss=a.policy_loss, loss_agg_mode=a.loss_agg_mode, clip_ratio_low=a.clip_ratio_low,
                          clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c, kl_coef=a.kl_coef,
                          kl_estimator=a.kl_estimator, use_kl_loss=a.use_kl_loss, entropy_coeff=a.entropy_coeff,
                          loss_scale_factor=float(cfg.rollout.max_tokens))
    eos = tokenizer.eos_token_id
    parts = RunParts(cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, actor=actor, engine=engine, reward=reward,
                     train_set=train_set, eval_set=eval_set, log=MetricsLog(run_dir, tensorboard=cfg.logging.tensorboard),
                     loss_spec=spec, stop_ids=(eos,) if eos is not None else (), pad_id=tokenizer.pad_token_id or 0,
                     torch_gen=torch.Generator().manual_seed(t.seed), sft_pairs=sft, console=console)
    parts.refit()  # first load = the refit path
    if a.adv_estimator == "gae":
        from hybridrl.trainer.critic import Critic

        parts.critic = Critic.from_config(model.config, dtype=dtype, seed=t.seed).to(t.device)
        parts.critic_opt = torch.optim.AdamW(parts.critic.parameters(), lr=o.critic_lr, betas=tuple(o.betas))
    return parts


def attach_reference(parts: RunParts) -> None:
    """Freeze a copy of the current policy as the KL reference (after the warm start)."""
    a = parts.cfg.algo
    if a.kl_coef <= 0:
        return
    parts.ref_model = frozen_copy(parts.actor.model)
    if a.adaptive_kl_target is not None:
        parts.kl_ctrl = algos.AdaptiveKLController(kl_coef=a.kl_coef, target_kl=a.adaptive_kl_target,
                                                   horizon=a.kl_horizon)
    else:
        parts.kl_ctrl = algos.FixedKLController(kl_coef=a.kl_coef)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A no-grad, eval-mode deep copy (the KL reference policy)."""
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
