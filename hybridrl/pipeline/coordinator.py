"""The trainer's side of an overlapped run: admission, the buffer of finished groups,
weights out to the producers, and what a checkpoint must hold.

Every group (one prompt, ``n`` samples) belongs to one step from the moment it is drawn
(``plan.py``) and is trained by exactly that step, whenever its samples finish: the batch
of step ``s`` is its ``prompts_per_step`` groups in draw order (the synchronous order).
Groups are admitted to the producers by the staleness rule (``staleness.py``), so the
buffer holds at most ``max_staleness + 1`` steps of groups.

Modes: ``partial=True`` (async) refits the producers as soon as an update is published —
their in-flight requests continue under the new weights; ``partial=False``
(one_step_off) refits them only between batches, when the step's groups are all in.

Crash consistency: :meth:`state_dict` (taken between steps) holds the steps' RNG state
*before* the first untrained step, every finished group not yet trained (tokens,
log-probs, versions), and the consumed ``(step, group, prompt)`` triples. A resumed run
redraws the same steps, keeps the finished groups and regenerates only the unfinished
ones: every prompt is trained exactly once, none lost, none twice.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from hybridrl.checkpoint.train_state import python_rng_state, python_rng_tuple
from hybridrl.pipeline.plan import Draw, PromptPlan
from hybridrl.pipeline.producers import ProducerError
from hybridrl.pipeline.staleness import last_admissible_step, staleness_metrics
from hybridrl.rewards import RewardBatch
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backend import request_seed
from hybridrl.rollout.requests import RequestOutput
from hybridrl.rollout.rollouts import Rollouts, rollouts_from_outputs, rollouts_to_device


@dataclass
class Group:
    """One prompt's ``n`` samples, owned by one step."""

    step: int
    index: int  # position in the step's batch
    row: int  # training-set row
    seed: int
    attempt: int = 0  # bumped when regenerated (a worker died): older attempts' outputs are ignored
    producer: int | None = None
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # sample j -> output
    reward: Future | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.step, self.index


@dataclass
class Batch:
    """What a step takes: its rows, rollouts (trainer device), rewards and pipeline metrics."""

    batch_idx: list[int]
    rollouts: Rollouts
    rewards: RewardBatch
    metrics: dict[str, float]
    stale: bool  # some token was sampled with an older version than the one training it


