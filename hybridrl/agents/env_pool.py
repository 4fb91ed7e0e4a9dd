"""Many episodes' environments, run in a pool of worker processes (``rewards/process_pool.py``).

The episode runner calls, one batch at a time::

    pool = EnvPool("path/to/env.py:ClassName", workers=8, timeout_s=30)
    openings = pool.reset(["e0", "e1"], rows)          # -> [EnvStep] (messages = opening messages)
    steps = pool.step([("e0", text0), ("e1", text1)])  # -> [EnvStep], all run concurrently
    pool.end("e0"); pool.close()

Every episode's instance lives in this process *as pickle bytes* and is only ever
unpickled inside a worker: user code never runs in the trainer (but for the tool parser).

* An Environment (``reset``/``step``): each reset/step is one pool call
  ``(state, args) -> (new state, result)``. A raise, a bad result, an unpicklable state,
  a timeout or a dead worker is an infrastructure failure: ``EnvStep.failure`` says which
  (``"timeout: ..."``, ``"worker died: ..."``, ``"raised ValueError: ... in Env.step"``),
  ``done=True``, and the episode's state is dropped.
* A tools class: ``reset`` builds the instance in a worker; ``step`` parses here, then runs
  each tool call as one pool call on the pickled instance (its state is updated when the
  call succeeds and kept when it fails). A hanging or crashing tool costs that call: its
  tool message is the error, counted in ``EnvStep.tool_errors`` ("timeout", "crashed").
  Calls of one episode run in order (call 2 sees call 1's effects); calls of different
  episodes run concurrently, so a turn takes one pool round per call index.

An episode that is done or failed is forgotten (``end`` is then a no-op). Workers' output
goes to ``worker_output`` (a file) or /dev/null; ``close()`` kills them (idempotent; also on
garbage collection and at exit). Not thread-safe: one call at a time.
"""

from __future__ import annotations

import math
import os
from typing import Any

from hybridrl.agents import env_worker
from hybridrl.agents.environment import dumps_env_class, environment_kind, load_environment
from hybridrl.agents.tool_env import CRASHED, DEFAULT_MAX_TOOL_CALLS, TIMEOUT, ToolEnvironment, ToolOutcome
from hybridrl.agents.tool_parsers import ToolParser
from hybridrl.agents.types import EnvStep
from hybridrl.rewards.process_pool import Lost, ProcessPool


def _failed(why: str) -> EnvStep:
    return EnvStep(done=True, failure=why)


def _lost(lost: Lost) -> str:
    return f"{lost.reason}: {lost.detail}" if lost.detail else lost.reason


