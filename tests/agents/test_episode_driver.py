"""Episodes on an engine stepped by someone else (``agents/episode_driver.py``), with real
engines and real environment worker processes:

- the runner, now a loop over the driver, makes exactly the engine calls and trajectories of
  the synchronous runner it replaced (``reference_runner.py``), environment calls' order included;
- overlapped environment calls give the episodes of the synchronous ones (each episode's
  tokens depend only on its own seeds and environment) while the engine keeps stepping;
- a lockstep follower without environments makes the leader's episodes exactly, and raises
  with the leader when the leader's env pool itself breaks;
- an environment that raises, hangs or dies costs its episode only; abort() or an engine
  error mid-run leaves nothing of the driver in a shared engine, which serves on.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
from pathlib import Path

import pytest
import torch

from hybridrl.agents.chat_render import ChatRenderer
from hybridrl.agents.env_pool import EnvPool
from hybridrl.agents.episode_driver import EpisodeDriver, EpisodeLimits
from hybridrl.agents.episodes import EpisodeRunner
from hybridrl.agents.types import EnvStep
from hybridrl.rollout import SamplingParams
from tests.agents import reference_runner
from tests.agents.tiny_agent import EchoEnv, Recording, tiny_engine

TURNS = f"{Path(__file__).resolve().parent / 'driver_envs.py'}:Turns"
SAMPLING = SamplingParams(temperature=1.0, max_tokens=24)


def produce(engine, driver, other: set[str] = frozenset(), on_step=None) -> list:
    """A producer's loop: step the engine (the driver's requests and ``other`` ones) or wait for
    the environments; the episodes in the order they ended."""
    ended, other = [], set(other)
    while driver.live or other:
        if engine.has_unfinished_requests():
            if on_step is not None:
                on_step()
            finished = engine.step().finished
            other -= {o.request_id for o in finished}
        else:
            driver.wait_env(0.05)
            finished = []
        ended += driver.advance(finished)
    return ended


def fields(t) -> dict:
    """A trajectory's content (its environment's timing aside)."""
    d = dataclasses.asdict(t)
    d.pop("env_seconds")
    return d


def add_group(driver, rows: list[dict], n: int, seeds: list[int]) -> list[str]:
    eids = []
    for i, row in enumerate(rows):
        for j in range(n):
            eids.append(f"e-{i}-{j}")
            driver.add(eids[-1], row, (seeds[i] * 7 + j) % 2**62, row_index=i)
    return eids


class FlakyEcho(EchoEnv):
    """EchoEnv whose episode ``*-1-0`` fails on reset and episodes ``*-0-1`` on their second step."""

    def reset(self, eids, rows):
        out = super().reset(eids, rows)
        return [EnvStep(done=True, failure="reset failed on purpose") if e.endswith("-1-0") else s
                for e, s in zip(eids, out)]

    def step(self, items):
        out = super().step(items)
        return [EnvStep(done=True, failure="step failed on purpose") if e.endswith("-0-1") and self.turns[e] == 2
                else s for (e, _), s in zip(items, out)]


@pytest.mark.parametrize("limits", [EpisodeLimits(max_turns=5, tool_response_tokens=16), EpisodeLimits(max_turns=2),
                                    EpisodeLimits(max_turns=8, context_tokens=90)], ids=["tools", "turns", "context"])
def test_the_runner_on_the_driver_reproduces_the_synchronous_runner(tok, model, limits):
    env_seed = random.randrange(1 << 30)
    rows = [{"prompt": "Compute 12 + 30 with the tool."}, {"prompt": "Say hello in French."}, {"prompt": "Go."}]
    runs = []
    for runner_cls, limits_cls in ((reference_runner.EpisodeRunner, reference_runner.EpisodeLimits),
                                   (EpisodeRunner, EpisodeLimits)):
        engine = Recording(tiny_engine(model))
        runner = runner_cls(engine, FlakyEcho(env_seed), ChatRenderer(tok), tok, SAMPLING,
                            limits_cls(**dataclasses.asdict(limits)))
        seen, trajs = [], []
        for call in range(2):  # the second call's episode ids and seeds too
            seeds = [random.Random(env_seed + call).randrange(1 << 62) for _ in rows]
            trajs += runner.run(rows, n=2, seeds=seeds, on_episode=lambda t: seen.append(t.episode_id))
        assert not engine.has_unfinished_requests() and not engine.scheduler.prefixes.entries
        runs.append((trajs, seen, engine.calls))
    (ref, ref_seen, ref_calls), (new, new_seen, new_calls) = runs
    assert [fields(t) for t in new] == [fields(t) for t in ref]
    assert new_seen == ref_seen  # on_episode in the same order
    assert new_calls == ref_calls  # the same requests, seeds, parents, releases, in the same order
    statuses = {t.status for t in new}
    assert "failed" in statuses and (statuses & {"ok", "truncated"})


def test_overlapped_env_calls_give_the_synchronous_episodes(tok, model):
    """Each episode's tokens depend on its seeds, its environment and its logits only (the
    engine's noise is per request), so running environments beside decoding changes nothing
    but the last bits of the log-probs (other batch compositions)."""
    rows = [{"prompt": f"Task {i}: use the echo tool."} for i in range(3)]
    seeds = [random.randrange(1 << 62) for _ in rows]
    runs = {}
    with EnvPool(TURNS, workers=2, timeout_s=60) as pool:
        for overlap in (False, True):
            engine = tiny_engine(model)
            driver = EpisodeDriver(engine, pool, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4),
                                   overlap=overlap, env_latency_s=0.02 if overlap else 0.0)
            eids = add_group(driver, rows, 3, seeds)
            ended = {t.episode_id: t for t in produce(engine, driver)}
            driver.close()
            assert sorted(ended) == sorted(eids) and pool.running == []
            runs[overlap] = [ended[e] for e in eids]
    assert any(t.num_turns > 1 for t in runs[False])
    for sync, over in zip(runs[False], runs[True]):
        a, b = fields(sync), fields(over)
        torch.testing.assert_close(b.pop("logprobs"), a.pop("logprobs"), rtol=0, atol=1e-5)
        assert a == b


def test_the_engine_steps_while_a_slow_tool_runs(tok, model):
    """With a tool that takes 0.2 s, the engine keeps stepping the other episodes (and a request
    that is not the driver's, whose output the driver ignores) while the tool runs."""
    engine = tiny_engine(model, max_batch_size=8)

    class Watched:  # the pool, saying when one of its calls is in flight (on the env thread)
        def __init__(self, pool):
            self.pool, self.in_flight = pool, threading.Event()

        def __getattr__(self, name):
            fn = getattr(self.pool, name)
            if name not in ("reset", "step"):
                return fn

            def call(*args):
                self.in_flight.set()
                try:
                    return fn(*args)
                finally:
                    self.in_flight.clear()
            return call

    overlapped = []
    with EnvPool(TURNS, workers=2, timeout_s=60) as pool:
        watched = Watched(pool)
        driver = EpisodeDriver(engine, watched, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4))
        engine.add_request("other", tok.encode("Not an episode."), SamplingParams(temperature=1.0, max_tokens=64,
                                                                                   seed=1))
        rows = [{"prompt": "Use the echo tool.", "sleep": 0.2}, {"prompt": "Again.", "sleep": 0.2}]
        eids = add_group(driver, rows, 3, [random.randrange(1 << 62) for _ in rows])
        ended = produce(engine, driver, other={"other"}, on_step=lambda: overlapped.append(watched.in_flight.is_set()))
        driver.close()
    assert sorted(t.episode_id for t in ended) == sorted(eids) and all(t.status != "failed" for t in ended)
    assert sum(overlapped) > 0, "no engine step ran while an environment call was in flight"
    stats = driver.stats()
    assert stats["agent/env_wait_s"] < stats["agent/env_busy_s"], stats
    assert not engine.has_unfinished_requests() and not engine.scheduler.prefixes.entries


