"""Rollouts: what `RolloutEngine.generate` returns, laid out for the trainer.

Row b of the padded tensors is `prompt_b + response_b`, right-padded to the longest row
L. `logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])` where
`response_mask[b, t] == 1`, 0.0 elsewhere (docs/interfaces.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.data.vision import RowImages


@dataclass
class Rollouts:
    prompt_token_ids: list[list[int]]
    response_token_ids: list[list[int]]
    response_logprobs: list[list[float]]
    finish_reasons: list[str]
    """"stop" (emitted a stop token) or "length" (hit max_tokens / max_seq_len)."""
    input_ids: torch.Tensor
    """[B, L] long, prompt + response, right-padded with pad_token_id."""
    attention_mask: torch.Tensor
    """[B, L] long 0/1."""
    response_mask: torch.Tensor
    """[B, L] float32 0/1, 1 on response tokens."""
    logprobs: torch.Tensor
    """[B, L] float32, sampling log-probs on response tokens, 0 elsewhere."""
    prompt_lengths: list[int]
    weight_version: int
    """the oldest weight version any response token was sampled with (all of them, when no
    refit happened during the generation)."""
    routed_experts: torch.Tensor | None = None
    """MoE with routing record: [B, L, n_moe_layers, k] int16 expert ids per fed token, -1 = none."""
    token_versions: torch.Tensor | None = None
    """[B, L] long: the weight version that sampled each response token, -1 elsewhere."""
    images: RowImages | None = None
    """a VL policy's rows: each row's prompt images (``data/vision.py``), None for text."""

    def response_versions(self) -> set[int]:
        """Every weight version that sampled a token of these rollouts."""
        if self.token_versions is None:
            return {self.weight_version}
        return set(self.token_versions[self.response_mask.bool()].unique().tolist())


def rollouts_from_outputs(outputs, pad_token_id: int = 0) -> Rollouts:
    """Finished ``RequestOutput``s (one row each, in order) -> ``Rollouts`` with per-token versions
    (and the routing record when the outputs carry one)."""
    versions = [o.token_versions for o in outputs]
    oldest = min((min(v) for v in versions if v), default=0)
    ro = build_rollouts([o.prompt_token_ids for o in outputs], [o.token_ids for o in outputs],
                        [o.logprobs for o in outputs], [o.finish_reason for o in outputs], oldest, pad_token_id)
    tv = torch.full_like(ro.input_ids, -1)
    tv[ro.response_mask.bool()] = torch.tensor([x for v in versions for x in v], dtype=torch.long)
    ro.token_versions = tv
    if any(o.images is not None for o in outputs):
        ro.images = RowImages([o.images for o in outputs])
    if outputs and outputs[0].routed_experts is not None:
        from hybridrl.rollout.routing import stack_routing
        ro.routed_experts = stack_routing([o.routed_experts for o in outputs], ro.input_ids.shape[1])
    return ro


def rollouts_to_device(ro: Rollouts, device: torch.device) -> Rollouts:
    """Move ``ro``'s tensors to ``device`` (in place; returns ``ro``)."""
    for name in ("input_ids", "attention_mask", "response_mask", "logprobs", "token_versions", "routed_experts"):
        if getattr(ro, name) is not None:
            setattr(ro, name, getattr(ro, name).to(device))
    return ro


def build_rollouts(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
                   finish_reasons: list[str], weight_version: int, pad_token_id: int = 0) -> Rollouts:
    """Pad the per-row lists into trainer tensors (on CPU)."""
    B = len(prompts)
    P = torch.tensor([len(p) for p in prompts])
    R = torch.tensor([len(r) for r in responses])
    L = int((P + R).max())
    slots = torch.arange(L)
    attention_mask = (slots < (P + R)[:, None]).long()  # (B, L)
    response_mask = ((slots >= P[:, None]) & (slots < (P + R)[:, None])).float()
    # Boolean-mask assignment fills True slots in row-major order: the rows' lists, concatenated.
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    input_ids[attention_mask.bool()] = torch.tensor([t for p, r in zip(prompts, responses) for t in (*p, *r)],
                                                    dtype=torch.long)
    lp = torch.zeros(B, L, dtype=torch.float32)
    lp[response_mask.bool()] = torch.tensor([x for r_lp in logprobs for x in r_lp], dtype=torch.float32)
    return Rollouts(prompt_token_ids=[list(p) for p in prompts], response_token_ids=responses,
                    response_logprobs=logprobs, finish_reasons=finish_reasons, input_ids=input_ids,
                    attention_mask=attention_mask, response_mask=response_mask, logprobs=lp,
                    prompt_lengths=[len(p) for p in prompts], weight_version=weight_version)
