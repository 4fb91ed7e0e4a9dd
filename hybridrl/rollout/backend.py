"""The interface a rollout backend implements for the trainer (the built-in
``RolloutEngine``, ``hybridrl.vllm_backend.VllmEngine``)."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from hybridrl.rollout.rollouts import Rollouts
from hybridrl.rollout.sampling_params import SamplingParams


class RolloutBackend(Protocol):
    @property
    def weight_version(self) -> int:
        """+1 per complete weight update; the backend is its only writer."""

    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> Rollouts: ...

    def begin_weight_update(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def finish_weight_update(self, check=None) -> int: ...

    def abort_weight_update(self) -> None: ...