def test_a_lockstep_follower_without_environments_makes_the_leaders_episodes(tok, model):
    """Two ranks, each its own engine (the same weights): the leader runs the environments
    (overlapped, so its results arrive whenever they do) and broadcasts what it applies; the
    follower applies the same events at the same advance. Same requests, same episodes."""
    engines = [Recording(tiny_engine(model)), Recording(tiny_engine(model))]
    channel: queue.Queue = queue.Queue()

    def leader_lockstep(events):
        channel.put(list(events))
        return events

    def follower_lockstep(events):
        assert events == []
        return channel.get(timeout=120)

    rows = [{"prompt": f"Task {i}."} for i in range(3)]
    seeds = [random.randrange(1 << 62) for _ in rows]
    results: list = [None, None]
    with EnvPool(TURNS, workers=2, timeout_s=60) as pool:
        drivers = [EpisodeDriver(engines[0], pool, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4),
                                 env_latency_s=0.01, lockstep=leader_lockstep),
                   EpisodeDriver(engines[1], None, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4),
                                 lockstep=follower_lockstep)]

        def rank(r: int) -> None:
            try:
                add_group(drivers[r], rows, 2, seeds)
                results[r] = produce(engines[r], drivers[r])
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                results[r] = e
                channel.put([])  # a waiting follower moves on (and then fails its checks)
            finally:
                drivers[r].close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not isinstance(results[0], BaseException), results[0]
    assert not isinstance(results[1], BaseException), results[1]
    leader, follower = results
    assert len(leader) == 6 and any(t.num_turns > 1 for t in leader)
    assert [dataclasses.asdict(t) for t in follower] == [dataclasses.asdict(t) for t in leader]  # order too
    assert engines[1].calls == engines[0].calls


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_an_environment_that_raises_hangs_or_dies_costs_its_episode_only(tok, model, overlap):
    engine = tiny_engine(model)
    faults = [None, "raise", "hang", "exit", None]
    with EnvPool(TURNS, workers=3, timeout_s=2) as pool:
        driver = EpisodeDriver(engine, pool, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4),
                               overlap=overlap)
        for j, fault in enumerate(faults):  # one group: the same row index, one fault each
            driver.add(f"e-{j}", {"prompt": "Use the echo tool.", "fault": fault}, 11 + j)
        ended = {t.episode_id: t for t in produce(engine, driver)}
        driver.close()
        assert pool.running == []
    got = [ended[f"e-{j}"] for j in range(len(faults))]
    for t, fault in zip(got, faults):
        if fault is None:  # a turn that hit max_tokens truncates; else three turns, done
            assert t.status == "truncated" or (t.status == "ok" and t.num_turns == 3 and t.turn_rewards[-1] == 1.0)
        elif t.num_turns >= 1 and t.status == "failed":  # a fault fires on the first step
            expected = {"raise": "raised ValueError", "hang": "timeout", "exit": "worker died"}[fault]
            assert expected in t.failure and t.num_turns == 1, (fault, t.failure)
        else:
            assert t.status == "truncated" and t.num_turns == 1, (fault, t.status)  # never reached the env
    assert sum(t.status == "failed" for t in got) >= 1
    assert not engine.has_unfinished_requests() and not engine.scheduler.prefixes.entries