class Pipeline:
    """Producers fed by admission; :meth:`take` gives each step its batch."""

    def __init__(self, *, make_producer: Callable[[int, Callable, Callable], object], workers: int, train_set,
                 score: Callable[[list[list[int]], list, list[str]], RewardBatch], sampling: SamplingParams,
                 prompts_per_step: int, max_staleness: int, partial: bool, timeout_s: float, restarts: int,
                 pad_id: int, device: torch.device, console: Callable[[str], None], placement: str = ""):
        self.make_producer, self.workers, self.placement = make_producer, workers, placement
        self.train_set, self.score, self.sampling = train_set, score, sampling
        self.n, self.prompts_per_step = sampling.n, prompts_per_step
        self.max_staleness, self.partial = max_staleness, partial
        self.timeout_s, self.restarts_left, self.restarts = timeout_s, restarts, restarts
        self.pad_id, self.device, self.console = pad_id, device, console
        self.producers: list = []
        self.groups: dict[tuple[int, int], Group] = {}
        self.consumed: list[tuple[int, int, int]] = []  # (step, group, training-set row), in training order
        self._cond = threading.Condition()
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self._restored: dict | None = None
        self._last_progress = time.monotonic()
        self._idle_seen: dict[int, float] = {}
        self._publish_pending = False
        self.plan: PromptPlan | None = None
        self.version: int | None = None  # the trainer's weight version, from start() on

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, model: torch.nn.Module, *, draw: Draw, rng: random.Random, version: int, first_step: int) -> None:
        """Producers up with ``model`` (weights ``version``, trained at ``first_step``), then
        the first admissions."""
        self.version, self.next_step, self.base = version, first_step, version - first_step
        self.admitted_through = first_step - 1
        if self._restored is not None:
            saved = self._restored
            if saved["next_step"] != first_step:
                raise ValueError(f"checkpoint: pipeline state is for step {saved['next_step']}, the run resumes at "
                                 f"step {first_step}; the checkpoint is inconsistent, resume from an earlier one")
            rng.setstate(python_rng_tuple(saved["plan_rng"]))
        self.plan = PromptPlan(draw, rng, first_step)
        if self._restored is not None:
            for rec in self._restored["finished"]:
                self._restore_group(rec)
            self.consumed = [tuple(x) for x in self._restored["consumed"].tolist()]
            self.console(f"pipeline: {len(self._restored['finished'])} finished prompt groups restored from the "
                         f"checkpoint (the unfinished ones of steps {first_step}+ are generated again)")
            self._restored = None
        for i in range(self.workers):
            self.producers.append(self._new_producer(i, model, version))
        mode = "async (partial rollouts)" if self.partial else "one_step_off"
        self.console(f"pipeline: {mode}, max_staleness {self.max_staleness}, {self.workers} rollout worker(s)"
                     f"{' as ' + self.placement if self.placement else ''}")
        self._admit()

    def close(self) -> None:
        for p in self.producers:
            p.close()
        self.producers = []
        self._scoring.shutdown(wait=False, cancel_futures=True)

    def _new_producer(self, i: int, model: torch.nn.Module, version: int):
        p = self.make_producer(i, self._on_finished, self._wake)
        p.start(model, version)
        return p

    # ---- admission -----------------------------------------------------------------------
    def version_of_step(self, step: int) -> int:
        return self.base + step

    def _admit(self) -> None:
        """Dispatch every group the staleness rule now allows (main thread)."""
        oldest = min(p.version for p in self.producers)
        last = last_admissible_step(oldest, base=self.base, max_staleness=self.max_staleness)
        todo = []
        for s in range(self.admitted_through + 1, last + 1):
            batch_idx, seeds = self.plan.get(s)
            for g, (row, seed) in enumerate(zip(batch_idx, seeds)):
                group = self.groups.get((s, g))
                if group is None:
                    group = self.groups[(s, g)] = Group(step=s, index=g, row=row, seed=seed)
                if len(group.outputs) < self.n:  # (a restored finished group is not generated again)
                    todo.append(group)
            self.admitted_through = s
        # one message per producer: a worker admits them together, in the synchronous order
        # (the batch a synchronous step decodes, so staleness 0 is bitwise synchronous)
        self._dispatch(todo)

    def _dispatch(self, groups: list[Group]) -> None:
        """Send whole groups to the least-loaded producer (identical prompts share a prefill)."""
        load = {i: 0 for i in range(len(self.producers))}
        with self._cond:
            for g in self.groups.values():
                if g.producer is not None and len(g.outputs) < self.n:
                    load[g.producer] = load.get(g.producer, 0) + 1
        per: dict[int, list] = {}
        for group in groups:
            target = min(load, key=lambda i: (load[i], i))
            load[target] += 1
            with self._cond:
                group.attempt += 1
                group.outputs.clear()
                group.producer = target
            prompt = self.train_set.prompts[group.row]
            per.setdefault(target, []).extend(
                (f"{group.step}:{group.index}:{j}:{group.attempt}", prompt,
                 dataclasses.replace(self.sampling, n=1, seed=request_seed(group.seed, j))) for j in range(self.n))
        for target, requests in per.items():
            self.producers[target].submit(requests)

    # ---- results (producer threads) ------------------------------------------------------
    def _on_finished(self, producer: int, outputs: list[RequestOutput]) -> None:
        with self._cond:
            self._last_progress = time.monotonic()
            for out in outputs:
                step, g, j, attempt = map(int, out.request_id.split(":"))
                group = self.groups.get((step, g))
                if group is None or group.attempt != attempt:
                    continue  # an abandoned attempt of a regenerated group
                group.outputs[j] = out
                if len(group.outputs) == self.n:
                    self._score_group(group)
            self._cond.notify_all()

    def _score_group(self, group: Group) -> None:
        outs = [group.outputs[j] for j in range(self.n)]
        t = self.train_set
        group.reward = self._scoring.submit(self.score, [o.token_ids for o in outs], [t.answers[group.row]] * self.n,
                                            [t.prompt_texts[group.row]] * self.n)
        group.reward.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- the trainer's calls (main thread) -------------------------------------------------
    def take(self, model: torch.nn.Module) -> Batch:
        """The batch of the next step: waits until its groups are generated and scored
        (replacing a dead producer on the way, within ``pipeline.restarts``)."""
        step = self.next_step
        keys = [(step, g) for g in range(self.prompts_per_step)]
        t0 = time.perf_counter()
        while True:
            self._replace_failed(model)
            with self._cond:
                if all(self._done(self.groups[k]) for k in keys):
                    break
                self._cond.wait(timeout=0.5)
                stalled = time.monotonic() - self._last_progress
            if stalled > self.timeout_s:
                missing = sum(not self._done(self.groups[k]) for k in keys)
                raise ProducerError(f"step {step} waits for {missing} prompt groups and no rollout worker finished "
                                    f"a sample for {stalled:.0f} s (pipeline.timeout_s={self.timeout_s:g}); a worker "
                                    "is stuck or far too slow: raise pipeline.timeout_s or lower rollout.max_tokens")
        waited = time.perf_counter() - t0
        with self._cond:
            groups = [self.groups.pop(k) for k in keys]
            buffered = sum(self._done(g) for g in self.groups.values())
        outputs = [g.outputs[j] for g in groups for j in range(self.n)]
        ro = rollouts_to_device(rollouts_from_outputs(outputs, self.pad_id), self.device)
        rewards = RewardBatch.concat([g.reward.result() for g in groups])
        metrics = staleness_metrics(ro.token_versions, ro.response_mask, self.version_of_step(step),
                                    self.max_staleness)
        capacity = (self.max_staleness + 1) * self.prompts_per_step
        metrics.update({"async/trainer_idle_s": waited, "async/buffer_groups": float(buffered),
                        "async/buffer_fill": buffered / capacity})
        for p in self.producers:
            metrics[f"async/worker{p.index}_idle_s"] = p.idle_seconds - self._idle_seen.get(p.index, 0.0)
            self._idle_seen[p.index] = p.idle_seconds
        self.consumed.extend((step, g.index, g.row) for g in groups)
        self.next_step += 1
        self.plan.forget_before(self.next_step)
        if self._publish_pending:  # one_step_off: every admitted group is in; the producers take the weights now
            self._publish_pending = False
            self._refit_all(model)
            self._admit()
        return Batch([g.row for g in groups], ro, rewards, metrics, stale=metrics["async/staleness_max"] > 0)

    def publish(self, model: torch.nn.Module) -> None:
        """``model`` is the next weight version (after an update): async refits the producers
        now (in-flight requests go on under it) and admits what it allows; one_step_off
        refits them between batches, at the next :meth:`take`."""
        self.version += 1
        if self.partial:
            self._refit_all(model)
            self._admit()
        else:
            self._publish_pending = True

    def _refit_all(self, model: torch.nn.Module) -> None:
        for p in self.producers:
            try:
                p.refit(model, self.version)
            except ProducerError as e:
                p.failure = p.failure or str(e)
        self._replace_failed(model)
        self._last_progress = time.monotonic()

    def _replace_failed(self, model: torch.nn.Module) -> None:
        for i, p in enumerate(self.producers):
            if p.failure is None:
                continue
            if self.restarts_left == 0:
                raise ProducerError(f"{p.failure}; pipeline.worker_restarts={self.restarts} used up, the job stops "
                                    "(see the worker's output above, or raise pipeline.worker_restarts)")
            self.restarts_left -= 1
            with self._cond:
                lost = [g for g in self.groups.values() if g.producer == i and len(g.outputs) < self.n]
            self.console(f"{p.failure}; replacing it ({self.restarts - self.restarts_left} of {self.restarts} "
                         f"restarts), its {len(lost)} unfinished prompt groups are generated again")
            p.close()
            self.producers[i] = self._new_producer(i, model, self.version)
            self._idle_seen.pop(i, None)
            self._dispatch(lost)
            self._last_progress = time.monotonic()

    def _done(self, group: Group) -> bool:
        return len(group.outputs) == self.n and group.reward is not None and group.reward.done()

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Between steps: the RNG before the next step, finished untrained groups, consumed ids."""
        with self._cond:
            finished = [g for g in self.groups.values() if len(g.outputs) == self.n]
            records = [{"step": g.step, "index": g.index, "row": g.row, "seed": g.seed,
                        "outputs": [_output_record(g.outputs[j]) for j in range(self.n)]} for g in finished]
        return {"next_step": self.next_step, "version": self.version,
                "plan_rng": python_rng_state(self.plan.state_before(self.next_step)), "finished": records,
                "consumed": torch.tensor(self.consumed, dtype=torch.long).reshape(-1, 3)}

    def load_state_dict(self, state: dict) -> None:
        """Restore before :meth:`start` (which redraws the plan from the saved RNG)."""
        self._restored = state

    def _restore_group(self, rec: dict) -> None:
        group = Group(step=rec["step"], index=rec["index"], row=rec["row"], seed=rec["seed"])
        group.outputs = {j: RequestOutput(**o) for j, o in enumerate(rec["outputs"])}
        self.groups[group.key] = group
        self._score_group(group)


def _output_record(o: RequestOutput) -> dict:
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
