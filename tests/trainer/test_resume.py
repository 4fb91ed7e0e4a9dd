"""Exact resume and a run directory that is never lost: real subprocesses, real signals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import _seeds
import pytest
import torch
from _tiny import TINY_MODEL

from hybridrl.config.io import load_config

BASE = TINY_MODEL + ["data.train_size=300", "data.eval_size=16", "warm_start.steps=15", "trainer.total_steps=12",
                     "trainer.eval_every=4", "checkpoint.every=2", "checkpoint.keep_last=3", "trainer.threads=1",
                     "logging.plot=false"]
# GRPO with a KL reference (its weights and the KL controller are part of the state), and
# PPO with a critic, two epochs over mini-batches (optimizer moments, shuffling generator)
CASES = {"grpo_kl": ["algo.kl.coef=0.02"],
         # LoRA: adapters + their optimizer moments in the checkpoint, the base read back from
         # the run's lora_base, the reference = the base under disable_adapter()
         "lora_kl": ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=3e-3", "algo.kl.coef=0.02"],
         "ppo_gae": ["algo.advantage.estimator=gae", "batch.mini_batch_size=8", "batch.ppo_epochs=2",
                     "algo.kl.coef=0.01", "algo.kl.use_loss=false", "algo.kl.adaptive_target=0.01"]}


def _cmd(out: Path, name: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "hybridrl", "train", *BASE, *extra, f"trainer.output_dir={out}",
            f"trainer.run_name={name}"]


def _env() -> dict:
    tests = str(Path(__file__).parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    adapter = run_dir / "checkpoint" / "adapter_model.safetensors"  # a LoRA run's checkpoint
    return load_file(str(adapter if adapter.exists() else run_dir / "checkpoint" / "model.safetensors"))


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.mark.parametrize("case", sorted(CASES))
def test_sigkill_then_resume_is_bit_identical(tmp_path, case):
    extra = CASES[case]
    # the uninterrupted run beside the killed one (one thread each, two cores): same bits, half the wait
    straight = subprocess.Popen(_cmd(tmp_path, "straight", extra), env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    kill_after = random.Random(_seeds.fresh_seed()).randint(3, 9)  # a fresh random step each run of the suite
    proc = subprocess.Popen(_cmd(tmp_path, "killed", extra), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while _steps_done(tmp_path / "killed") < kill_after and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no handler runs, maybe mid-step or mid-save
    proc.wait()
    assert _steps_done(tmp_path / "killed") < 12, "the run finished before it could be killed"
    resumed = subprocess.run(_cmd(tmp_path, "killed", extra), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-2000:]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"weights differ (killed after {kill_after})"
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "straight")


def test_sigint_saves_and_exits_with_one_line(tmp_path):
    proc = subprocess.Popen(_cmd(tmp_path, "int", []), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 600
    while _steps_done(tmp_path / "int") < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT
    last = [line for line in err.splitlines() if line.startswith("hybridrl:")]
    assert len(last) == 1 and "interrupted at step" in last[0] and "checkpoint.resume=auto" in last[0]
    assert "Traceback" not in err
    step = int(last[0].split("interrupted at step ")[1].split(":")[0])
    assert (tmp_path / "int" / "checkpoint" / "trainer_state.pt").is_file()
    from hybridrl.checkpoint.train_state import checkpoint_step

    assert checkpoint_step((tmp_path / "int" / "checkpoint").resolve()) == step


def _train(tmp_path, extra):
    from hybridrl.job.loop import train

    return train(load_config(None, BASE + [f"trainer.output_dir={tmp_path}", "logging.progress=false",
                                           "logging.tensorboard=false"] + extra))


def test_existing_run_is_never_wiped(tmp_path):
    _train(tmp_path, ["trainer.total_steps=2", "trainer.run_name=r"])
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run.*checkpoint.resume=auto"):
        _train(tmp_path, ["trainer.total_steps=2", "trainer.run_name=r", "checkpoint.resume=off"])
    with pytest.raises(ValueError, match="already complete at step 2"):
        _train(tmp_path, ["trainer.total_steps=2", "trainer.run_name=r"])
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before
    # raising total_steps continues the same run
    result = _train(tmp_path, ["trainer.total_steps=4", "trainer.run_name=r"])
    assert [r["step"] for r in result.history if "reward/mean" in r] == [1, 2, 3, 4]
    # a run directory without a checkpoint is refused, not wiped
    (tmp_path / "nockpt").mkdir()
    (tmp_path / "nockpt" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="no checkpoint to resume"):
        _train(tmp_path, ["trainer.run_name=nockpt"])
    assert (tmp_path / "nockpt" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_second_run_in_the_same_directory_is_refused(tmp_path):
    from hybridrl.job.run_dir import open_run_dir

    first = open_run_dir(str(tmp_path), "busy", "auto")
    try:
        with pytest.raises(ValueError, match=f"in use by another hybridrl run \\(pid {os.getpid()}\\)"):
            open_run_dir(str(tmp_path), "busy", "auto")
    finally:
        first.close()
    open_run_dir(str(tmp_path), "busy", "auto").close()  # free again


@pytest.mark.parametrize("name", ["../escape", "/abs", "..", "a/b"])
def test_run_name_cannot_leave_output_dir(name):
    from hybridrl.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.run_name"):
        load_config(None, [f"trainer.run_name={name}"])


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    from hybridrl.checkpoint import atomic as checkpoint

    _train(tmp_path, ["trainer.total_steps=2", "trainer.run_name=d"])
    link = tmp_path / "d" / "checkpoint"
    target = link.resolve()
    real = checkpoint._fsync_tree

    def disk_full(directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_fsync_tree", disk_full)
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        _train(tmp_path, ["trainer.total_steps=3", "trainer.run_name=d"])
    msg = str(e.value)
    assert "\n" not in msg and "No space left" in msg and str(target) in msg and "hybridrl-rescue-d-" in msg
    assert link.resolve() == target and (target / "trainer_state.pt").is_file()
    assert not list((tmp_path / "d" / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(checkpoint, "_fsync_tree", real)


def test_resaving_a_step_never_deletes_the_live_checkpoint(tmp_path):
    from hybridrl.checkpoint.atomic import save_step_dir

    link = tmp_path / "checkpoint"
    first = save_step_dir(link, 5, lambda d: (d / "a").write_text("1"), keep_last=3)
    second = save_step_dir(link, 5, lambda d: (d / "a").write_text("2"), keep_last=3)
    assert first != second and first.exists() and (link / "a").read_text() == "2"


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    import hybridrl.trainer.actor as actor

    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(actor.torch.nn.utils, "clip_grad_norm_",
                        lambda params, clip: real(params, clip) * float("nan"))
    with pytest.raises(ValueError, match="2 consecutive steps had a non-finite.*Last good checkpoint"):
        _train(tmp_path, ["trainer.run_name=nan", "trainer.max_nonfinite_steps=2"])
    rows = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/nonfinite_skipped"] for r in rows if "actor/nonfinite_skipped" in r] == [1.0, 1.0]
