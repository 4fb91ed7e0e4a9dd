"""What a producer runs: *work* (one sample of a prompt, or one agent episode) on one
engine that the producer steps, and the finished samples that come out.

    runner = WorkRunner(engine, episodes=driver_or_None, step_latency_s=0.0)
    runner.submit([SampleWork(key, prompt_ids, params), EpisodeWork(key, row, seed), ...])
    while runner.busy():
        for done in runner.pump():   # RequestOutput (a sample) or Trajectory (an episode)
            ...

``pump`` is one engine step — every running request of both kinds advances together
(continuous batching) — or, when nothing can decode because every live episode waits for
its environment, a short wait for the environment. An episode waiting for its tool never
holds the engine's step (``agents/episode_driver.py`` runs environment calls on its own
thread).

Keys: a sample's key is its engine request id; an episode's key is its episode id (its
turns are the requests ``key/t<k>``). A finished item carries its key
(``RequestOutput.request_id`` / ``Trajectory.episode_id``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

from hybridrl.data.vision import ImageInputs
from hybridrl.rollout.backend import pad_step
from hybridrl.rollout.requests import RequestOutput
from hybridrl.rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleWork:
    """One sample (``params.n == 1``, seeded) of a prompt (and its images, for a VL policy)."""

    key: str
    prompt: list[int]
    params: SamplingParams
    images: ImageInputs | None = None


@dataclass(frozen=True)
class EpisodeWork:
    """One agent episode of a data row (``{"prompt", "answer", ...}``), seeded."""

    key: str
    row: dict
    seed: int


Work = Union[SampleWork, EpisodeWork]


def finished_key(item: Any) -> str:
    """The key of a finished sample (``RequestOutput``) or episode (``Trajectory``)."""
    return item.request_id if isinstance(item, RequestOutput) else item.episode_id


class WorkRunner:
    """Samples and episodes on one engine; not thread-safe (its producer's thread only)."""

    def __init__(self, engine, *, episodes=None, step_latency_s: float = 0.0, env_pool=None):
        """``episodes``: an ``EpisodeDriver`` on ``engine`` when the run trains an agent, and
        ``env_pool`` its environments (closed with the runner).
        ``step_latency_s``: ``rollout.step_latency_ms`` (benchmarks): an engine step lasts at
        least this long."""
        self.engine, self.episodes, self.step_latency_s = engine, episodes, step_latency_s
        self.env_pool = env_pool
        self._samples: set[str] = set()  # keys of this runner's unfinished samples
        self.engine_steps = 0

    def submit(self, items: list[Work]) -> None:
        for w in items:
            if isinstance(w, EpisodeWork):
                if self.episodes is None:
                    raise ValueError(f"work {w.key!r} is an agent episode, but this producer has no environment "
                                     "(env.name): the run's producers are built from one config")
                self.episodes.add(w.key, w.row, w.seed)
            else:
                if w.images is None:
                    self.engine.add_request(w.key, w.prompt, w.params)
                else:
                    self.engine.add_request(w.key, w.prompt, w.params, images=w.images)
                self._samples.add(w.key)

    def busy(self) -> bool:
        return bool(self._samples or (self.episodes is not None and self.episodes.live))

    def pump(self) -> list:
        """One engine step (or a short wait for the environment); the samples and episodes it finished."""
        if self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            finished = self.engine.step().finished
            self.engine_steps += 1
            pad_step(t0, self.step_latency_s)
        else:
            if self.episodes is not None:
                self.episodes.wait_env(0.05)
            finished = []
        done = [o for o in finished if o.request_id in self._samples]
        self._samples.difference_update(o.request_id for o in done)
        if self.episodes is not None:
            done.extend(self.episodes.advance(finished))
        return done

    def abort(self) -> None:
        """Drop every unfinished sample and episode of this runner (nothing stays in the engine)."""
        for key in list(self._samples):
            self.engine.abort(key)
        self._samples.clear()
        if self.episodes is not None:
            self.episodes.abort()

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        if self.env_pool is not None:
            self.env_pool.close()
