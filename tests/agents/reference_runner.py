"""Reference only: the synchronous EpisodeRunner as it was before EpisodeDriver (hybridrl/agents/episodes.py at
d89133b), kept verbatim below its imports so that
tests/agents/test_episode_driver.py can check that the runner on the driver reproduces it exactly."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.agents.chat_render import ChatRenderer
from hybridrl.agents.trajectory import Trajectory
from hybridrl.agents.types import EnvStep
from hybridrl.rollout.backend import request_seed
from hybridrl.rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    """sampled turns per episode."""
    tool_response_tokens: int = 512
    """a tool message's content is cut to this many tokens (middle out, with a marker)."""
    context_tokens: int | None = None
    """prompt + every turn; None: the engine's max_seq_len."""

    def __post_init__(self):
        if self.max_turns < 1 or self.tool_response_tokens < 8:
            raise ValueError(f"EpisodeLimits: max_turns={self.max_turns} must be >= 1 and tool_response_tokens="
                             f"{self.tool_response_tokens} >= 8")


def truncate_middle(ids: list[int], budget: int, tokenizer: Any) -> tuple[list[int], str | None]:
    """``ids`` unchanged if they fit ``budget``; else head and tail around a marker, total <= budget.
    Returns (ids, the marker text or None)."""
    if len(ids) <= budget:
        return ids, None
    marker = f"\n[... {len(ids) - budget} tokens cut ...]\n"
    m = tokenizer.encode(marker, add_special_tokens=False)
    keep = max(0, budget - len(m))
    head = keep - keep // 2
    return ids[:head] + m + ids[len(ids) - keep // 2:] if keep // 2 else ids[:head] + m, marker


class EpisodeRunner:
    def __init__(self, engine: Any, env_pool: Any, renderer: ChatRenderer, tokenizer: Any,
                 sampling: SamplingParams, limits: EpisodeLimits = EpisodeLimits()):
        self.engine, self.env_pool, self.renderer, self.tokenizer = engine, env_pool, renderer, tokenizer
        eot = renderer.end_of_turn_id
        stops = tuple(sampling.stop_token_ids) + (() if eot in sampling.stop_token_ids else (eot,))
        self.sampling = dataclasses.replace(sampling, n=1, stop_token_ids=stops)
        self.limits = limits
        self.context = min(limits.context_tokens or engine.max_seq_len, engine.max_seq_len)
        self._calls = itertools.count()

    def run(self, rows: list[dict], n: int, seeds: list[int],
            on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """``n`` episodes per row (row-major, like ``generate``'s samples); ``seeds[i]`` seeds
        row i's episodes (episode j, turn k: ``request_seed(seed, j)`` mixed with k).
        ``on_episode`` sees each episode as it ends (while others still run)."""
        call = next(self._calls)
        slots = [(i, j) for i in range(len(rows)) for j in range(n)]
        eids = [f"ep{call}-{i}-{j}" for i, j in slots]
        opened = self._timed(lambda: self.env_pool.reset(eids, [rows[i] for i, _ in slots]))
        trajs, live = [], {}
        for eid, (i, j), (res, secs) in zip(eids, slots, opened):
            t = Trajectory(eid, i, self._opening(res, rows[i]))
            t.env_seconds += secs
            trajs.append(t)
            seed = request_seed(seeds[i], j)
            if res.failure is not None:
                self._end(t, "failed", res.failure, on_episode)
            else:
                live[eid] = _Live(t, seed)
                self._submit(live[eid], t.ids, parent=None)
        by_request = {e.request_id: e for e in live.values()}
        try:
            self._drive(live, by_request, on_episode)
        except BaseException:  # nothing of this call may stay in the engine (a shared engine serves on)
            for e in live.values():
                self.engine.abort(e.request_id)
                for rid in (e.request_id, e.parent):
                    if rid is not None:
                        self.engine.release(rid)
            raise
        return trajs

    def _drive(self, live: dict, by_request: dict, on_episode) -> None:
        """Step the engine and the environments until every live episode ended."""
        while live:
            done_turns = []
            for out in self.engine.step().finished:
                e = by_request.pop(out.request_id, None)
                if e is None:
                    continue  # another caller's request on a shared engine
                if e.parent is not None:
                    self.engine.release(e.parent)  # the child holds its own copy now
                e.traj.add_sampled(out.token_ids, out.logprobs, out.token_versions)
                ended = out.token_ids[-1:] == [self.renderer.end_of_turn_id]
                if not ended:
                    self.engine.release(out.request_id)
                    self._end(e.traj, "truncated", None, on_episode)
                    del live[e.traj.episode_id]
                    continue
                e.parent = out.request_id
                done_turns.append(e)
            if not done_turns:
                continue
            items = [(e.traj.episode_id, self.renderer.text(e.traj.ids[e.traj.turns[-1][0]:])) for e in done_turns]
            for e, (res, secs) in zip(done_turns, self._timed(lambda: self.env_pool.step(items))):
                e.traj.env_seconds += secs
                self._after_env(e, res, live, by_request, on_episode)

    # ---- pieces --------------------------------------------------------------------------
    def _after_env(self, e: "_Live", res: EnvStep, live: dict, by_request: dict, on_episode) -> None:
        t = e.traj
        t.turn_rewards.append(float(res.reward))
        t.tool_calls += res.tool_calls
        t.tool_errors.update(res.tool_errors)
        eid = t.episode_id
        if res.failure is not None or res.done:
            self.engine.release(e.parent)
            t.final_answer = res.final_answer
            self._end(t, "failed" if res.failure is not None else "ok", res.failure, on_episode)
            del live[eid]
            return
        cont = self.renderer.continuation(self._budgeted(res.messages))
        if t.num_turns >= self.limits.max_turns or len(t.ids) + len(cont) + 1 >= self.context:
            self.engine.release(e.parent)
            self._end(t, "truncated", None, on_episode)
            del live[eid]
            return
        t.add_observed(cont)
        self._submit(e, t.ids, parent=e.parent)
        by_request[e.request_id] = e

    def _submit(self, e: "_Live", ids: list[int], parent: str | None) -> None:
        turn = e.traj.num_turns
        e.request_id = f"{e.traj.episode_id}/t{turn}"
        max_tokens = min(self.sampling.max_tokens, self.context - len(ids))
        params = dataclasses.replace(self.sampling, max_tokens=max_tokens,
                                     seed=(e.seed * 1_000_003 + turn) % 2**62)
        self.engine.add_request(e.request_id, ids, params, parent=parent, retain=True)
        e.parent = parent

    def _budgeted(self, messages: list[dict]) -> list[dict]:
        """Tool messages cut to ``tool_response_tokens`` (middle out)."""
        out = []
        for m in messages:
            if m.get("role") == "tool" and isinstance(m.get("content"), str):
                ids = self.tokenizer.encode(m["content"], add_special_tokens=False)
                cut, marker = truncate_middle(ids, self.limits.tool_response_tokens, self.tokenizer)
                if marker is not None:
                    m = {**m, "content": self.tokenizer.decode(cut)}
            out.append(m)
        return out

    def _opening(self, res: EnvStep, row: dict) -> list[int]:
        messages = res.messages if res.failure is None and res.messages else [
            {"role": "user", "content": str(row.get("prompt", ""))}]
        return self.renderer.opening(messages)

    @staticmethod
    def _timed(fn):
        t0 = time.perf_counter()
        results = fn()
        per = (time.perf_counter() - t0) / max(1, len(results))
        return [(r, per) for r in results]

    def _end(self, t: Trajectory, status: str, failure: str | None, on_episode) -> None:
        t.status, t.failure = status, failure
        self.env_pool.end(t.episode_id)
        if on_episode is not None:
            on_episode(t)


@dataclass(eq=False)
class _Live:
    traj: Trajectory
    seed: int
    request_id: str = ""
    parent: str | None = None
