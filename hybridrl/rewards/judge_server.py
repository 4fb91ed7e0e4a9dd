"""The judge's engine on one server thread, fed by a request queue.

Callers (one reward batch, or several groups scored from several threads) ``submit`` token
ids and get a ``Ticket``; the server thread alone touches the engine. Each turn of its loop
it takes every request that arrived, adds it to the engine at once (``add_request`` while
others are decoding: continuous batching), drops the ones past their deadline, and runs one
engine ``step`` (greedy: what a request answers does not depend on who it ran beside).
Idle, it blocks on the queue.

Two modes, fixed at construction:

- **generate**: each request decodes greedily to its stop token or ``max_tokens``; the
  result is the generated token ids. When every prompt starts with the same tokens
  (template head, rubric, chat header), that prefix is prefilled once as a retained
  request (``retain=True``) and every request names it as ``parent``: the built-in
  engine copies the parent's KV into the new row and prefills only the rest
  (``rollout/core/prefix_cache.py``: the compute is shared, the KV is copied per row; its
  slot cache has no shared blocks), vLLM's automatic prefix cache reuses it by itself.
- **score**: one forward (``engine.logits``, no sampling) of each prompt; the result is
  the last position's logits at ``score_ids``. The prompts that arrived together run as
  one right-padded batch.

Failures cost the request only, as a ``RewardFailure`` the reward puts in its result list:
past its deadline (measured from ``submit``) it is "judge timeout" — the caller stops
waiting even when the engine is stuck inside a step, and the server aborts it to free its
row; an engine exception is "judge crashed" for every request in the engine at the time,
and the server builds a fresh engine (``make_engine``) for the next ones (if that fails too,
every later request fails at once). ``close`` stops the thread (also at garbage collection
of the owning reward, through ``weakref.finalize``) without waiting on a stuck engine.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridrl.rewards.outcome import RewardFailure, explain

TIMEOUT = "judge timeout"
CRASHED = "judge crashed"
CLOSED = "judge closed"
LOGITS_BYTES = 256 << 20  # score mode: the [B, S, V] float32 logits of one forward stay under this
_CLOSE = object()  # the queue's stop sentinel


@dataclass
class Ticket:
    """One submitted request: its result arrives in ``future``; ``deadline`` is ``time.monotonic()``."""

    request_id: str
    token_ids: list[int]
    deadline: float
    timeout_s: float
    future: Future = field(default_factory=Future)


def _settle(ticket: Ticket, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve a ticket unless its caller already gave up on it (cancelled)."""
    try:
        if error is not None:
            ticket.future.set_exception(error)
        else:
            ticket.future.set_result(value)
    except InvalidStateError:
        pass