def test_abort_mid_run_leaves_nothing_of_the_driver_in_the_engine(tok, model):
    engine = tiny_engine(model)
    with EnvPool(TURNS, workers=2, timeout_s=60) as pool:
        driver = EpisodeDriver(engine, pool, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4),
                               env_latency_s=0.05)
        add_group(driver, [{"prompt": "Use the echo tool."}, {"prompt": "Again."}], 3, [1, 2])
        turned = False
        while not (turned and engine.has_unfinished_requests()):  # some turns in the engine, some at the env
            if engine.has_unfinished_requests():
                finished = engine.step().finished
                turned |= bool(finished)
            else:
                driver.wait_env(0.05)
                finished = []
            driver.advance(finished)
        assert driver.live
        driver.abort()
        driver.abort()  # idempotent
        assert driver.live == 0 and not engine.has_unfinished_requests() and not engine.scheduler.prefixes.entries
        assert driver.advance([]) == []  # late environment results of aborted episodes are dropped
        driver.close()
        assert pool.running == []


def test_an_engine_error_inside_advance_then_abort_leaves_a_shared_engine_serving(tok, model):
    class Breaks(Recording):  # the 8th request is added, then the engine raises
        def add_request(self, *args, **kw):
            super().add_request(*args, **kw)
            if sum(c[0] == "add" for c in self.calls) == 8:
                raise RuntimeError("engine failed on purpose")

    engine = Breaks(tiny_engine(model))
    with EnvPool(TURNS, workers=2, timeout_s=60) as pool:
        driver = EpisodeDriver(engine, pool, ChatRenderer(tok), SAMPLING, EpisodeLimits(max_turns=4))
        engine.add_request("other", tok.encode("Not an episode."), SamplingParams(max_tokens=200, seed=3))
        add_group(driver, [{"prompt": "Use the echo tool."}, {"prompt": "Again."}], 3, [1, 2])
        with pytest.raises(RuntimeError, match="on purpose"):
            produce(engine, driver, other={"other"})
        driver.abort()
        driver.close()
        assert pool.running == []
    mine = [rid for rid in engine.scheduler.live if rid != "other"]
    assert not mine and not engine.scheduler.prefixes.entries
    if "other" in engine.scheduler.live:  # the other request was not touched: it finishes
        assert "other" in engine.engine.run_until_finished(["other"])


