"""Supervised warm start: cross-entropy on answer tokens so RL starts from a non-trivial policy."""

from __future__ import annotations

import random

import torch


def sft_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int):
    """Right-padded ``(input_ids [B, L], attention_mask [B, L], labels [B, L])``.

    Labels are ``-100`` on prompt and pad positions so only the answer (+ eos) is learned.
    """
    rows = [p + a for p, a in zip(prompts, answers)]
    L = max(map(len, rows))
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        labels[i, len(p): len(r)] = torch.tensor(r[len(p):])
    return ids, mask, labels


def sft_step(model, optimizer, ids, mask, labels, grad_clip: float,
             vision: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
    """One supervised step; returns ``(loss, grad_norm)``. ``vision``: a VL policy's image
    inputs of the rows (``data.vision.hf_vision_kwargs``)."""
    out = model(input_ids=ids, attention_mask=mask, **(vision or {}))
    logits = out.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item(), gn.item()


def sample_sft_batch(rng: random.Random, prompts: list[list[int]], answers: list[list[int]], k: int, *,
                     slips: list[list[int] | None] | None = None, slip_rate: float = 0.0,
                     slip_rng: random.Random | None = None):
    """``k`` (prompt, answer) pairs drawn with replacement, and the rows drawn.

    With ``slip_rate > 0`` the demonstration of a row that has a slip (``slips[i]`` not
    None) is the slip instead, with that probability, drawn afresh at every visit from
    ``slip_rng`` (its own stream: ``rng`` is consumed exactly as without slips)."""
    idx = [rng.randrange(len(prompts)) for _ in range(k)]
    out = [answers[i] for i in idx]
    if slip_rate > 0 and slips is not None:
        for j, i in enumerate(idx):
            if slips[i] is not None and slip_rng.random() < slip_rate:
                out[j] = slips[i]
    return [prompts[i] for i in idx], out, idx


def masked_sft_batch(seqs: list[list[int]], loss_masks: list[list[int]], pad_id: int):
    """Right-padded ``(input_ids [B, L], attention_mask [B, L], labels [B, L])`` for
    multi-turn demonstrations: ``labels`` is the token where ``loss_masks`` is 1 (the
    assistant's turns) and ``-100`` elsewhere (prompt, tool messages, padding), so only
    what a policy samples is learned — the loss mask RL trains with."""
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, loss_masks)):
        if len(s) != len(m):
            raise ValueError(f"masked_sft_batch: sequence {i} has {len(s)} ids but {len(m)} mask entries")
        row = torch.tensor(s)
        ids[i, : len(s)] = row
        mask[i, : len(s)] = 1
        keep = torch.tensor(m, dtype=torch.bool)
        labels[i, : len(s)] = torch.where(keep, row, torch.full_like(row, -100))
    return ids, mask, labels
