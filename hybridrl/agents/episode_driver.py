"""Episodes as requests on an engine that someone else steps.

Every turn of an episode is one request of the engine's request API; a turn that ended
goes to the episode's environment, and the environment's answer comes back as the next
turn — a request that continues the previous one (``parent=``), so the conversation is
never prefilled again. The driver never steps the engine: a producer does, mixing the
driver's requests with any others, and feeds it what each step finished::

    driver = EpisodeDriver(engine, env_pool, ChatRenderer(tokenizer, env_pool.schemas),
                           SamplingParams(temperature=1.0, max_tokens=256), EpisodeLimits(max_turns=8))
    driver.add("ep0-0-0", {"prompt": ..., "answer": ...}, seed)
    while driver.live or other_work:
        if engine.has_unfinished_requests(): finished = engine.step().finished
        else: driver.wait_env(0.05); finished = []
        for traj in driver.advance(finished): sink(traj)

Environment calls: with ``overlap`` (the default) they run on one background thread
(``env_calls.py``) while the engine decodes the other episodes, and their results are
applied by the next ``advance``; without, the calls of the turns one step finished run in
one pool call inside ``advance`` (deterministic; ``EpisodeRunner`` uses this).

Lockstep (tensor-parallel ranks that each hold a shard of one engine must add the same
requests at the same step): ``lockstep(events) -> events`` is called once per ``advance``
on every rank. The leader (the one with the env pool) passes the ``EnvEvent`` s it is about
to apply and gets them back; followers (``env_pool=None``) pass ``[]`` and get the leader's.
Everything else ``advance`` does is a function of the engine's outputs, so every rank
makes the same engine calls in the same order.

An episode ends ``ok`` (its environment said done), ``truncated`` (``episode_limits.py``:
max_turns, the context budget, or a turn that hit max_tokens without ending) or ``failed``
(its environment raised, timed out or its worker died: that episode and no other).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.agents.chat_render import ChatRenderer
from hybridrl.agents.env_calls import END, ERROR, RESET, STEP, EnvCall, EnvCaller, EnvEvent, EnvThread
from hybridrl.agents.episode_limits import EpisodeLimits, budgeted, turn_sampling
from hybridrl.agents.trajectory import Trajectory
from hybridrl.agents.types import EnvStep
from hybridrl.data.vision import ImageInputs
from hybridrl.rollout.sampling_params import SamplingParams

SEED_MIX = 1_000_003  # turn k of an episode seeded s samples with seed (s * SEED_MIX + k) % 2**62


@dataclass(eq=False)
class _Episode:
    key: int
    episode_id: str
    row: dict
    row_index: int
    seed: int
    traj: Trajectory | None = None
    """None until the reset's result is applied."""
    waiting: str | None = RESET
    """the env call it waits for ("reset" / "step"); None while its turn is in the engine."""
    request_id: str | None = None
    """its turn's request while in the engine."""
    parent: str | None = None
    """its last finished (retained) request."""


