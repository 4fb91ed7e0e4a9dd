"""SamplingParams: per-request generation settings (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.sampling import sampling_problem


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
        problem = sampling_problem(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                   max_tokens=self.max_tokens, n=self.n)
        if problem is not None:
            raise ValueError(f"SamplingParams.{problem}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