def test_episode_ids_are_unique_while_live_and_a_follower_needs_lockstep(tok, model):
    engine = tiny_engine(model)
    with pytest.raises(ValueError, match="lockstep follower"):
        EpisodeDriver(engine, None, ChatRenderer(tok), SAMPLING, EpisodeLimits())
    driver = EpisodeDriver(engine, EchoEnv(0), ChatRenderer(tok), SAMPLING, EpisodeLimits(), overlap=False)
    driver.add("a", {"prompt": "hi"}, 1)
    with pytest.raises(ValueError, match="still running"):
        driver.add("a", {"prompt": "hi"}, 2)
    driver.close()
    assert driver.live == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_a_leaders_broken_env_pool_raises_on_every_rank_at_the_same_advance(tok, model, overlap):
    """A pool call that raises (not an environment's failure: the pool itself) is the driver's
    error; the leader broadcasts it, so a follower raises instead of waiting forever."""

    class Broken(EchoEnv):
        def step(self, items):
            raise OSError("the env pool's socket closed")

    channel: queue.Queue = queue.Queue()
    engines = [tiny_engine(model), tiny_engine(model)]
    long_turns = SamplingParams(temperature=1.0, max_tokens=200)  # the first turn ends (p ~ 1 - 0.9**200)
    drivers = [EpisodeDriver(engines[0], Broken(0), ChatRenderer(tok), long_turns, EpisodeLimits(),
                             overlap=overlap, lockstep=lambda events: channel.put(list(events)) or events),
               EpisodeDriver(engines[1], None, ChatRenderer(tok), long_turns, EpisodeLimits(),
                             lockstep=lambda events: channel.get(timeout=120))]
    for d in drivers:
        d.add("a", {"prompt": "hi"}, 1)
    errors: list = [None, None]

    def rank(r: int) -> None:
        try:
            produce(engines[r], drivers[r])
        except Exception as e:  # noqa: BLE001 - checked below
            errors[r] = e
        finally:
            drivers[r].close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert isinstance(errors[0], OSError) and "socket closed" in str(errors[0])
    assert isinstance(errors[1], RuntimeError) and "leader's env pool raised OSError" in str(errors[1])
    assert not any(e.has_unfinished_requests() or e.scheduler.prefixes.entries for e in engines)