class EpisodeDriver:
    """Episodes as requests on an engine stepped by someone else (see the module docstring)."""

    def __init__(self, engine: Any, env_pool: Any, renderer: ChatRenderer, sampling: SamplingParams,
                 limits: EpisodeLimits, *, overlap: bool = True, env_latency_s: float = 0.0,
                 lockstep: Callable[[list[EnvEvent]], list[EnvEvent]] | None = None):
        if not (isinstance(env_latency_s, (int, float)) and math.isfinite(env_latency_s) and env_latency_s >= 0):
            raise ValueError(f"EpisodeDriver: env_latency_s={env_latency_s!r} must be a finite number of seconds "
                             ">= 0 (0: off)")
        if env_pool is None and lockstep is None:
            raise ValueError("EpisodeDriver: env_pool=None is for a lockstep follower; pass the env pool, or "
                             "lockstep= on a follower rank")
        self.engine, self.env_pool, self.renderer = engine, env_pool, renderer
        self.tokenizer = renderer.tokenizer
        self.sampling = turn_sampling(sampling, renderer)
        self.limits, self.lockstep = limits, lockstep
        self.context = min(limits.context_tokens or engine.max_seq_len, engine.max_seq_len)
        self._caller = EnvCaller(env_pool, env_latency_s) if env_pool is not None else None
        self._thread = EnvThread(self._caller) if self._caller is not None and overlap else None
        self._episodes: dict[str, _Episode] = {}
        self._by_request: dict[str, _Episode] = {}
        self._inline: list[EnvCall] = []  # overlap=False: run by the next advance
        self._ready: deque = deque()  # overlap: batches taken off the env thread, not applied yet
        self._outstanding = 0  # overlap: resets and steps submitted, not yet taken off the thread
        self._ended: list[Trajectory] = []
        self._keys = itertools.count()
        self._wait_s = 0.0
        self._error: BaseException | None = None  # the leader's pool call that raised (overlap)

    # ---- the producer's calls -------------------------------------------------------------
    def add(self, episode_id: str, row: dict, seed: int, *, row_index: int = 0) -> None:
        """Start an episode: its reset is issued now (its first turn joins the engine once the
        opening is known). ``row_index``: its ``Trajectory.row`` (the group it belongs to)."""
        if episode_id in self._episodes:
            raise ValueError(f"EpisodeDriver.add: episode {episode_id!r} is still running; give each live "
                             "episode its own id")
        e = _Episode(next(self._keys), episode_id, row, row_index, seed)
        self._call(e, RESET, row)
        self._episodes[episode_id] = e

    def advance(self, finished: list) -> list[Trajectory]:
        """Take the outputs one engine step finished (others' ids are skipped), apply the env
        results that are ready, add the next turns; the episodes that ended since the last call."""
        for out in finished:
            e = self._by_request.pop(out.request_id, None)
            if e is not None:
                self._sampled(e, out)
        events = self._collect()
        if self.lockstep is not None:
            events = self.lockstep(events)
        for ev in events:
            if ev.kind == ERROR:  # every rank raises at the same advance
                raise self._error or RuntimeError(f"EpisodeDriver (lockstep): {ev.step.failure}")
            self._apply(ev)
        ended, self._ended = self._ended, []
        return ended

    def wait_env(self, timeout_s: float) -> None:
        """Block until an env result is ready or ``timeout_s`` passed (the engine has nothing to
        run); at once when no env call is outstanding or a result is already waiting."""
        if self._thread is None or self._ready or self._outstanding == 0:
            return
        t0 = time.perf_counter()
        batch = self._thread.get(timeout_s)
        self._wait_s += time.perf_counter() - t0
        if batch is not None:
            self._take(batch)

    @property
    def live(self) -> int:
        """Episodes not ended yet."""
        return len(self._episodes)

    def abort(self) -> None:
        """End every live episode, undelivered: its requests leave the engine (aborted,
        retained KV released), its environment ends. Idempotent."""
        episodes = list(self._episodes.values())
        self._episodes.clear()
        self._by_request.clear()
        self._inline.clear()
        for e in episodes:
            if e.request_id is not None:
                self.engine.abort(e.request_id)
            for rid in (e.request_id, e.parent):
                if rid is not None:
                    self.engine.release(rid)
            self._call(e, END, None)

    def close(self) -> None:
        """Abort what is live and stop the env thread (the env pool stays: its owner closes it)."""
        self.abort()
        if self._thread is not None:
            self._thread.close()

    def stats(self) -> dict[str, float]:
        """Cumulative: the wall time env pool calls ran, and the time ``wait_env`` (overlap) or
        ``advance`` (no overlap) blocked on them — env time not hidden behind decoding."""
        return {"agent/env_busy_s": self._caller.busy_s if self._caller is not None else 0.0,
                "agent/env_wait_s": self._wait_s}

    # ---- env calls and results --------------------------------------------------------------
    def _call(self, e: _Episode, kind: str, arg: Any) -> None:
        if self._caller is None:  # a lockstep follower: the leader calls the env
            return
        call = EnvCall(kind, e.episode_id, arg, e.key)
        if self._thread is not None:
            self._thread.submit(call)
            self._outstanding += kind != END
        elif kind == END:
            self._caller.run([call])
        else:
            self._inline.append(call)

    def _collect(self) -> list[EnvEvent]:
        """The leader's results to apply now, in order (none on a follower)."""
        if self._caller is None:
            return []
        results = []
        if self._thread is None:
            calls, self._inline = self._inline, []
            t0 = time.perf_counter()
            try:
                results = self._caller.run(calls) if calls else []
            except Exception as err:  # noqa: BLE001 - raised by advance, on every rank
                return self._broken(err)
            finally:
                self._wait_s += time.perf_counter() - t0
        else:
            while (batch := self._thread.get(0)) is not None:
                self._take(batch)
            while self._ready:
                batch = self._ready.popleft()
                if batch.error is not None:
                    return self._broken(batch.error)
                results += batch.results
        return [EnvEvent(c.episode_id, c.kind, step, secs) for c, step, secs in results if self._current(c)]

    def _broken(self, err: BaseException) -> list[EnvEvent]:
        """A pool call raised: the one event that makes every rank's ``advance`` raise."""
        self._error = err
        return [EnvEvent("", ERROR, EnvStep(done=True, failure=f"the leader's env pool raised "
                                            f"{type(err).__name__}: {err}"), 0.0)]

    def _take(self, batch) -> None:
        self._outstanding -= batch.calls
        self._ready.append(batch)

    def _current(self, call: EnvCall) -> bool:
        """Whether ``call``'s episode is live and waiting for it (not a late answer of an ended one)."""
        e = self._episodes.get(call.episode_id)
        return e is not None and e.key == call.key and e.waiting == call.kind

    def _apply(self, ev: EnvEvent) -> None:
        e = self._episodes.get(ev.episode_id)
        if e is None or e.waiting != ev.kind:
            raise RuntimeError(f"EpisodeDriver (lockstep): the leader applied the {ev.kind} of episode "
                               f"{ev.episode_id!r}, which this rank does not wait for; every rank must add the "
                               "same episodes in the same order and advance with the same engine outputs")
        e.waiting = None
        if ev.kind == RESET:
            self._opened(e, ev.step, ev.seconds)
        else:
            e.traj.env_seconds += ev.seconds
            self._stepped(e, ev.step)

    # ---- the episode's life ---------------------------------------------------------------
    def _opened(self, e: _Episode, res: EnvStep, seconds: float) -> None:
        fallback = [{"role": "user", "content": str(e.row.get("prompt", ""))}]
        messages = res.messages if res.failure is None and res.messages else fallback
        try:
            ids, images = self.renderer.opening_images(messages)
        except ValueError as err:  # a bad picture (or a text policy given one) costs this episode only
            ids, images = self.renderer.opening(fallback), None
            res = dataclasses.replace(res, failure=f"opening message: {err}")
        e.traj = Trajectory(e.episode_id, e.row_index, ids, images=images)
        e.traj.env_seconds += seconds
        if res.failure is not None:
            self._end(e, "failed", res.failure)
        else:
            self._submit(e, parent=None)

    def _sampled(self, e: _Episode, out: Any) -> None:
        """A turn finished: it ends the episode (no end-of-turn token: max_tokens) or goes to the env."""
        if e.parent is not None:
            self.engine.release(e.parent)  # the child holds its own copy now
        e.request_id, t = None, e.traj
        t.add_sampled(out.token_ids, out.logprobs, out.token_versions)
        if out.token_ids[-1:] != [self.renderer.end_of_turn_id]:
            e.parent = None
            self.engine.release(out.request_id)
            self._end(e, "truncated", None)
            return
        e.parent, e.waiting = out.request_id, STEP
        self._call(e, STEP, self.renderer.text(t.ids[t.turns[-1][0]:]))

    def _stepped(self, e: _Episode, res: EnvStep) -> None:
        t = e.traj
        t.turn_rewards.append(float(res.reward))
        t.tool_calls += res.tool_calls
        t.tool_errors.update(res.tool_errors)
        if res.failure is not None or res.done:
            t.final_answer = res.final_answer
            self._release_parent(e)
            self._end(e, "failed" if res.failure is not None else "ok", res.failure)
            return
        try:
            cont, images = self.renderer.continuation_images(
                budgeted(res.messages, self.limits.tool_response_tokens, self.tokenizer))
        except ValueError as err:  # a bad picture from the environment costs this episode only
            self._release_parent(e)
            self._end(e, "failed", f"environment message: {err}")
            return
        if t.num_turns >= self.limits.max_turns or len(t.ids) + len(cont) + 1 >= self.context:
            self._release_parent(e)
            self._end(e, "truncated", None)
            return
        t.add_observed(cont)
        t.images = ImageInputs.concat([t.images, images])
        self._submit(e, parent=e.parent)

    def _submit(self, e: _Episode, parent: str | None) -> None:
        ids, turn = e.traj.ids, e.traj.num_turns
        e.request_id = f"{e.episode_id}/t{turn}"
        params = dataclasses.replace(self.sampling, max_tokens=min(self.sampling.max_tokens, self.context - len(ids)),
                                     seed=(e.seed * SEED_MIX + turn) % 2**62)
        self._by_request[e.request_id] = e
        vision = {} if e.traj.images is None else {"images": e.traj.images}  # every image of ids, in order
        self.engine.add_request(e.request_id, ids, params, parent=parent, retain=True, **vision)

    def _release_parent(self, e: _Episode) -> None:
        self.engine.release(e.parent)
        e.parent = None

    def _end(self, e: _Episode, status: str, failure: str | None) -> None:
        e.traj.status, e.traj.failure = status, failure
        del self._episodes[e.episode_id]
        self._call(e, END, None)
        self._ended.append(e.traj)