class EnvPool:
    """Environments of kind ``environment`` or ``tools`` (``environment.py``) for many episodes."""

    def __init__(self, env: str | type, *, workers: int = 4, timeout_s: float = 10.0,
                 memory_limit_mb: int | None = None, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
                 parser: str | ToolParser = "hermes", system_prompt: str | None = None,
                 worker_output: str | os.PathLike | None = None):
        if not (_is_number(timeout_s) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"env.timeout_s={timeout_s!r}: must be a finite number of seconds > 0")
        if not (_is_int(workers) and workers >= 1):
            raise ValueError(f"env.workers={workers!r}: must be an integer >= 1")
        if memory_limit_mb is not None and not (_is_int(memory_limit_mb) and memory_limit_mb >= 1):
            raise ValueError(f"env.memory_limit_mb={memory_limit_mb!r}: must be an integer >= 1 (MB), "
                             "or null for no limit")
        self.env_cls = load_environment(env)
        self.kind = environment_kind(self.env_cls)
        self.timeout_s = float(timeout_s)
        self.tools: ToolEnvironment | None = None
        if self.kind == "tools":
            self.tools = ToolEnvironment(self.env_cls, parser=parser, max_tool_calls=max_tool_calls,
                                         system_prompt=system_prompt)
        self._states: dict[str, bytes] = {}  # episode id -> its pickled instance
        self._pool: ProcessPool | None = None
        payload = dumps_env_class(self.env_cls)
        try:
            self._pool = ProcessPool(payload, workers=workers, memory_limit_mb=memory_limit_mb, output=worker_output)
        except RuntimeError as e:  # loads here, but not in a fresh process (or too slowly)
            # the pool was written for rewards and says so; the user wrote an environment
            raise ValueError(f"env class {self.env_cls.__qualname__!r} does not load in a worker process: "
                             f"{e}".replace("reward", "environment")) from e

    @property
    def schemas(self) -> list[dict] | None:
        """The tools' OpenAI function schemas (for the chat template's ``tools=``), or None."""
        return self.tools.schemas() if self.tools is not None else None

    def pids(self) -> list[int]:
        """The worker processes' ids (for tests and diagnostics)."""
        return self._pool.pids() if self._pool is not None else []

    @property
    def running(self) -> list[str]:
        """Ids of the episodes with a live state."""
        return list(self._states)

    # ----------------------------------------------------------------------------- reset

    def reset(self, episode_ids: list[str], rows: list[dict]) -> list[EnvStep]:
        """Start one episode per (id, row): its opening messages, or a failure."""
        if len(episode_ids) != len(rows):
            raise ValueError(f"EnvPool.reset: {len(episode_ids)} episode ids for {len(rows)} rows; pass one per row")
        self._check_ids(episode_ids, new=True)
        pool = self._live()
        if self.tools is not None:
            openings = [self.tools.opening_messages(row) for row in rows]  # a bad row raises before any work
            results = pool.map(env_worker.tools_new, [()] * len(rows), self.timeout_s)
        else:
            results = pool.map(env_worker.env_reset, [(row,) for row in rows], self.timeout_s)
        steps = []
        for i, (episode, result) in enumerate(zip(episode_ids, results)):
            failure = _worker_failure(result)
            if failure is not None:
                steps.append(failure)
            else:
                self._states[episode] = result[1]
                steps.append(EnvStep(messages=openings[i] if self.tools is not None else result[2]))
        return steps

    # ------------------------------------------------------------------------------ step

    def step(self, items: list[tuple[str, str]]) -> list[EnvStep]:
        """One turn of each (episode id, assistant text), all episodes concurrently."""
        self._check_ids([episode for episode, _ in items], new=False)
        steps = self._step_tools(items) if self.tools is not None else self._step_envs(items)
        for (episode, _), step in zip(items, steps):
            if step.done:
                self._states.pop(episode, None)
        return steps

    def _step_envs(self, items: list[tuple[str, str]]) -> list[EnvStep]:
        calls = [(self._states[episode], text) for episode, text in items]
        steps = []
        for (episode, _), result in zip(items, self._live().map(env_worker.env_step, calls, self.timeout_s)):
            failure = _worker_failure(result)
            if failure is not None:
                steps.append(failure)
            else:
                self._states[episode] = result[1]
                messages, reward, done, info = result[2]
                steps.append(EnvStep(messages=messages, reward=reward, done=done, info=info))
        return steps

    def _step_tools(self, items: list[tuple[str, str]]) -> list[EnvStep]:
        tools = self.tools
        steps: list[EnvStep | None] = [None] * len(items)
        plans, outcomes = {}, {}
        for i, (_, text) in enumerate(items):
            try:
                plans[i] = tools.plan(text)
            except Exception as e:  # noqa: BLE001 - the (user-pluggable) parser failed on this text
                from hybridrl.rewards.outcome import explain

                steps[i] = _failed(f"raised {explain(e)} in the tool parser")
                continue
            outcomes[i] = {}
        # round r runs the r-th call of every episode: in order within an episode, concurrent across
        queues = {i: plan.to_run() for i, plan in plans.items()}
        for r in range(max((len(q) for q in queues.values()), default=0)):
            batch = [(i, *queues[i][r]) for i in queues if r < len(queues[i]) and steps[i] is None]
            calls = [(self._states[items[i][0]], call.name, call.arguments) for i, _, call in batch]
            for (i, slot, call), result in zip(batch, self._live().map(env_worker.tools_call, calls, self.timeout_s)):
                if isinstance(result, Lost):
                    outcomes[i][slot] = self._lost_call(call.name, result)
                elif result[0] != env_worker.OK:
                    steps[i] = _failed(result[1])  # the instance itself is unusable: infrastructure
                else:
                    _, new_state, content, error = result
                    if new_state is not None:
                        self._states[items[i][0]] = new_state
                    outcomes[i][slot] = ToolOutcome(content, error)
        for i, plan in plans.items():
            if steps[i] is None:
                steps[i] = tools.finish(plan, outcomes[i])
        return steps

    def _lost_call(self, name: str, lost: Lost) -> ToolOutcome:
        if lost.reason == TIMEOUT:
            return ToolOutcome(f"error: tool {name!r} timed out after {self.timeout_s:g} s and was stopped", TIMEOUT)
        why = lost.detail.split(";")[0].removeprefix("the worker process ").strip() or lost.reason
        return ToolOutcome(f"error: tool {name!r} crashed ({why}); its effects are lost", CRASHED)

    # ------------------------------------------------------------------------ lifecycle

    def end(self, episode_id: str) -> None:
        """Forget an episode's state (a no-op for an unknown, done or failed one)."""
        self._states.pop(episode_id, None)

    def close(self) -> None:
        """Kill every worker and forget every episode (idempotent; also on GC and at exit)."""
        self._states.clear()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self) -> ProcessPool:
        if self._pool is None or self._pool.closed:
            raise RuntimeError("EnvPool is closed; create a new EnvPool")
        return self._pool

    def _check_ids(self, episode_ids: list[str], *, new: bool) -> None:
        seen = set()
        for episode in episode_ids:
            if episode in seen:
                raise ValueError(f"EnvPool: episode id {episode!r} appears twice in one call; give each episode "
                                 "its own id")
            seen.add(episode)
            if new and episode in self._states:
                raise ValueError(f"EnvPool.reset: episode {episode!r} is already running; end() it first")
            if not new and episode not in self._states:
                raise ValueError(f"EnvPool.step: episode {episode!r} is not running (never reset, or already "
                                 "done, failed or ended); reset it first")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _worker_failure(result) -> EnvStep | None:
    """The failed step a worker's result means (lost, or an error it reported), else None."""
    if isinstance(result, Lost):
        return _failed(_lost(result))
    if result[0] != env_worker.OK:
        return _failed(result[1])
    return None
