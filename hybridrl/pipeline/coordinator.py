"""The batch source of every run (``source.py``): admission, the buffer of finished
groups, the weight version, weights out to the producers, and what a checkpoint holds.

Every group (one prompt: ``n`` samples or ``n`` agent episodes) belongs to one step from
the moment it is drawn (``plan.py``) and is trained by exactly that step, whenever its
samples finish: the batch of step ``s`` is its groups in draw order (the synchronous
order). Groups are admitted to the producers by the staleness rule (``staleness.py``), so
the buffer holds at most ``max_staleness + 1`` steps of groups. Synchronous training is
this source at staleness 0 with one inline producer (the trainer's engine, stepped while
the trainer waits): the same code path, not a second one.

Publication: :meth:`publish` is the one place a weight version is decided (+1 per update;
restored from a checkpoint). It hands the version to the producers' engines with the
weights; an engine records it and nothing else writes it. ``partial=True`` (async)
refits the producers at once — their in-flight requests continue under the new weights;
otherwise (sync, one_step_off) a producer with work in flight is refit when the step's
groups are all in.

DAPO dynamic sampling is admission: when a step's groups are in and fewer than its quota
have differing rewards, another round of prompts is admitted for that step (up to
``algo.dapo.refill_rounds``), in every mode and on every rank for its own share.

Crash consistency: :meth:`state_dict` (taken between steps) holds the steps' RNG state
*before* the first untrained step, every finished group not yet trained, and the consumed
``(step, group, prompt)`` triples. A resumed run redraws the same steps, keeps the finished
groups and regenerates only the unfinished ones: every prompt is trained exactly once.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from hybridrl.checkpoint.train_state import python_rng_state, python_rng_tuple
from hybridrl.pipeline.groups import Group, GroupBook, restore_record
from hybridrl.pipeline.plan import Draw, PromptPlan
from hybridrl.pipeline.producers import ProducerError
from hybridrl.pipeline.source import Batch, Publication, SourceSettings
from hybridrl.pipeline.staleness import last_admissible_step, staleness_metrics


class Pipeline:
    """Producers fed by admission; :meth:`take` gives each step its batch."""

    def __init__(self, *, settings: SourceSettings, groups, local, make_producer: Callable,
                 weights: Callable[[torch.nn.Module], object], device: torch.device,
                 console: Callable[[str], None]):
        """``groups``: the kind of group (``tasks.py``). ``local``: the trainer's own
        ``RolloutWorker`` (eval, baselines; the inline producer's engine in sync mode).
        ``make_producer(i, sink, wake)``: producer ``i``. ``weights(model)``: what a producer
        is loaded from (the model, or its gathered tensors when the policy is sharded)."""
        self.s, self.task, self.local, self.make_producer = settings, groups, local, make_producer
        self.weights, self.device, self.console = weights, device, console
        self.n = groups.n
        self.book = GroupBook(self.n)
        self.producers: list = []
        self.consumed: list[tuple[int, int, int]] = []  # (step, group, training-set row), in training order
        self._cond = self.book.cond
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self._restored: dict | None = None
        self._last_progress = time.monotonic()
        self._idle_seen: dict[int, float] = {}
        self._publish_pending = False
        self._loaded = None  # what producers load from: refreshed at every publication
        self.plan: PromptPlan | None = None
        self.version = 0  # the policy's weight version: 0 = never published
        self.rounds: dict[int, int] = {}  # step -> refill rounds admitted (DAPO dynamic sampling)
        self.restarts_left = settings.restarts

    @property
    def started(self) -> bool:
        return self.plan is not None

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, model: torch.nn.Module, *, draw: Draw, rng: random.Random, first_step: int) -> None:
        """Producers up with the current publication; step ``first_step`` trains next, its
        prompts and every later step's drawn from ``rng`` as a synchronous run draws them."""
        self.next_step, self.base = first_step, self.version - first_step
        self.admitted_through = first_step - 1
        if self._restored is not None:
            self._restore(rng, first_step)
        self.plan = PromptPlan(draw, rng, first_step)
        if self._restored is not None:
            for rec in self._restored["finished"]:
                self._score(restore_record(self.book, rec))
            self.consumed = [tuple(x) for x in self._restored["consumed"].tolist()]
            self.rounds = {int(k): int(v) for k, v in self._restored.get("rounds", {}).items()}
            self.console(f"pipeline: {len(self._restored['finished'])} finished prompt groups restored from the "
                         f"checkpoint (the unfinished ones of steps {first_step}+ are generated again)")
            self._restored = None
        self._loaded = self.weights(model)
        for i in range(self.s.workers):
            self.producers.append(self._new_producer(i))
        self.console(self.s.describe())
        self._admit()

    def _restore(self, rng: random.Random, first_step: int) -> None:
        saved = self._restored
        if saved["next_step"] != first_step:
            raise ValueError(f"checkpoint: pipeline state is for step {saved['next_step']}, the run resumes at "
                             f"step {first_step}; the checkpoint is inconsistent, resume from an earlier one")
        rng.setstate(python_rng_tuple(saved["plan_rng"]))

    def close(self) -> None:
        for p in self.producers:
            p.close()
        self.producers = []
        self._scoring.shutdown(wait=False, cancel_futures=True)

    def _new_producer(self, i: int):
        p = self.make_producer(i, self._on_finished, self._wake)
        p.start(self._loaded, self.version)
        return p

    # ---- weights -------------------------------------------------------------------------
    def publish(self, model: torch.nn.Module) -> Publication:
        """``model`` is the next weight version (the warm start's, then one per update).
        Before :meth:`start` only the trainer's engine exists and takes it; then the
        producers do: now when ``partial`` or nothing is in flight, else when the step's
        groups are all in (the next :meth:`take`)."""
        self.version += 1
        if not self.started:
            return Publication(self.version, self.local.push(model, self.version).bytes_moved)
        self._loaded = self.weights(model)  # collective when sharded: every rank publishes together
        if self.s.partial or not self.book.in_flight():
            return Publication(self.version, self._refit_all())
        self._publish_pending = True
        return Publication(self.version, 0)

    def current_rollout(self, model: torch.nn.Module):
        """The trainer's own ``RolloutWorker`` holding the current version (eval, ReMax
        baselines): refit on demand when it is not the engine that generates the batches."""
        if self.version and self.local.version != self.version:
            self.local.push(model, self.version)
        return self.local

    def _refit_all(self) -> int:
        moved = 0
        for p in self.producers:
            try:
                stats = p.refit(self._loaded, self.version)
                moved += 0 if stats is None else stats.bytes_moved
            except ProducerError as e:
                p.failure = p.failure or str(e)
        self._replace_failed()
        self._last_progress = time.monotonic()
        self._admit()
        return moved

    # ---- admission -----------------------------------------------------------------------
    def version_of_step(self, step: int) -> int:
        return self.base + step

    def _admit(self) -> None:
        """Dispatch every group the staleness rule now allows (main thread)."""
        oldest = min(p.version for p in self.producers)
        last = last_admissible_step(oldest, base=self.base, max_staleness=self.s.max_staleness)
        todo = []
        for s in range(self.admitted_through + 1, last + 1):
            rows, seeds = self.plan.get(s)
            todo += self.book.open(s, 0, rows, seeds)
            self.admitted_through = s
        # one message per producer: a worker admits them together, in the synchronous order
        # (the batch a synchronous step decodes, so staleness 0 is bitwise synchronous)
        self._dispatch(todo)

    def _refill(self, step: int) -> None:
        """DAPO dynamic sampling: one more round of prompts for ``step``, drawn from a stream
        of its own (the step's first seed and the round), so the plan's draws stay those of
        a run without refills."""
        r = self.rounds.get(step, 0) + 1
        self.rounds[step] = r
        rows, seeds = self.plan.draw_extra(step, r)
        self._dispatch(self.book.open(step, r * self.s.groups_per_step, rows, seeds))

    def _dispatch(self, groups: list[Group]) -> None:
        """Send whole groups to the least-loaded producer (identical prompts share a prefill)."""
        load = self.book.load(len(self.producers))
        per: dict[int, list] = {}
        for group in groups:
            target = min(load, key=lambda i: (load[i], i))
            load[target] += 1
            keys = self.book.assign(group, target)
            per.setdefault(target, []).extend(self.task.work(group.row, group.seed, keys))
        for target, work in per.items():
            self.producers[target].submit(work)

    # ---- results (producer threads) ------------------------------------------------------
    def _on_finished(self, producer: int, finished: list) -> None:
        self._last_progress = time.monotonic()
        for group in self.book.collect(finished):
            self._score(group)
        self._wake()

    def _score(self, group: Group) -> None:
        group.reward = self._scoring.submit(self.task.score, group.row, group.ordered())
        group.reward.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- the trainer's calls (main thread) -------------------------------------------------
    def take(self, model: torch.nn.Module) -> Batch:
        """The batch of the next step: waits until its groups are generated and scored
        (replacing a dead producer on the way, within ``pipeline.worker_restarts``)."""
        if not self.started:
            raise RuntimeError("batch source: take() before start(); call RLStep.start(rng, first_step) once, after "
                               "the warm start or the resume")
        step = self.next_step
        t0 = time.perf_counter()
        inline = next((p for p in self.producers if getattr(p, "inline", False)), None)
        if inline is not None:
            inline.run_until(lambda: self._ready(step))
        while not self._ready(step):
            self._replace_failed()
            with self._cond:
                self._cond.wait(timeout=0.5)
            self._check_stall(step)
        waited = time.perf_counter() - t0
        groups = self.book.pop_step(step)
        sb = self.task.assemble([g.row for g in groups], [g.ordered() for g in groups],
                                [g.reward.result() for g in groups], self.device)
        metrics = self._metrics(step, sb, waited)
        self.consumed.extend((step, g.index, g.row) for g in groups)
        self.rounds.pop(step, None)
        self.next_step += 1
        self.plan.forget_before(self.next_step)
        if inline is not None and not self.book.in_flight():
            inline.release_memory()  # sampling is done until the refit (rollout.free_cache_engine)
        if self._publish_pending:  # every admitted group is in; the producers take the weights now
            self._publish_pending = False
            self._refit_all()
        return Batch(sb, metrics, stale=metrics.get("async/staleness_max", 0.0) > 0)

    def _ready(self, step: int) -> bool:
        """Whether ``step``'s groups are all in and scored, admitting a refill round when
        dynamic sampling needs one (``take``'s loop, main thread)."""
        informative = self.book.informative(step, self.rounds.get(step, 0), self.s.groups_per_step)
        if informative is None:
            return False
        rounds = self.rounds.get(step, 0)
        if self.s.dynamic_sampling and informative < self.s.groups_per_step and self.s.refill_rounds:
            if rounds < self.s.refill_rounds:
                self._refill(step)
                return False
            self.console(f"step {step}: dynamic sampling found {informative} of {self.s.groups_per_step} informative "
                         f"prompt groups after {rounds} refill rounds (algo.dapo.refill_rounds={self.s.refill_rounds});"
                         " training on those (raise refill_rounds, or check the reward)")
        return True

    def _metrics(self, step: int, sb, waited: float) -> dict[str, float]:
        ro = sb.rollouts
        st = staleness_metrics(ro.token_versions, ro.response_mask, self.version_of_step(step), self.s.max_staleness)
        out = {"batch/refill_rounds": float(self.rounds.get(step, 0))} if self.s.dynamic_sampling else {}
        if not self.s.overlapped:
            return out  # the trainer's own engine: the bound (0) is checked, nothing else to report
        buffered = self.book.finished_count()
        capacity = (self.s.max_staleness + 1) * self.s.groups_per_step
        out.update(st)
        out.update({"async/trainer_idle_s": waited, "async/buffer_groups": float(buffered),
                    "async/buffer_fill": buffered / capacity})
        for p in self.producers:
            out[f"async/worker{p.index}_idle_s"] = p.idle_seconds - self._idle_seen.get(p.index, 0.0)
            self._idle_seen[p.index] = p.idle_seconds
        return out

    def _check_stall(self, step: int) -> None:
        stalled = time.monotonic() - self._last_progress
        if stalled > self.s.timeout_s:
            missing = self.book.unfinished_in_step(step)
            raise ProducerError(f"step {step} waits for {missing} prompt groups and no rollout worker finished "
                                f"a sample for {stalled:.0f} s (pipeline.timeout_s={self.s.timeout_s:g}); a worker "
                                "is stuck or far too slow: raise pipeline.timeout_s or lower rollout.max_tokens")

    def _replace_failed(self) -> None:
        for i, p in enumerate(self.producers):
            if p.failure is None:
                continue
            if self.restarts_left == 0:
                raise ProducerError(f"{p.failure}; pipeline.worker_restarts={self.s.restarts} used up, the job stops "
                                    "(see the worker's output above, or raise pipeline.worker_restarts)")
            self.restarts_left -= 1
            lost = self.book.unfinished_of(i)
            self.console(f"{p.failure}; replacing it ({self.s.restarts - self.restarts_left} of {self.s.restarts} "
                         f"restarts), its {len(lost)} unfinished prompt groups are generated again")
            p.close()
            self.producers[i] = self._new_producer(i)
            self._idle_seen.pop(i, None)
            self._dispatch(lost)
            self._last_progress = time.monotonic()

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Between steps: the version, the RNG before the next step, finished untrained
        groups, refill rounds, consumed ids. Before :meth:`start`: the version only."""
        if not self.started:
            return {"version": self.version}
        return {"next_step": self.next_step, "version": self.version,
                "plan_rng": python_rng_state(self.plan.state_before(self.next_step)),
                "finished": self.book.finished_records(), "rounds": dict(self.rounds),
                "consumed": torch.tensor(self.consumed, dtype=torch.long).reshape(-1, 3)}

    def load_state_dict(self, state: dict) -> None:
        """Restore before :meth:`start` (which redraws the plan from the saved RNG)."""
        self.version = int(state["version"])
        self._restored = state if "next_step" in state else None

