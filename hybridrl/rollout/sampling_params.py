"""SamplingParams: per-request generation settings (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """softmax temperature; 0 = greedy (argmax)."""
    top_k: int = -1
    """keep the k most likely tokens; -1 (or 0) = all."""
    top_p: float = 1.0
    """keep the smallest set of most likely tokens with total probability >= top_p."""
    max_tokens: int = 128
    """maximum number of generated tokens (capped by the engine's max_seq_len)."""
    stop_token_ids: tuple[int, ...] = ()
    """generation stops after emitting one of these (the stop token is part of the response)."""
    seed: int | None = None
    """makes sampling reproducible, independent of the other requests in the batch."""
    n: int = 1
    """samples per prompt (rows are consecutive in the output)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be -1 (off) or >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
