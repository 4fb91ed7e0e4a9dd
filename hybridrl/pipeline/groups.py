"""The source's book of prompt groups: which step and position each belongs to, which
producer works on it, its finished samples (``RequestOutput``s or ``Trajectory``s) and
its reward. Shared by the trainer's thread and the producers' result threads: every
access holds :attr:`GroupBook.cond`.

A sample's key is ``"{step}:{group}:{j}:{attempt}"``; ``attempt`` is bumped when a group is
regenerated (its worker died), so a late result of an abandoned attempt is ignored.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

from hybridrl.pipeline.work import finished_key


@dataclass
class Group:
    """One prompt's ``n`` samples or episodes, owned by one step."""

    step: int
    index: int  # position in the step's batch (refill rounds continue the count)
    row: int  # training-set row
    seed: int
    n: int
    attempt: int = 0
    producer: int | None = None
    outputs: dict = field(default_factory=dict)  # sample j -> RequestOutput | Trajectory
    reward: Future | None = None

    @property
    def finished(self) -> bool:
        return len(self.outputs) == self.n

    @property
    def done(self) -> bool:
        return self.finished and self.reward is not None and self.reward.done()

    def ordered(self) -> list:
        return [self.outputs[j] for j in range(self.n)]


class GroupBook:
    def __init__(self, n: int):
        self.n = n
        self.cond = threading.Condition()
        self.groups: dict[tuple[int, int], Group] = {}

    def open(self, step: int, first: int, rows: list[int], seeds: list[int]) -> list[Group]:
        """The groups ``first, first+1, ...`` of ``step`` (kept if already there: a restored
        finished group); returns those still to generate."""
        todo = []
        with self.cond:
            for g, (row, seed) in enumerate(zip(rows, seeds), start=first):
                group = self.groups.setdefault((step, g), Group(step=step, index=g, row=row, seed=seed, n=self.n))
                if not group.finished:
                    todo.append(group)
        return todo

    def assign(self, group: Group, producer: int) -> list[str]:
        """A (new) attempt of ``group`` on ``producer``; its samples' keys."""
        with self.cond:
            group.attempt += 1
            group.outputs.clear()
            group.producer = producer
            return [f"{group.step}:{group.index}:{j}:{group.attempt}" for j in range(self.n)]

    def collect(self, finished: list) -> list[Group]:
        """Record finished samples; returns the groups they completed."""
        complete = []
        with self.cond:
            for item in finished:
                step, g, j, attempt = map(int, finished_key(item).split(":"))
                group = self.groups.get((step, g))
                if group is None or group.attempt != attempt:
                    continue  # an abandoned attempt of a regenerated group
                group.outputs[j] = item
                if group.finished:
                    complete.append(group)
        return complete

    def load(self, producers: int) -> dict[int, int]:
        """Unfinished groups per producer."""
        load = {i: 0 for i in range(producers)}
        with self.cond:
            for g in self.groups.values():
                if g.producer is not None and not g.finished:
                    load[g.producer] = load.get(g.producer, 0) + 1
        return load

    def in_flight(self) -> bool:
        with self.cond:
            return any(g.producer is not None and not g.finished for g in self.groups.values())

    def unfinished_of(self, producer: int) -> list[Group]:
        with self.cond:
            return [g for g in self.groups.values() if g.producer == producer and not g.finished]

    def unfinished_in_step(self, step: int) -> int:
        with self.cond:
            return sum(not g.done for (s, _), g in self.groups.items() if s == step)

    def finished_count(self) -> int:
        with self.cond:
            return sum(g.done for g in self.groups.values())

    def informative(self, step: int, rounds: int, per_round: int) -> int | None:
        """None until the ``(rounds + 1) * per_round`` groups of ``step`` are all in and
        scored; then how many have differing rewards (DAPO: a flat group has no signal)."""
        with self.cond:
            groups = [self.groups.get((step, g)) for g in range((rounds + 1) * per_round)]
            if not all(g is not None and g.done for g in groups):
                return None
        return sum(len(set(g.reward.result().scores)) > 1 for g in groups)

    def pop_step(self, step: int) -> list[Group]:
        """``step``'s groups in draw order, out of the book."""
        with self.cond:
            keys = sorted(k for k in self.groups if k[0] == step)
            return [self.groups.pop(k) for k in keys]

    def finished_records(self) -> list[dict]:
        """Every finished untrained group, as plain values (a checkpoint's)."""
        with self.cond:
            return [{"step": g.step, "index": g.index, "row": g.row, "seed": g.seed,
                     "outputs": [_record(o) for o in g.ordered()]} for g in self.groups.values() if g.finished]


def restore_record(book: GroupBook, rec: dict) -> Group:
    """A finished group of a checkpoint back into ``book``."""
    group = Group(step=rec["step"], index=rec["index"], row=rec["row"], seed=rec["seed"], n=book.n)
    group.outputs = {j: _from_record(o) for j, o in enumerate(rec["outputs"])}
    with book.cond:
        book.groups[(group.step, group.index)] = group
    return group


def _record(o) -> dict:
    """Plain values only (checkpoints load with ``weights_only=True``)."""
    rec = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    if "tool_errors" in rec:  # a Trajectory's Counter
        rec["tool_errors"] = dict(rec["tool_errors"])
    return {"kind": type(o).__name__, **rec}


def _from_record(rec: dict):
    from hybridrl.agents.trajectory import Trajectory
    from hybridrl.rollout.requests import RequestOutput

    rec = dict(rec)
    kind = rec.pop("kind", "RequestOutput")
    if kind == "Trajectory":
        rec["tool_errors"] = Counter(rec["tool_errors"])
        return Trajectory(**rec)
    return RequestOutput(**rec)
