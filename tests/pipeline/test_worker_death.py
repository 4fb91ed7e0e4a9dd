"""A rollout worker killed mid-step: replaced (its unfinished groups generated again, the
run completes), or — with no restarts left — the job ends with one line, never a hang."""

from __future__ import annotations

import os
import random
import signal
import threading

import _seeds
import pytest

from _async_run import ASYNC_JOB

from hybridrl.config.io import load_config
from hybridrl.job.loop import train
from hybridrl.pipeline import remote
from hybridrl.pipeline.producers import ProducerError


def _kill_first_worker_mid_run(monkeypatch) -> list:
    """SIGKILL the first rollout worker process a random moment (0-50 ms) after its second
    admission: work it was just given is outstanding then, so the kill lands mid-run whatever
    the machine's speed (a fixed delay after the first admission could fall after a fast run)."""
    started: list = []
    calls: list = []
    original = remote.RemoteProducer.submit

    def submit(self, work):
        original(self, work)
        calls.append(self)
        if len(calls) == 2 and not started:
            started.append(self)
            delay = random.Random(_seeds.fresh_seed()).uniform(0.0, 0.05)
            threading.Timer(delay, os.kill, (self.process.pid, signal.SIGKILL)).start()

    monkeypatch.setattr(remote.RemoteProducer, "submit", submit)
    return started


def _job(tmp_path, restarts: int) -> list[str]:
    return ASYNC_JOB + ["trainer.total_steps=4", "checkpoint.save=false", "pipeline.max_staleness=1",
                        "rollout.step_latency_ms=30", f"pipeline.worker_restarts={restarts}",
                        "pipeline.timeout_s=60", f"trainer.output_dir={tmp_path}"]


def test_a_killed_worker_is_replaced_and_the_run_completes(tmp_path, monkeypatch, capsys) -> None:
    killed = _kill_first_worker_mid_run(monkeypatch)
    result = train(load_config(None, _job(tmp_path, restarts=1)))
    assert killed and not killed[0].process.is_alive()
    out = capsys.readouterr()
    text = out.out + out.err  # seen dead by its results reader ("died mid-step") or by a refit ("probably died")
    assert "died" in text and "replacing it (1 of 1 restarts)" in text
    assert [row["step"] for row in result.history if "reward/mean" in row] == [1, 2, 3, 4]


def test_a_killed_worker_without_restarts_ends_the_job_in_one_line(tmp_path, monkeypatch) -> None:
    _kill_first_worker_mid_run(monkeypatch)
    with pytest.raises(ProducerError) as err:
        train(load_config(None, _job(tmp_path, restarts=0)))
    message = str(err.value)
    assert "\n" not in message and "died" in message and "pipeline.worker_restarts=0 used up" in message


def test_two_worker_processes_serve_one_trainer(tmp_path, monkeypatch) -> None:
    """pipeline.workers=2: whole groups go to the less loaded worker; both are refit every step
    (each takes part in every step's bound: staleness <= 1 throughout)."""
    submitted: dict[int, int] = {}
    original = remote.RemoteProducer.submit

    def submit(self, work):  # one SampleWork per sample
        submitted[self.index] = submitted.get(self.index, 0) + len(work)
        original(self, work)

    monkeypatch.setattr(remote.RemoteProducer, "submit", submit)
    job = ASYNC_JOB + ["trainer.total_steps=3", "checkpoint.save=false", "pipeline.workers=2",
                       "pipeline.worker_threads=1", f"trainer.output_dir={tmp_path}"]
    steps = [r for r in train(load_config(None, job)).history if "reward/mean" in r]
    assert len(steps) == 3 and all(r["async/staleness_max"] <= 1 for r in steps)
    assert all("async/worker0_idle_s" in r and "async/worker1_idle_s" in r for r in steps)
    # 4 prompts x 4 samples per step; steps 1..5 admitted (the publish after step 3 admits
    # step 3 + 1 + max_staleness): 80 samples, to both workers, in whole groups (by load:
    # the split of later admissions depends on which worker is further behind)
    assert sum(submitted.values()) == 80 and set(submitted) == {0, 1}, submitted
    assert all(k % 4 == 0 for k in submitted.values()), submitted
