"""The batch source: what the RL step receives at construction and takes its batches from,
whatever ``trainer.mode`` is.

    source.publish(model) -> Publication        # the warm start's weights, then each update's
    source.start(model, draw=..., rng=..., first_step=...)
    batch = source.take(model)                   # the next step's groups, generated and scored
    source.current_rollout(model)                # the trainer's engine at the current version
    source.state_dict() / load_state_dict(state) # the version and the untrained groups
    source.close()

One implementation (``coordinator.Pipeline``) serves every mode; ``build.py`` reads
``trainer.mode`` (the only place it is read) into :class:`SourceSettings`:

    sync          max_staleness 0, one inline producer (the trainer's engine)
    one_step_off  max_staleness 1, producers refit between batches
    async         max_staleness pipeline.max_staleness, producers refit at once (partial rollouts)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceSettings:
    """How the source admits and publishes (from ``trainer.mode``, ``pipeline.*``, ``algo.dapo.*``)."""

    overlapped: bool  # producers with engines of their own (one_step_off, async); False: the trainer's engine
    groups_per_step: int  # this rank's prompts per step
    max_staleness: int
    partial: bool  # refit producers at once (async) or between batches
    workers: int = 1  # producers
    placement: str = ""  # words for the start-up line
    timeout_s: float = 300.0
    restarts: int = 1
    dynamic_sampling: bool = False  # DAPO: refill a step until it has groups_per_step informative groups
    refill_rounds: int = 0

    def describe(self) -> str:
        if not self.overlapped:
            return "pipeline: sync (the trainer's engine generates each step's batch, staleness 0)"
        kind = "async (partial rollouts)" if self.partial else "one_step_off"
        return (f"pipeline: {kind}, max_staleness {self.max_staleness}, {self.workers} rollout worker(s)"
                f"{' as ' + self.placement if self.placement else ''}")


@dataclass(frozen=True)
class Publication:
    """What :meth:`publish` did: the version it decided and the bytes it moved now."""

    version: int
    bytes_moved: int


@dataclass
class Batch:
    """What a step takes: its ``StepBatch`` (rewards set, trainer device), the source's
    metrics, and whether any token was sampled by an older version than the one training it."""

    step_batch: object
    metrics: dict[str, float]
    stale: bool
