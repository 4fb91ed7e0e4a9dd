"""Batched sampling with log-probs, no host syncs, noise independent of the batch.

Randomness: each row draws one uniform per step, `u[b, step]`, precomputed from the
row's own seed (`torch.Generator(seed)`), and samples by inverting the CDF of its
(truncated) distribution. A row's sample therefore depends only on (seed, step, its
logits), never on which other requests share the batch.

Log-probs follow docs/interfaces.md: log_softmax(logits / T) over the full vocabulary,
*before* top-k / top-p truncation; greedy rows (T = 0) report log_softmax(logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.exact.ops import exact_log_softmax, pieced_unary


@dataclass
class SamplingTensors:
    """Per-row settings for one batch, on the engine device."""

    temperature: torch.Tensor
    """[B, 1] float32; 0 = greedy."""
    top_k: torch.Tensor
    """[B, 1] long; vocab_size when off."""
    top_p: torch.Tensor
    """[B, 1] float32."""
    uniforms: torch.Tensor
    """[B, steps] float64 in [0, 1)."""
    all_greedy: bool
    use_top_k_top_p: bool
    any_greedy: bool = True
    all_unit_temperature: bool = False
    """every row samples at temperature 1: logits / T is skipped (dividing by 1 is exact)."""
    exact: bool = False
    """batch-invariant log-probs (``rollout.exact``): the trainer's ``z / T`` then its fixed-order
    log-softmax (``hybridrl.exact.ops``), whatever the batch."""

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.uniforms[rows],
                               self.all_greedy, self.use_top_k_top_p, self.any_greedy, self.all_unit_temperature,
                               self.exact)


def sample(logits: torch.Tensor, st: SamplingTensors, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (tokens [B] long, logprobs [B] float32)."""
    if st.exact:  # as the trainer scores: z / T in float32 (T = 1 for greedy; x / 1 is x), then z - lse(z)
        logp = exact_log_softmax(logits if st.all_unit_temperature or st.all_greedy
                                 else logits / torch.where(st.temperature == 0, 1.0, st.temperature))
        if st.all_greedy:
            tokens = logits.argmax(dim=-1)
            return tokens, _gather(logp, tokens)
        return draw(logits, logp, st, step)
    if st.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _gather(torch.log_softmax(logits, dim=-1), tokens)
    if st.all_unit_temperature:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
    else:
        logp = torch.log_softmax(logits / torch.where(st.temperature == 0, 1.0, st.temperature), dim=-1)
    return draw(logits, logp, st, step)


def draw(logits: torch.Tensor, logp: torch.Tensor, st: SamplingTensors, step: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from ``logp [B, V]`` = ``log_softmax(logits / T)`` (computed by the caller, in
    its numerics: exact mode's differ), then (tokens [B] long, their log-probs [B]): top-k /
    top-p in sorted order, the row's uniform inverted on the CDF, greedy rows the argmax."""
    probs = pieced_unary(torch.exp, logp) if st.exact else logp.exp()  # exact: each element on the SIMD path
    if st.use_top_k_top_p:
        # Truncate in sorted order, then scatter back: the CDF is always inverted in vocabulary
        # order, so a row that does not truncate samples exactly what it would in a batch where
        # no row truncates (its sample never depends on its neighbours' settings).
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        probs = torch.zeros_like(probs).scatter_(-1, order, _truncate(sorted_probs, st.top_k, st.top_p))
    cdf = probs.double().cumsum(dim=-1)  # float64: the tail of a 100k vocab stays resolvable
    target = st.uniforms[:, step:step + 1] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1).squeeze(-1)
    if st.any_greedy:
        tokens = torch.where(st.temperature.squeeze(-1) == 0, logits.argmax(dim=-1), tokens)
    return tokens, _gather(logp, tokens)


def _truncate(sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out (in descending order) ranks >= top_k, then tokens whose preceding mass
    (renormalized after top-k, as HF's warpers do) already reaches top_p."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    probs = sorted_probs.masked_fill(ranks >= top_k, 0.0)
    through = probs.cumsum(dim=-1)  # a sequential scan per row: the same bits alone or in a batch
    # the total is the scan's last column, not probs.sum(): a long row alone is summed across
    # threads, rows in a batch are not, and the cut would move with the batch (V = 151936: 34 of 64 rows)
    return probs.masked_fill(through - probs >= top_p * through[..., -1:], 0.0)


def _gather(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def make_uniforms(seeds: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """[B, steps] float64; row b is a function of seeds[b] alone (the generator is reseeded per row)."""
    out, gen = torch.empty(len(seeds), steps, dtype=torch.float64), torch.Generator()
    for row, s in zip(out, seeds):
        torch.rand(steps, generator=gen.manual_seed(s), dtype=torch.float64, out=row)
    return out.to(device)
