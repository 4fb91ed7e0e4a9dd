"""``hybridrl doctor mismatch``: measure the rollout/trainer log-prob gap of a job and how
much of it each cause explains.

One batch is sampled by the job's engine exactly as a training step samples it; the
trainer scores the same tokens as a step does (``old_log_prob``). That gap is the total.
Then each cause is switched off *alone*, every other setting left as the job has it, and
the tokens are scored again (teacher-forced through an engine built with that one change):

=====================  ==============================================================
cause                  switched off by
=====================  ==============================================================
decode path            the job engine scoring the tokens in one prefill (no KV-cache
                       decode, the batch's shapes) instead of decoding them
quantization           an engine with ``rollout.quantization=null``
temperature            the engine scoring at the trainer's temperature
MoE routing            the trainer replaying the engine's experts
kernels (residual)     everything above off: what is left between the two codebases
=====================  ==============================================================

A cause's effect is the total KL minus the KL with it off; the effects plus the residual
are compared with the total (they add up when the causes are independent: the k3 KL is
~ r^2 / 2). Shown too, outside the sum: the batch's own composition (each request scored
alone vs in the batch), sampling truncation (top-p / top-k: KL of the truncated sampling
distribution to the full one, which both sides report), and what ``rollout.exact`` gives
(its engine sampling the same prompts, scored the same way: measured, and its rollout time).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass, field

import torch

from hybridrl.config import Config
from hybridrl.algos.gap import ENTROPY_EDGES, POSITION_EDGES, gap_by, response_positions, token_gap


@dataclass
class Cause:
    name: str
    setting: str
    """what the job runs with, e.g. ``rollout.quantization=fp8``."""
    effect_kl: float | None
    """total KL minus the KL with this cause off; None: not available (``note`` says why)."""
    kl_without: float | None = None
    note: str = ""
    additive: bool = True
    """part of the decomposition (effects + residual ~ total); False: shown alongside."""


@dataclass
class Diagnosis:
    total: dict
    by_position: list[dict]
    by_entropy: list[dict]
    causes: list[Cause]
    recommendations: list[str]
    job: dict
    scatter: dict = field(default_factory=dict)
    """``{"entropy": [...], "abs_diff": [...]}`` per response token (the plot's points)."""

    @property
    def explained_kl(self) -> float:
        return sum(c.effect_kl for c in self.causes if c.additive and c.effect_kl is not None)

    def to_json(self) -> dict:
        return {"total": self.total, "explained_kl": self.explained_kl,
                "explained_fraction": self.explained_kl / self.total["kl"] if self.total["kl"] else None,
                "by_position": self.by_position, "by_entropy": self.by_entropy,
                "causes": [dataclasses.asdict(c) for c in self.causes], "recommendations": self.recommendations,
                "job": self.job}


def _teacher_forced(engine, ro, temperature: float, rows=None) -> torch.Tensor:
    """Log-probs ``[B, L]`` of the rollouts' response tokens under ``engine`` scoring them in
    one prefill (``engine.logits``) at ``temperature`` (0 = greedy: scored at 1)."""
    ids, mask, resp = ro.input_ids, ro.attention_mask, ro.response_mask
    chunk = list(range(ids.shape[0]) if rows is None else rows)
    out = torch.zeros(ids.shape, dtype=torch.float32)
    t = temperature if temperature > 0 else 1.0
    step = _rows_per_call(engine, ids.shape[1])
    for s in range(0, len(chunk), step):
        sel = torch.tensor(chunk[s:s + step])
        L = int(mask[sel].sum(-1).max())
        with torch.inference_mode():
            z = engine.logits(ids[sel, :L], mask[sel, :L]).float().cpu()
        logp = torch.log_softmax(z / t if t != 1.0 else z, dim=-1)
        lp = torch.zeros(len(sel), L)
        lp[:, 1:] = logp[:, :-1].gather(-1, ids[sel, 1:L, None].cpu()).squeeze(-1)
        out[sel, :L] = lp * resp[sel, :L].cpu()
    return out


LOGITS_BUDGET_BYTES = 512 << 20


def _rows_per_call(engine, length: int) -> int:
    """Rows per ``engine.logits`` call: the engine's batch, and ``[rows, L, V]`` float32
    logits within ``LOGITS_BUDGET_BYTES`` (a 151936-token vocabulary: a few rows)."""
    vocab = engine.config.vocab_size if hasattr(engine, "config") else 1
    return max(1, min(engine.max_batch_size, LOGITS_BUDGET_BYTES // max(1, length * vocab * 4)))


def _alone(engine, ro, temperature: float) -> torch.Tensor:
    out = torch.zeros(ro.input_ids.shape, dtype=torch.float32)
    for b in range(ro.input_ids.shape[0]):
        out[b] = _teacher_forced(engine, ro, temperature, rows=[b])[b]
    return out


def _truncation_kl(engine, ro, temperature: float, top_k: int, top_p: float) -> float:
    """mean over sampled tokens of -log(mass the top-k / top-p filter keeps): KL(q_trunc || pi)."""
    from hybridrl.rollout.layers.sampler import _truncate

    ids, mask, resp = ro.input_ids, ro.attention_mask, ro.response_mask
    L = int(mask.sum(-1).max())
    step, kept_all = _rows_per_call(engine, L), []
    for s in range(0, ids.shape[0], step):
        with torch.inference_mode():
            z = engine.logits(ids[s:s + step, :L], mask[s:s + step, :L]).float().cpu()
        probs = torch.softmax(z / temperature if temperature not in (0, 1) else z, dim=-1)[:, :-1]
        sorted_probs, _ = probs.sort(dim=-1, descending=True)
        V = probs.shape[-1]
        k = torch.full(probs.shape[:-1] + (1,), top_k if top_k > 0 else V)
        kept_all.append(_truncate(sorted_probs, k, torch.full_like(k, top_p, dtype=torch.float32)).sum(-1))
    kept = torch.cat(kept_all)
    m = resp[:, 1:L].bool().cpu()
    return float(-(kept[m].clamp(min=1e-30).log()).mean()) if m.any() else 0.0


def _staleness(cfg: Config, step, ro, old: torch.Tensor, mask: torch.Tensor, seed: int, trainer) -> Cause:
    """What a batch ``s = pipeline.max_staleness`` versions old adds (one_step_off: s = 1):
    ``s`` steps of the job (its own batch source) move the trainer on, then it scores this batch's tokens
    again; the KL between the two trainer scorings is the policy's drift over ``s`` updates
    on these tokens. Shown alongside (not part of the sum). Runs last: it trains the doctor's
    scratch copy of the job."""
    settings = step.source.s  # the job's own batch source: how stale its batches may be
    mode = "async" if settings.partial else "one_step_off"
    if not settings.overlapped:
        return Cause("staleness", "trainer.mode=sync", None, note="a synchronous batch is on-policy", additive=False)
    s = settings.max_staleness
    if s == 0:
        return Cause("staleness", f"{mode}, max_staleness=0", 0.0, additive=False,
                     note="every batch is sampled by the weights it trains")
    try:  # s steps of the job itself (its batch source started here), then the trainer again
        step.start(random.Random(seed + 1), first_step=1)
        for _ in range(s):
            step()
        later, _ = trainer()
    except Exception as e:  # noqa: BLE001 - the rest of the diagnosis stands; this one cause says why
        return Cause("staleness", f"{mode}, max_staleness={s}", None, additive=False,
                     note=f"not measured: {s} steps of the job failed ({type(e).__name__}: {e})".splitlines()[0])
    return Cause("staleness", f"{mode}, max_staleness={s}", token_gap(old, later, mask)["kl"],
                 additive=False, note=f"KL of the trainer {s} update(s) later vs now on these tokens (measured: "
                                      f"{s} steps of this job); algo.correction.tis_cap corrects it")


def diagnose(cfg: Config, step, *, seed: int = 0, engine_temperature: float | None = None) -> Diagnosis:
    """Measure the gap of one batch of ``step``'s job (an ``RLStep`` after its warm start).
    ``engine_temperature``: sample and score the engine at this temperature instead of
    ``rollout.temperature`` (an injected mismatch: the trainer still scores at the job's)."""
    from hybridrl.pipeline.engines import build_engine
    from hybridrl.refit import refit_from_model
    from hybridrl.trainer.logprobs import logprobs_in_microbatches

    r, model, worker, actor = cfg.rollout, step.actor.model, step.rollout, step.actor
    t_trainer = actor.temperature
    t_engine = r.temperature if engine_temperature is None else engine_temperature
    batch_idx, seeds = step._draw(random.Random(seed))
    prompts = [step.train_set.prompts[i] for i in batch_idx]
    sampling = dataclasses.replace(worker.sampling, temperature=t_engine)
    params = [dataclasses.replace(sampling, seed=s) for s in seeds]
    worker.engine.generate(prompts[:1], params[:1])  # warm-up: a first call pays the engine's start (vLLM)
    t0 = time.perf_counter()
    ro = worker.engine.generate(prompts, params)
    job_seconds = time.perf_counter() - t0
    mask = ro.response_mask.bool()
    if not mask.any():
        raise ValueError("doctor mismatch: the batch has no response tokens (rollout.max_tokens=0?); nothing to measure")
    if ro.logprobs[mask].abs().sum() == 0:
        raise ValueError(f"doctor mismatch: the rollout.backend={r.backend} engine returned no log-probs; the gap "
                         "cannot be measured with it")
    moe = ro.routed_experts is not None
    replay = ro.routed_experts if r.routing_replay else None

    def trainer(routed=replay):
        return logprobs_in_microbatches(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                        temperature=t_trainer, max_tokens=actor.max_tokens, with_entropy=True,
                                        routed_experts=routed)

    old, entropy = trainer()
    total = token_gap(old, ro.logprobs, mask)
    causes: list[Cause] = []
    builtin = r.backend == "builtin" and not r.exact
    job = {"backend": r.backend, "quantization": r.quantization, "dtype": cfg.model.dtype,
           "temperature": {"engine": t_engine, "trainer": t_trainer}, "top_p": r.top_p, "top_k": r.top_k,
           "routing_replay": r.routing_replay, "trainer_mode": cfg.trainer.mode, "exact": r.exact,
           "responses": int(ro.input_ids.shape[0]), "tokens": total["tokens"]}
    gap = lambda lp, ref=old: token_gap(ref, lp, mask)["kl"]  # noqa: E731
    kl = total["kl"]
    if builtin:
        engine = worker.engine
        job_tf = _teacher_forced(engine, ro, t_engine)
        kl_tf = gap(job_tf)
        causes.append(Cause("decode path", "KV-cache decode, the batch's shapes", kl - kl_tf, kl_tf))
        if r.quantization:
            plain_cfg = copy.deepcopy(cfg)
            plain_cfg.rollout.quantization = None
            plain = build_engine(plain_cfg, model.config, device=worker.device, ranks=1,
                                 longest_prompt=max(map(len, prompts)))
            refit_from_model(plain, model)
            plain_tf = _teacher_forced(plain, ro, t_engine)
            causes.append(Cause("quantization", f"rollout.quantization={r.quantization}", kl_tf - gap(plain_tf),
                                gap(plain_tf)))
        else:
            plain = engine
            causes.append(Cause("quantization", "rollout.quantization=null", 0.0, kl_tf,
                                note="full-precision rollout weights: nothing to switch off"))
        causes.append(Cause("rollout dtype", f"engine and trainer both {cfg.model.dtype}", 0.0, kl_tf,
                            note="the engine runs the trainer's dtype"))
        if t_engine != t_trainer:
            at_trainer = _teacher_forced(engine, ro, t_trainer)
            causes.append(Cause("temperature", f"engine {t_engine} vs trainer {t_trainer}", kl_tf - gap(at_trainer),
                                gap(at_trainer)))
        else:
            causes.append(Cause("temperature", f"{t_engine} on both sides", 0.0, kl_tf, note="equal"))
        if moe:
            other, _ = trainer(None if r.routing_replay else ro.routed_experts)
            with_replay = old if r.routing_replay else other
            effect = 0.0 if r.routing_replay else kl_tf - gap(job_tf, other)
            note = (f"replay on; off it would add {gap(job_tf, other) - kl_tf:.3g}" if r.routing_replay
                    else "the trainer recomputes the routing")
            causes.append(Cause("MoE routing", f"rollout.routing_replay={str(r.routing_replay).lower()}", effect,
                                kl_tf - effect, note=note))
        else:
            with_replay = old
            causes.append(Cause("MoE routing", "dense model", None, note="not an MoE model", additive=False))
        residual_tf = _teacher_forced(plain, ro, t_trainer)
        causes.append(Cause("kernels (residual)", "engine vs trainer at equal settings", gap(residual_tf, with_replay),
                            note="fused projections, SDPA vs the trainer's attention, reduction orders"))
        alone = _alone(engine, ro, t_engine)
        causes.append(Cause("batch composition", "each request alone vs in the batch", token_gap(job_tf, alone, mask)["kl"],
                            note="KL between the two engine scorings (not part of the sum)", additive=False))
        if r.top_p < 1 or r.top_k > 0:
            causes.append(Cause("sampling truncation", f"top_p={r.top_p} top_k={r.top_k}",
                                _truncation_kl(engine, ro, t_engine, r.top_k, r.top_p),
                                note="KL(truncated || full) of the sampling distribution; both sides report the "
                                     "full one's log-probs", additive=False))
        else:
            causes.append(Cause("sampling truncation", "top_p=1 top_k=-1", 0.0, note="no truncation", additive=False))
    else:
        why = ("rollout.exact: engine and trainer run the same computation" if r.exact else
               "the vLLM backend gives sampled log-probs only (no teacher-forced scoring through it here)")
        for name in ("decode path", "quantization", "temperature", "MoE routing", "kernels (residual)"):
            causes.append(Cause(name, "", None, note=f"not available: {why}", additive=False))
    exact = _exact_gap(cfg, step, prompts, params, job_seconds) if total["kl"] else None  # before _staleness trains
    causes.append(_staleness(cfg, step, ro, old, mask, seed, trainer))
    recs = _recommend(cfg, total, causes, exact, old, ro.logprobs, mask)
    diffs = (old - ro.logprobs).abs()[mask]
    return Diagnosis(total=total, by_position=gap_by(old, ro.logprobs, mask, response_positions(ro.response_mask),
                                                     POSITION_EDGES),
                     by_entropy=gap_by(old, ro.logprobs, mask, entropy, ENTROPY_EDGES), causes=causes,
                     recommendations=recs, job=job,
                     scatter={"entropy": entropy[mask].tolist(), "abs_diff": diffs.tolist()})


def _recommend(cfg: Config, total, causes, exact: str | None, old, rollout_lp, mask) -> list[str]:
    """Settings for this job with their measured effect (each from this run's numbers)."""
    r, recs = cfg.rollout, []
    by = {c.name: c for c in causes}
    kl = total["kl"]
    if kl == 0:
        return [f"the gap is 0 ({total['tokens']} tokens bitwise equal): nothing to correct"]
    q = by.get("quantization")
    if q is not None and r.quantization and q.effect_kl:
        share = q.effect_kl / kl
        recs.append(f"rollout.quantization=null: token KL {kl:.3g} -> {q.kl_without:.3g} ({share:.0%} of the gap "
                    "is the quantized weights); or keep it and set algo.correction.tis_cap=2.0")
    t = by.get("temperature")
    if t is not None and t.effect_kl:
        recs.append(f"sample at the trainer's temperature ({t.setting}): token KL -> {t.kl_without:.3g} "
                    f"({t.effect_kl / kl:.0%} of the gap)")
    m = by.get("MoE routing")
    if m is not None and m.effect_kl and not r.routing_replay:
        recs.append(f"rollout.routing_replay=true: token KL -> {m.kl_without:.3g} ({m.effect_kl / kl:.0%} of the gap)")
    st = by.get("staleness")
    if st is not None and st.effect_kl and st.effect_kl > kl:
        recs.append(f"staleness outweighs the engine mismatch here ({st.setting}: KL {st.effect_kl:.3g} vs "
                    f"{kl:.3g}): lower pipeline.max_staleness, or correct it with algo.correction.tis_cap")
    if exact is not None:
        recs.append(exact)
    if cfg.algo.correction.tis_cap is None:
        ratio = (old - rollout_lp)[mask].clamp(-20, 20).exp()
        recs.append(f"or correct the gap: algo.correction.tis_cap=2.0 reweights every token by its measured ratio "
                    f"(here mean {float(ratio.mean()):.4f}, {float((ratio > 2).double().mean()):.2%} of tokens capped)")
    return recs


def _exact_gap(cfg: Config, step, prompts, params, job_seconds: float) -> str | None:
    """rollout.exact on this job, measured: its engine samples the same prompts; the trainer
    scores them under the same numerics; the gap and the rollout time."""
    r = cfg.rollout
    if r.exact:
        return None
    from hybridrl.pipeline.engines import check_engine_choice

    try:
        probe = copy.deepcopy(cfg)
        probe.rollout.exact, probe.rollout.backend, probe.rollout.quantization = True, "builtin", None
        probe.rollout.tensor_parallel_size = 1
        check_engine_choice(probe)
    except ValueError as e:
        return f"rollout.exact is not available here: {e}"
    from hybridrl.exact import batch_invariant
    from hybridrl.pipeline.engines import build_engine
    from hybridrl.refit import refit_from_model
    from hybridrl.trainer.logprobs import logprobs_in_microbatches

    model = step.actor.model
    # the engine rollout.exact=true would build (the built-in engine's exact layers), holding
    # the policy's weights
    exact = build_engine(probe, model.config, device=next(model.parameters()).device, ranks=1,
                         longest_prompt=max(map(len, prompts)))
    refit_from_model(exact, model)
    exact.generate(prompts[:1], params[:1])  # warm-up, as the job engine's
    t0 = time.perf_counter()
    ro = exact.generate(prompts, params)
    seconds = time.perf_counter() - t0
    with batch_invariant():
        old, _ = logprobs_in_microbatches(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                          temperature=step.actor.temperature, max_tokens=step.actor.max_tokens)
    g = token_gap(old, ro.logprobs, ro.response_mask)
    differ = int((old[ro.response_mask.bool()] != ro.logprobs[ro.response_mask.bool()]).sum())
    switch = "rollout.exact=true" + ("" if r.backend == "builtin" else " rollout.backend=builtin") + (
        " rollout.quantization=null" if r.quantization else "")
    ratio = seconds / max(job_seconds, 1e-9)
    return (f"{switch}: token KL {g['kl']:.3g}, {differ} of {g['tokens']} tokens differ (measured on this "
            f"batch; the old-log-prob pass is skipped); its rollout took {ratio:.2g}x the job engine's")
