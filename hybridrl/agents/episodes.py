"""Run a batch of episodes to the end on an engine of one's own: a loop over an
``EpisodeDriver`` (``episode_driver.py``) without overlap, so environment calls run
between engine steps and a run is deterministic.

    runner = EpisodeRunner(engine, env_pool, ChatRenderer(tokenizer, env_pool.schemas), tokenizer,
                           SamplingParams(temperature=1.0, max_tokens=256), EpisodeLimits(max_turns=8))
    trajectories = runner.run(rows, n=8, seeds=[...])     # rows: dicts with "prompt", "answer", ...

Limits, statuses and failures: see ``episode_driver.py``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from hybridrl.agents.chat_render import ChatRenderer
from hybridrl.agents.episode_driver import EpisodeDriver
from hybridrl.agents.episode_limits import EpisodeLimits, truncate_middle, turn_sampling
from hybridrl.agents.trajectory import Trajectory
from hybridrl.rollout.backend import request_seed
from hybridrl.rollout.sampling_params import SamplingParams

__all__ = ["EpisodeRunner", "EpisodeLimits", "truncate_middle"]


class EpisodeRunner:
    def __init__(self, engine: Any, env_pool: Any, renderer: ChatRenderer, tokenizer: Any,
                 sampling: SamplingParams, limits: EpisodeLimits = EpisodeLimits()):
        self.engine, self.env_pool, self.renderer, self.tokenizer = engine, env_pool, renderer, tokenizer
        self.sampling, self.limits = turn_sampling(sampling, renderer), limits
        self._calls = itertools.count()

    def run(self, rows: list[dict], n: int, seeds: list[int],
            on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """``n`` episodes per row (row-major, like ``generate``'s samples); ``seeds[i]`` seeds
        row i's episodes (episode j, turn k: ``request_seed(seed, j)`` mixed with k).
        ``on_episode`` sees each episode as it ends (while others still run)."""
        call = next(self._calls)
        driver = self._driver()
        eids = []
        for i in range(len(rows)):
            for j in range(n):
                eids.append(f"ep{call}-{i}-{j}")
                driver.add(eids[-1], rows[i], request_seed(seeds[i], j), row_index=i)
        done: dict[str, Trajectory] = {}
        try:
            finished = []
            while True:
                for t in driver.advance(finished):
                    done[t.episode_id] = t
                    if on_episode is not None:
                        on_episode(t)
                if not driver.live:
                    break
                finished = self.engine.step().finished
        except BaseException:  # nothing of this call may stay in the engine (a shared engine serves on)
            driver.abort()
            raise
        return [done[e] for e in eids]

    def _driver(self) -> EpisodeDriver:
        return EpisodeDriver(self.engine, self.env_pool, self.renderer, self.sampling,
                             self.limits, overlap=False)
