"""The staleness bound holds whatever the timing: the real coordinator (``Pipeline``)
driven by producers that generate at random speeds (long tails included, one token per
tick stamped with the producer's version at that tick: partial rollouts across refits)
and a trainer that takes random time per step. Independent check: every trained token's
lag ``version trained - version sampled`` is recomputed here from the raw outputs."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hybridrl.pipeline.coordinator import Pipeline
from hybridrl.pipeline.plan import PromptPlan
from hybridrl.pipeline.source import SourceSettings
from hybridrl.pipeline.tasks import SingleTurnGroups
from hybridrl.rewards import RewardBatch
from hybridrl.rollout import SamplingParams
from hybridrl.trainer.prompts import PromptSet
from hybridrl.rollout.requests import RequestOutput


class RandomSpeedProducer:
    """Generates every admitted request one token per tick (random tick length), each token
    stamped with the version this producer holds at that tick."""

    def __init__(self, index, sink, wake, rng: random.Random):
        self.index, self.sink, self.rng = index, sink, rng
        self.version, self.failure, self.idle_seconds = None, None, 0.0
        self.lock = threading.Lock()
        self.active: list[dict] = []
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self, model, version):
        self.version = version
        self.thread.start()

    def submit(self, work):
        with self.lock:
            for w in work:  # SampleWork: one sample of a prompt
                tail = self.rng.random() < 0.1  # a long-tailed answer now and then
                self.active.append({"rid": w.key, "prompt": w.prompt, "tokens": [], "versions": [],
                                    "length": self.rng.randint(20, 60) if tail else self.rng.randint(1, 8)})

    def refit(self, model, version):
        time.sleep(self.rng.random() * 0.002)
        with self.lock:
            self.version = version

    def close(self):
        self.stop = True
        self.thread.join(timeout=10)

    def run(self):
        while not self.stop:
            time.sleep(self.rng.random() * 0.0005)
            done = []
            with self.lock:
                for r in self.active:
                    r["tokens"].append(5)
                    r["versions"].append(self.version)
                done = [r for r in self.active if len(r["tokens"]) == r["length"]]
                self.active = [r for r in self.active if len(r["tokens"]) < r["length"]]
            if done:
                self.sink(self.index, [RequestOutput(r["rid"], r["prompt"], r["tokens"], [-1.0] * r["length"],
                                                     r["versions"], True, "stop") for r in done])


def score(responses, answers, texts):
    return RewardBatch(scores=[float(len(r) % 2) for r in responses])


class TrainerEngine:
    """The trainer's own engine (the source's ``local``): only takes the publications
    made before the source starts."""

    def __init__(self):
        self.version = 0

    def push(self, model, version):
        self.version = version
        return SimpleNamespace(bytes_moved=0)


def draw_for(train_size: int, prompts_per_step: int):
    def draw(rng):
        rows = rng.sample(range(train_size), prompts_per_step)
        return rows, [rng.randrange(2**62) for _ in rows]
    return draw


@pytest.mark.parametrize("max_staleness,partial,workers", [(0, True, 1), (1, True, 2), (2, True, 1), (3, True, 2),
                                                          (1, False, 1)])
def test_no_trained_token_is_staler_than_the_bound(max_staleness: int, partial: bool, workers: int) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    P, n, steps, train_size = 3, 2, 10, 50
    train_set = PromptSet([[i % 7 + 1, 3] for i in range(train_size)], [None] * train_size, [""] * train_size)
    settings = SourceSettings(overlapped=True, groups_per_step=P,
                              max_staleness=max_staleness, partial=partial, workers=workers, timeout_s=60, restarts=0)
    groups = SingleTurnGroups(train_set, SimpleNamespace(score=score), SamplingParams(n=n, max_tokens=64), pad_id=0)
    pipe = Pipeline(settings=settings, groups=groups, local=TrainerEngine(),
                    make_producer=lambda i, sink, wake: RandomSpeedProducer(i, sink, wake, random.Random(rng.random())),
                    weights=lambda model: model, device=torch.device("cpu"), console=print)
    draw = draw_for(train_size, P)
    start_version = 7
    for _ in range(start_version):  # the source decides the versions: the run starts at the 7th publication
        pipe.publish(None)
    pipe.start(None, draw=draw, rng=random.Random(seed + 1), first_step=1)
    reference = PromptPlan(draw, random.Random(seed + 1), 1)
    try:
        stale_seen = 0
        for step in range(1, steps + 1):
            batch = pipe.take(None)
            sb = batch.step_batch
            trained_at = start_version + step - 1
            assert pipe.version == trained_at
            tv, mask = sb.rollouts.token_versions, sb.rollouts.response_mask.bool()
            lags = (trained_at - tv[mask]).tolist()
            assert lags and max(lags) <= max_staleness and min(lags) >= 0, (seed, step, sorted(set(lags)))
            assert batch.metrics["async/staleness_max"] == max(lags)
            assert batch.stale == (max(lags) > 0)
            if not partial:  # one_step_off: a batch is generated under one version
                assert len(set(tv[mask].tolist())) == 1, (seed, step)
            stale_seen += max(lags) > 0
            assert sb.batch_idx == reference.get(step)[0]  # the step's own prompts, in draw order
            assert batch.metrics["async/buffer_groups"] <= max_staleness * P  # throttled, never more
            time.sleep(rng.random() * 0.01)  # training takes a while
            assert pipe.publish(None).version == trained_at + 1
        if max_staleness > 0:
            assert stale_seen > 0, "the run never overlapped: the test did not exercise the bound"
        assert [row for _, _, row in pipe.consumed] == [r for s in range(1, steps + 1) for r in reference.get(s)[0]]
    finally:
        pipe.close()


def test_a_resumed_plan_redraws_exactly_the_untrained_steps() -> None:
    """The RNG state saved before a step redraws it and every later one, even when the plan
    had already drawn ahead (what a checkpoint of an async run must not get wrong)."""
    draw = draw_for(100, 4)
    rng = random.Random(random.randrange(2**31))
    plan = PromptPlan(draw, rng, 1)
    drawn = [plan.get(s) for s in range(1, 9)]  # drawn ahead to step 8
    saved = plan.state_before(4)
    plan.forget_before(4)
    resumed = random.Random()
    resumed.setstate(saved)
    again = PromptPlan(draw, resumed, 4)
    assert [again.get(s) for s in range(4, 9)] == drawn[3:]
    with pytest.raises(KeyError, match="already trained"):
        plan.get(2)
