"""On-policy distillation: the student samples, a teacher scores the sampled tokens.

Two signals, both per response token and both at the rollout temperature ``T`` (the
distribution the student actually sampled from; ``T = 0`` means greedy, whose log-probs
are those of ``log_softmax(logits)``, as everywhere in hybridrl):

- :func:`reverse_kl_advantages`: ``A_t = log pi_teacher(y_t) - log pi_student(y_t)``, the
  negative per-token reverse-KL estimate on the sampled token (Thinking Machines'
  "on-policy distillation", slime's ``--use-opd``). It is an advantage: the policy loss
  aggregates it like any other, so ``algo.loss_agg_mode`` decides the normalisation.
- :func:`generalized_jsd`: TRL's generalized Jensen-Shannon divergence between the full
  next-token distributions at every position (GKD, arXiv:2306.13649): ``beta = 0`` is the
  forward KL(teacher || student), ``beta = 1`` the reverse KL(student || teacher), in
  between ``beta KL(t || m) + (1 - beta) KL(s || m)`` with ``m = beta t + (1 - beta) s``.
  A loss term, aggregated by :func:`hybridrl.algos.agg_loss` over the response tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def temperature_scale(temperature: float) -> float:
    """The divisor of the logits: ``T``, or 1 for greedy (``T = 0``)."""
    return 1.0 if temperature == 0 else float(temperature)


def next_token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, S]`` float32: ``out[b, t] = log softmax(logits[b, t - 1] / T)[input_ids[b, t]]``,
    0 at ``t = 0`` (aligned like ``Rollouts.logprobs``). ``logits``: ``[B, S, V]``."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature_scale(temperature), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0))


def reverse_kl_advantages(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                          response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: ``(log pi_teacher - log pi_student)`` on response tokens, 0 elsewhere."""
    return (teacher_log_prob - student_log_prob) * response_mask


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float,
                    temperature: float) -> torch.Tensor:
    """Per-position divergence ``[..., ]`` (summed over the vocabulary, the last dim) between
    the temperature-scaled distributions; differentiable in ``student_logits``."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta={beta} must be in [0, 1]")
    t = temperature_scale(temperature)
    s = torch.log_softmax(student_logits.float() / t, dim=-1)
    q = torch.log_softmax(teacher_logits.float() / t, dim=-1)
    if beta == 0.0:
        return F.kl_div(s, q, reduction="none", log_target=True).sum(-1)  # KL(teacher || student)
    if beta == 1.0:
        return F.kl_div(q, s, reduction="none", log_target=True).sum(-1)  # KL(student || teacher)
    m = torch.logsumexp(torch.stack([s + math.log(1.0 - beta), q + math.log(beta)]), dim=0)
    kl_teacher = F.kl_div(m, q, reduction="none", log_target=True).sum(-1)  # KL(teacher || mixture)
    kl_student = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)  # KL(student || mixture)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def shifted_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float,
                temperature: float) -> torch.Tensor:
    """``[B, S]``: the divergence of the distributions that predicted token ``t`` (computed
    at position ``t - 1``), 0 at ``t = 0`` — aligned with the response mask."""
    return F.pad(generalized_jsd(student_logits[:, :-1], teacher_logits[:, :-1], beta=beta,
                                 temperature=temperature), (1, 0))
