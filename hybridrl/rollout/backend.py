"""The interface a rollout backend implements for the trainer (the built-in
``RolloutEngine``, ``hybridrl.vllm_backend.VllmEngine``)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Protocol

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


class WeightUpdateBracket:
    """``with engine.weight_update(check=...): engine.load_weights(bucket) ...`` for any
    backend with ``begin_weight_update`` / ``finish_weight_update`` / ``abort_weight_update``:
    finish on a clean exit, abort on an exception."""

    def state_dict(self) -> dict[str, int]:
        """What a resume needs of the engine (its weights come back by refit): the version."""
        return {"weight_version": self.weight_version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the version numbering of a resumed run (call after its first refit):
        the engine stays the only writer of ``weight_version``."""
        if self.weight_update_in_progress:
            raise RuntimeError("load_state_dict during a weight update; finish or abort it first")
        self._weight_version = int(state["weight_version"])

    @contextlib.contextmanager
    def weight_update(self, check: Callable[[], None] | None = None) -> Iterator["WeightUpdateBracket"]:
        self.begin_weight_update()
        try:
            yield self
        except BaseException:
            self.abort_weight_update()
            raise
        self.finish_weight_update(check)
