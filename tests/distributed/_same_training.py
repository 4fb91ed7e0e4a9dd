"""Did two runs of one job train the same model (N ranks vs 1 process, a TP=2 engine vs the whole
engine)? Judged by what fp32 arithmetic and AdamW guarantee, not by a tolerance tuned on one
machine. The runs differ only in the order of their fp32 operations (GEMMs over other batch
shapes, the ranks' partial gradients added by the reduce-scatter, all-reduced normalizers, the
TP engine's split sums); u = 2^-24 is fp32's unit roundoff, N the tokens of a step's rows.

1. **Rows** (prompt + sampled tokens, as ``_train_record`` saw them). At step 1 both runs sample
   from bitwise-equal weights (checked); their logits differ by summation order only (~1e-6), so
   a token differs only if its uniform draw falls within ~1e-6 of a boundary of the sampling CDF:
   ~1e-4 for the ~60 tokens sampled here. Different rows at step 1 mean a broken engine or refit
   (or that rare tie: another ``trainer.seed``). From step 2 the weights differ (5.), a near-tie
   may flip, and from that step on the runs trained on different data: only the bound that holds
   for any data (5.i) compares them.
2. **Rewards**, at the steps with the same rows: exactly equal. A reward is a function of its row
   (exact_match: 0 or 1); fp32 sums of 0/1 are exact integers in any order and the means (k/16 in
   one process, the ranks' k_r/8 averaged) divide by powers of two: no rounding at all.
3. **Losses**, at those steps: token-weighted means of per-token terms no larger than
   max(1, |loss|) on average (unit-scale advantages: mean |A| <= rms(A) = 1; entropy, KL and value
   losses: non-negative terms, whose mean is the loss). Two orders of an N-term fp32 sum differ by
   at most 2 gamma_N sum|terms| (gamma_N = N u / (1 - N u), the worst case). From step 2 the
   weights differ too, but by O(lr) only in coordinates whose gradient is at the rounding floor
   (5.), which moves the loss at first order by far less than that.
4. **Gradients**, at the steps whose starting weights are bitwise equal in both runs (step 1; later
   ones while every gradient was exactly zero): only the order of operations differs. Each
   coordinate is a sum over the N tokens, so two orders differ by at most 2 gamma_N sum|terms|.
   The recorded gradients do not give sum|terms|; we take G, the step's largest gradient
   coordinate. That is this file's one assumption rather than a theorem: the largest coordinates
   (head and embedding rows) are sums of same-signed terms, and every other coordinate's terms are
   products of the same upstream gradients and activations, not larger ones. A coordinate whose
   gradient cancels (a softmax's shift direction, a Sinkhorn-normalized hyper-connection weight)
   gets that same absolute tolerance: its *relative* error may be large, and that is legitimate.
   Compared before clipping (each run's own coefficient undone: a few u), so
   |g_b - g_a| <= 2 gamma_N G + 8u |g_a| (N ~ 115 here: ~230u G; measured: <= 10u G); and the
   norms that set the clipping: |n_b - n_a| <= |g_b - g_a| + (gamma_P + u)(n_a + n_b) over the P
   coordinates. This is the check a broken reduction fails: a dropped, halved or doubled
   all-reduce, a wrong slice, normalizer or clipping norm. (Not the final weights: AdamW is
   nearly invariant to a gradient's scale, so a halved reduction moves them almost alike.)
5. **Final weights** (the exported checkpoints). AdamW moves a coordinate by lr_t r_t,
   r_t = m_t / (sqrt(v_t) + eps) (bias-corrected moments).
   (i)  For *any* gradients |r_t| <= B_t (Cauchy-Schwarz of m against v:
        B_t = (1-b1)/(1-b1^t) sqrt((1-b2^t)/(1-b2)) sqrt(sum_{k<t} (b1^2/b2)^k), 1.0 at t = 1 and
        1.003 at t = 3 for betas (0.9, 0.99)), so |w_a - w_b| <= sum_t 2 lr_t B_t always. That is
        all there is for a coordinate in Adam's epsilon regime: a gradient at the rounding floor
        (4.) is normalized by its own RMS into a step of about lr in a direction the rounding chose
        (what a fixed rtol=1e-4 on weights tripped over: DeepSeek-V4's ``hc_attn_fn`` on a Zen 5).
   (ii) Tighter where the gradient is large: with d_s = |g_a,s - g_b,s| (measured; both runs'
        gradients are recorded), |dm_t| <= M_t = (1-b1)/(1-b1^t) sum_s b1^(t-s) d_s and
        |d sqrt(v_t)| <= V_t = sqrt((1-b2)/(1-b2^t) sum_s b2^(t-s) d_s^2) (Minkowski), hence
        |r_a,t - r_b,t| <= (M_t + B_t V_t) / (max(sqrt(v_a,t) - V_t, 0) + eps): ~d/|g| for a large
        gradient. Weight decay only contracts the difference. Each run's fp32 writes add at most
        2u|w| per step (the decay multiply, the update add) and its arithmetic for r (8 + 4t)u of
        lr B_t (``adam_rounding``: a float64 replay of the recorded steps lands within half of it).
   With measured d this is a theorem, not a tolerance: it checks that each run applied AdamW (lr
   schedule, betas, per-parameter step counts, moments) to the gradients it computed and that its
   checkpoint holds the result (FSDP2 gather, HF layout conversion). Gradients after the weights
   differ are not themselves compared: they are evaluated at different points, which rounding
   theory does not bound.

``check_catches_broken_runs`` shows, on corrupted copies of the second run (no extra run), that
4. fails on a halved gradient reduction and 5. on a shard that missed the last update.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

U = 2.0 ** -24  # fp32 unit roundoff: |fl(x) - x| <= U |x|


def adam_rounding(t: int) -> float:
    """Relative rounding of AdamW's t-th direction r in fp32: the two moments gather about 2u a
    step each (a multiply and an add), then bias corrections, sqrt, eps, division and lr: ~6u."""
    return (8 + 4 * t) * U


def gamma(n: int) -> float:
    """The worst-case relative error of an n-term fp32 sum, relative to the sum of |terms|."""
    return n * U / (1 - n * U)


def adam_step_bound(t: int, betas: tuple[float, float]) -> float:
    """B_t >= |m_t| / sqrt(v_t) for any gradients: AdamW's t-th step is at most lr B_t per coordinate."""
    b1, b2 = betas
    return ((1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2))
            * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t))))


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's metrics, ``_train_record`` record (rows merged over ranks) and checkpoint."""

    directory: Path
    metrics: list[dict]  # the RL steps' rows of metrics.jsonl, in order (one per update)
    steps: list[dict]  # per optimizer step: update, lr, grads, weights (after the step)
    rows: list[list[tuple]]  # per update: every rank's rows, sorted
    weights_before: dict[str, torch.Tensor]
    adam: tuple  # betas, eps, weight_decay
    grad_clip: float

    @classmethod
    def load(cls, directory: Path, record: Path) -> Run:
        ranks = [torch.load(p, weights_only=False) for p in sorted(record.glob("rank*.pt"))]
        assert ranks, f"{record}: no recorded rank (did the run install _train_record?)"
        rows = [sorted(r for rank in ranks for r in rank["rows"][k]) for k in range(len(ranks[0]["rows"]))]
        lines = (directory / "metrics.jsonl").read_text().splitlines()
        r0 = ranks[0]
        return cls(directory, [m for m in map(json.loads, lines) if "reward/mean" in m], r0["steps"], rows,
                   r0["weights_before"], (r0["betas"], r0["eps"], r0["weight_decay"]), r0["grad_clip"])

    def weights_at(self, k: int) -> dict[str, torch.Tensor]:
        """The weights optimizer step ``k`` started from."""
        return self.weights_before if k == 0 else self.steps[k - 1]["weights"]

    def tokens(self, update: int) -> int:
        return sum(len(r) for r in self.rows[update])

    def checkpoint(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        ckpt = self.directory / "checkpoint"
        adapter = ckpt / "adapter_model.safetensors"  # a LoRA run's checkpoint: the adapters
        return load_file(str(adapter if adapter.exists() else ckpt / "model.safetensors"))

    def checkpoint_layout(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Parameter-named tensors (weights, bounds) in the checkpoint's names and layout: the
        conversion the export applies (it only renames, splits and transposes)."""
        ckpt = self.directory / "checkpoint"
        if (ckpt / "adapter_model.safetensors").exists():  # peft's names: no adapter name, under base_model.model
            return {"base_model.model." + n.replace(".default.", "."): t for n, t in tensors.items()}
        import transformers
        from transformers.core_model_loading import revert_weight_conversion

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(ckpt))
        return revert_weight_conversion(model, dict(tensors))


def same_rows(a: Run, b: Run) -> list[bool]:
    """Per update: both runs have trained on the same rows at it and at every update before (1.)."""
    assert len(a.rows) == len(b.rows) and a.rows, (len(a.rows), len(b.rows))
    assert a.rows[0] == b.rows[0], (
        "step 1: the runs sampled different tokens from bitwise-equal weights: a broken engine or refit "
        "(a near-tie flipped by summation order is a ~1e-4 chance: then try another trainer.seed)")
    same = [True]
    for ra, rb in zip(a.rows[1:], b.rows[1:]):
        same.append(same[-1] and ra == rb)
    return same


def compare_metrics(a: Run, b: Run, same: list[bool], losses: tuple[str, ...]) -> int:
    """Rewards exactly (2.) and losses within 2 gamma_N max(1, |loss|) (3.) at the updates with the same
    rows; the step numbers and weight versions always. Returns how many losses were compared."""
    assert [m["step"] for m in a.metrics] == [m["step"] for m in b.metrics]
    assert len(a.metrics) == len(same), (len(a.metrics), len(same))
    compared = 0
    for k, (ma, mb) in enumerate(zip(a.metrics, b.metrics)):
        assert ma.get("rollout/weight_version") == mb.get("rollout/weight_version"), ma["step"]
        if not same[k]:
            continue
        assert ma["reward/mean"] == mb["reward/mean"], (ma["step"], ma["reward/mean"], mb["reward/mean"])
        tol = 2 * gamma(a.tokens(k))
        for key in losses:
            if key in ma:
                assert abs(mb[key] - ma[key]) <= tol * max(1.0, abs(ma[key])), (ma["step"], key, ma[key], mb[key])
                compared += 1
    return compared


def _largest(grads: dict[str, torch.Tensor | None]) -> float:
    return max((float(g.abs().max()) for g in grads.values() if g is not None and g.numel()), default=0.0)


def unclipped(run: Run, k: int) -> tuple[dict[str, torch.Tensor | None], float]:
    """Optimizer step ``k``'s gradient before ``clip_grad_norm_`` scaled it (float64), and its norm:
    the run's own coefficient ``min(1, clip / (norm + 1e-6))`` (torch's formula) undone, from the norm
    it logged. Recomputing that fp32 coefficient and dividing by it costs a few u."""
    step = run.steps[k]
    assert sum(s["update"] == step["update"] for s in run.steps) == 1, (
        "one optimizer step per update: the logged actor/grad_norm is then this step's")
    norm = run.metrics[step["update"]]["actor/grad_norm"]
    coef = min(1.0, run.grad_clip / (norm + 1e-6))
    return {n: None if g is None else g.double() / coef for n, g in step["grads"].items()}, norm


def check_gradients(a: Run, b: Run, same: list[bool]) -> list[int]:
    """The gradients of every optimizer step that both runs started from bitwise-equal weights, on
    the same rows (4.), and their norms; returns the steps compared whose gradient was not all zero."""
    assert a.weights_at(0).keys() == b.weights_at(0).keys()
    unequal = [n for n, w in a.weights_at(0).items() if not torch.equal(w, b.weights_at(0)[n])]
    assert not unequal, f"the runs' weights differ before their first optimizer step (the warm start): {unequal[:3]}"
    assert a.grad_clip == b.grad_clip
    nonzero = []
    for k, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        start_a, start_b = a.weights_at(k), b.weights_at(k)
        if not same[sa["update"]] or not all(torch.equal(w, start_b[n]) for n, w in start_a.items()):
            break  # from here on the gradients are taken at different weights
        (ga_all, norm_a), (gb_all, norm_b) = unclipped(a, k), unclipped(b, k)
        floor = 2 * gamma(a.tokens(sa["update"])) * _largest(ga_all)
        squares = 0.0  # |g_b - g_a|^2 over every coordinate: bounds how far the norms may differ
        for name, ga in ga_all.items():
            gb = gb_all[name]
            assert (ga is None) == (gb is None), f"step {k + 1}: {name} has a gradient in one run only"
            if ga is None:
                continue
            _assert_within(ga, gb, floor + 8 * U * ga.abs(),
                           f"optimizer step {k + 1}: the gradient of {name} differs beyond summation order", ".6g",
                           lambda i: f"allowed {floor:.3g} + 8u|g|")
            squares += float(((gb - ga) ** 2).sum())
        # |norm_b - norm_a| <= |g_b - g_a| exactly; each fp32 norm of P squares is off by at most gamma_P
        params = sum(g.numel() for g in ga_all.values() if g is not None)
        assert abs(norm_b - norm_a) <= squares ** 0.5 + (gamma(params) + U) * (norm_a + norm_b), (
            f"optimizer step {k + 1}: gradient norms {norm_a} vs {norm_b} (the clipping's)")
        if _largest(ga_all) > 0:
            nonzero.append(k)
    return nonzero


def weight_bound(a: Run, b: Run, same: list[bool]) -> dict[str, torch.Tensor]:
    """Per parameter and coordinate, the most the runs' final weights can differ (5.)."""
    assert a.adam == b.adam, (a.adam, b.adam)
    assert [s["lr"] for s in a.steps] == [s["lr"] for s in b.steps], "the runs' learning-rate schedules differ"
    (b1, b2), eps, wd = a.adam
    assert 0 <= max(s["lr"] for s in a.steps) * wd <= 1  # decay contracts the difference
    bounds = {}
    for name in a.weights_before:
        t_a = t_b = 0  # AdamW's per-parameter step counts (a step without a gradient skips it)
        bound = torch.zeros_like(a.weights_before[name])
        m = v = dm = dv2 = None
        diverged = False
        for sa, sb in zip(a.steps, b.steps):
            ga, gb, lr = sa["grads"][name], sb["grads"][name], sa["lr"]
            t_a, t_b = t_a + (ga is not None), t_b + (gb is not None)
            diverged = diverged or not same[sa["update"]] or (ga is None) != (gb is None) or t_a != t_b
            if ga is None and gb is None:
                continue
            steps = [t for t, g in ((t_a, ga), (t_b, gb)) if g is not None]
            universal = sum(lr * adam_step_bound(t, a.adam[0]) for t in steps)  # (i): each run's step
            w = sa["weights"][name].abs() + sb["weights"][name].abs()
            rounding = 2 * U * w + sum(lr * adam_step_bound(t, a.adam[0]) * adam_rounding(t) for t in steps)
            if diverged:
                bound += universal + rounding
                continue
            t, d = t_a, (ga - gb).abs()
            if m is None:
                m, v, dm, dv2 = (torch.zeros_like(ga) for _ in range(4))
            m, v = b1 * m + (1 - b1) * ga, b2 * v + (1 - b2) * ga * ga
            dm, dv2 = b1 * dm + (1 - b1) * d, b2 * dv2 + (1 - b2) * d * d
            big_m, big_v = dm / (1 - b1 ** t), (dv2 / (1 - b2 ** t)).sqrt()
            s_a = (v / (1 - b2 ** t)).sqrt()
            step_bound = adam_step_bound(t, a.adam[0])
            dr = (big_m + step_bound * big_v) / ((s_a - big_v).clamp(min=0) + eps)  # (ii)
            bound += lr * dr.clamp(max=2 * step_bound) + rounding
        bounds[name] = bound
    return bounds


def check_checkpoints(ck_a: dict[str, torch.Tensor], ck_b: dict[str, torch.Tensor],
                      bound: dict[str, torch.Tensor]) -> None:
    """Every trained checkpoint tensor within its bound (5.); the rest (buffers) equal."""
    assert ck_a.keys() == ck_b.keys(), sorted(ck_a.keys() ^ ck_b.keys())[:5]
    for key, wa in ck_a.items():
        wb = ck_b[key]
        if key not in bound:
            assert torch.equal(wa, wb), f"{key} (not trained) differs"
            continue
        _assert_within(wa, wb, bound[key], f"final weights: {key} differs beyond AdamW's bound", ".8g",
                       lambda i, b=bound[key]: f"bound {float(b.flatten()[i]):.3g}")


def check_catches_broken_runs(a: Run, b: Run, same: list[bool], nonzero: list[int],
                              bound_ck: dict[str, torch.Tensor]) -> None:
    """The checks fail on what they exist for, shown on corrupted copies of run ``b``: a gradient
    reduction that halves (averages over the 2 ranks a loss already normalized by the global
    token count) fails 4.; a shard that missed the last update (its half of dim 0) fails 5."""
    k = nonzero[0]
    halved = [dict(s, grads={n: None if g is None else g / 2 for n, g in s["grads"].items()}) if i == k else s
              for i, s in enumerate(b.steps)]
    with pytest.raises(AssertionError, match="differs beyond summation order"):
        check_gradients(a, dataclasses.replace(b, steps=halved), same)

    final, before_last = b.checkpoint(), b.checkpoint_layout(b.weights_at(len(b.steps) - 1))

    def second_half(t: torch.Tensor) -> torch.Tensor:  # rank 1's FSDP2 shard (dim 0)
        return t[t.shape[0] // 2:] if t.dim() and t.shape[0] > 1 else t

    moved = {key: float(((second_half(final[key]) - second_half(before_last[key])).abs()
                         - second_half(bound_ck[key])).max()) for key in bound_ck}
    key = max(moved, key=moved.get)
    assert moved[key] > 0, "the last update moved no weight beyond the bound: the check would see no stale shard"
    stale = dict(final)
    stale[key] = final[key].clone()
    second_half(stale[key]).copy_(second_half(before_last[key]))
    with pytest.raises(AssertionError, match="differs beyond AdamW's bound"):
        check_checkpoints(a.checkpoint(), stale, bound_ck)


def assert_same_training(out: Path, one: str, two: str, *, losses: tuple[str, ...]) -> None:
    """Runs ``out/one`` and ``out/two`` (recorded into ``out/<name>.record``) trained the same model,
    as far as fp32 and AdamW guarantee (the module's docstring): rows, rewards, losses, gradients,
    weights; then that these checks catch a broken reduction."""
    a, b = (Run.load(out / name, out / f"{name}.record") for name in (one, two))
    same = same_rows(a, b)
    nonzero = check_gradients(a, b, same)  # first: a broken reduction shows here before anywhere else
    assert nonzero, ("no optimizer step had a non-zero gradient while the runs' weights were equal: "
                     "nothing was compared (give the job a gradient, e.g. an entropy bonus)")
    assert compare_metrics(a, b, same, losses) >= 2  # at least step 1's policy loss and entropy
    bound_ck = a.checkpoint_layout(weight_bound(a, b, same))
    check_checkpoints(a.checkpoint(), b.checkpoint(), bound_ck)
    check_catches_broken_runs(a, b, same, nonzero, bound_ck)


def _assert_within(a: torch.Tensor, b: torch.Tensor, allowed: torch.Tensor, what: str, fmt: str, why) -> None:
    """|b - a| <= allowed everywhere, else one AssertionError naming the count and the worst coordinate."""
    excess = (b - a).abs() - allowed
    if excess.max() > 0:
        i = int(excess.argmax())
        raise AssertionError(f"{what} at {int((excess > 0).sum())}/{a.numel()} coordinates; worst [{i}]: "
                             f"{float(a.flatten()[i]):{fmt}} vs {float(b.flatten()[i]):{fmt}}, {why(i)}")
