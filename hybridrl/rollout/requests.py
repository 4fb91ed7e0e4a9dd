"""The request-level API both rollout backends serve (``add_request`` / ``step`` / ``abort``),
in vLLM's ``LLMEngine`` shape:

    engine.add_request("q1", prompt_ids, SamplingParams(max_tokens=64, seed=1))
    while engine.has_unfinished_requests():
        out = engine.step()                 # one decode step of every running request
        for r in out.finished: ...          # RequestOutput, finish_reason "stop" | "length"
    partial = engine.abort("q2")            # RequestOutput with finish_reason "abort" (or None)

A conversation continues without re-prefill: finish a turn with ``retain=True`` and add
the next turn with ``parent=<that id>`` and token ids that extend the parent's prompt +
response; the cached prefix is reused (recomputed if it was evicted; never wrong).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridrl.data.vision import ImageInputs

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class RequestOutput:
    """A request's tokens so far (all of them when ``finished``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """generated tokens (a stop token that ended the request is the last one)."""
    logprobs: list[float]
    """sampling log-prob of each generated token (docs/interfaces.md)."""
    token_versions: list[int]
    """weight version that produced each generated token (a refit mid-request changes it)."""
    finished: bool
    finish_reason: str | None = None
    """"stop" | "length" | "abort"; None while running."""
    cached_tokens: int = 0
    """prompt tokens whose KV came from the parent's cache instead of a prefill."""
    routed_experts: torch.Tensor | None = None
    """MoE routing record: ``[len(prompt) + len(tokens), n_moe_layers, k]`` int16, -1 = not fed."""
    images: ImageInputs | None = None
    """the request's images (a VL policy's prompt), as they were added; None for text."""


@dataclass
class StepOutput:
    """What one ``step()`` did."""

    finished: list[RequestOutput] = field(default_factory=list)
    """requests that finished in this step, in the order they finished."""
    prefilled_tokens: int = 0
    """prompt tokens run through the model in this step (the prefill budget's unit)."""
    running: tuple = ()
    """the requests still running after this step (the scheduler's own records)."""

    @property
    def progressed(self) -> list[str]:
        """ids of the requests that got a token in this step and are still running."""
        return [s.request_id for s in self.running]


class UnknownRequestError(KeyError):
    """A request id (or a ``parent``) this engine does not know."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the one-line message readable
        return str(self.args[0])