class JudgeServer:
    def __init__(self, make_engine: Callable[[], Any], *, params=None, score_ids: tuple[int, ...] = (),
                 shared_prefix: list[int] = (), name: str = "judge"):
        """``make_engine()``: builds the engine (now, and again after a crash). ``params``: the
        ``SamplingParams`` of generate mode; ``score_ids``: the token ids of score mode (one
        of the two). ``shared_prefix``: the token ids every generate prompt starts with."""
        assert (params is None) != (not score_ids), "JudgeServer: give params (generate) or score_ids (score)"
        self._make_engine, self.params, self.score_ids = make_engine, params, tuple(score_ids)
        self.shared_prefix = list(shared_prefix)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._running: dict[str, Ticket] = {}  # generate mode: in the engine
        self._scores: list[Ticket] = []  # score mode: waiting for the next forward
        self._broken: str | None = None  # why no engine could be rebuilt
        self._closed = threading.Event()
        self.engine = make_engine()  # the caller's thread: a bad checkpoint is the caller's error
        self.parent = self._warm(self.engine, 0)
        self.stats = {"restarts": 0, "steps": 0, "timeouts": 0}
        self._thread = threading.Thread(target=self._serve, name=f"{name}-server", daemon=True)
        self._thread.start()

    # ---- callers' side -------------------------------------------------------------------
    def submit(self, token_ids: list[int], timeout_s: float) -> Ticket:
        """Queue one prompt; its deadline is ``timeout_s`` from now."""
        now = time.monotonic()
        ticket = Ticket(f"judge-{next(self._ids)}", list(token_ids), now + timeout_s, timeout_s)
        if self._closed.is_set():
            _settle(ticket, error=RewardFailure(CLOSED, "the judge was closed; build a new one"))
        elif self._broken is not None:
            _settle(ticket, error=RewardFailure(CRASHED, self._broken))
        else:
            self._inbox.put(ticket)
        return ticket

    def result(self, ticket: Ticket) -> Any:
        """The ticket's result, or raises its ``RewardFailure`` (at the latest at its deadline)."""
        try:
            return ticket.future.result(timeout=max(0.0, ticket.deadline - time.monotonic()))
        except FutureTimeout:
            ticket.future.cancel()  # the server drops it (and frees its row) at its next turn
            raise RewardFailure(TIMEOUT, f"no answer within {ticket.timeout_s:g} s of submission; raise the "
                                         "judge's timeout_s or lower its max_tokens") from None

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the server thread (idempotent). Requests still queued fail "judge closed"; a
        thread stuck inside an engine call is left behind (a daemon: it cannot hold up exit)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._inbox.put(_CLOSE)
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    # ---- the server thread ---------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while self._take(block=not (self._running or self._scores)):
                try:
                    self._expire(time.monotonic())
                    if self._scores:
                        self._score()
                    if self._running:
                        self._step()
                except Exception as e:  # noqa: BLE001 - the engine failed: its requests do, the server goes on
                    self._crash(e)
        finally:
            self._fail_pending(RewardFailure(CLOSED, "the judge was closed while this request was pending"),
                               queued=True)
            self._close_engine(self.engine)

    def _take(self, block: bool) -> bool:
        """Admit every request that arrived (waiting for one when ``block``); False on close."""
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _CLOSE:
                return False
            self._admit(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, ticket: Ticket) -> None:
        if ticket.future.done():  # its caller stopped waiting before it got here
            return
        if self._broken is not None:
            _settle(ticket, error=RewardFailure(CRASHED, self._broken))
        elif self.score_ids:
            self._scores.append(ticket)
        else:
            try:
                self.engine.add_request(ticket.request_id, ticket.token_ids, self.params, parent=self.parent)
            except Exception as e:  # noqa: BLE001 - this request only: the engine refused or failed on it
                _settle(ticket, error=RewardFailure(CRASHED, explain(e)))
                return
            self._running[ticket.request_id] = ticket

    def _expire(self, now: float) -> None:
        for rid, ticket in list(self._running.items()):
            if ticket.deadline <= now or ticket.future.done():
                del self._running[rid]
                self.stats["timeouts"] += 1
                self.engine.abort(rid)
                _settle(ticket, error=RewardFailure(TIMEOUT, f"aborted {ticket.timeout_s:g} s after submission"))
        live = [t for t in self._scores if t.deadline > now and not t.future.done()]
        for t in self._scores:
            if t not in live:
                _settle(t, error=RewardFailure(TIMEOUT, f"not scored within {t.timeout_s:g} s of submission"))
        self._scores = live

    def _step(self) -> None:
        out = self.engine.step()
        self.stats["steps"] += 1
        for r in out.finished:
            ticket = self._running.pop(r.request_id, None)
            if ticket is not None:
                _settle(ticket, list(r.token_ids))

    def _score(self) -> None:
        """One right-padded forward per chunk of the waiting prompts; each row's last logits at
        ``score_ids``. (A crash fails the whole list: the rows already answered ignore it.)"""
        import torch

        batch, vocab, i = self._scores, int(self.engine.config.vocab_size), 0
        while i < len(batch):
            longest = max(len(t.token_ids) for t in batch[i:])
            rows = max(1, min(len(batch) - i, LOGITS_BYTES // (4 * vocab * longest)))
            chunk, i = batch[i:i + rows], i + rows
            S = max(len(t.token_ids) for t in chunk)
            ids = torch.zeros(len(chunk), S, dtype=torch.long)
            mask = torch.zeros(len(chunk), S, dtype=torch.long)
            for r, t in enumerate(chunk):
                ids[r, :len(t.token_ids)] = torch.tensor(t.token_ids)
                mask[r, :len(t.token_ids)] = 1
            logits = self.engine.logits(ids, mask)  # [B, S, V] float32
            last = mask.sum(1).to(logits.device) - 1
            picked = logits[torch.arange(len(chunk), device=logits.device), last][:, list(self.score_ids)]
            for t, row in zip(chunk, picked.tolist()):
                _settle(t, row)
        self._scores = []

    def _crash(self, error: Exception) -> None:
        """Fail every request in the engine, then a fresh engine for the next ones."""
        self._fail_pending(RewardFailure(CRASHED, explain(error)))
        self._close_engine(self.engine)
        try:
            self.engine = self._make_engine()
            self.parent = self._warm(self.engine, self.stats["restarts"] + 1)
            self.stats["restarts"] += 1
        except Exception as e:  # noqa: BLE001
            self._broken = f"the engine failed ({explain(error)}) and could not be rebuilt: {explain(e)}"

    def _fail_pending(self, failure: RewardFailure, queued: bool = False) -> None:
        """Fail the requests in the engine (and, ``queued``, those not yet taken from the queue)."""
        for ticket in [*self._running.values(), *self._scores]:
            _settle(ticket, error=failure)
        self._running, self._scores = {}, []
        while queued:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _CLOSE:
                _settle(item, error=failure)

    def _warm(self, engine, generation: int) -> str | None:
        """Prefill the shared prefix once as a retained request; its id (the requests' parent), or None."""
        prefix = self.shared_prefix
        if self.score_ids or len(prefix) < 2 or len(prefix) >= engine.max_seq_len - 1:
            return None
        from hybridrl.rollout.sampling_params import SamplingParams

        rid = f"judge-prefix-{generation}"
        engine.add_request(rid, prefix, SamplingParams(temperature=0.0, max_tokens=1), retain=True)
        while not any(r.request_id == rid for r in engine.step().finished):
            pass
        return rid

    @staticmethod
    def _close_engine(engine) -> None:
        close = getattr(engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - a broken engine may not close cleanly; it is dropped anyway
                pass
