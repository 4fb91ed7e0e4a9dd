"""A process killed inside ``save_step_dir`` leaves the previous checkpoint whole; the next
run resumes from it and clears the half-written directory.

The crash is real and lands at a chosen point: a training job in a subprocess (tiny model,
a checkpoint every step) SIGKILLs itself inside its k-th save (``_kill_inside_save.py``),
after files were written into the save's temporary directory. No handler, ``finally`` or
``except BaseException`` runs, unlike the Python exceptions of test_resume.py. What each
save wrote is recorded from the live model in the dying process, so the parent checks the
previous checkpoint against the weights it was meant to hold, not against a file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import _seeds
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "trainer"))
from _tiny import TINY_MODEL  # noqa: E402

TOTAL_STEPS = 5
# Weight decay: every step moves every weight even when the tiny model's rewards are all 0
# (zero advantages, no policy gradient), so a checkpoint overwritten by the next step's
# weights is told apart from the one it replaced (the test asserts that it is).
JOB = TINY_MODEL + ["data.train_size=300", "data.eval_size=16", "warm_start.steps=5", "trainer.eval_every=100",
                    f"trainer.total_steps={TOTAL_STEPS}", "checkpoint.every=1", "checkpoint.keep_last=2",
                    "optim.weight_decay=0.1", "trainer.threads=1", "logging.plot=false",
                    "logging.tensorboard=false"]


def _job(tmp_path: Path, name: str, seed: int) -> list[str]:
    return JOB + [f"trainer.seed={seed}", f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}"]


def _train(overrides: list[str]):
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    return train(load_config(None, overrides))


def _hf_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.mark.parametrize("point", ["weights_written", "before_rename"])
def test_sigkill_inside_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, point):
    from hybridrl.checkpoint import train_state
    from hybridrl.checkpoint.train_state import checkpoint_step

    seed = _seeds.fresh_seed()
    kill_at = random.Random(seed).randint(2, TOTAL_STEPS - 1)  # a save with one before it, not the last
    why = f"seed {seed}, killed in save {kill_at} at {point}"
    record = tmp_path / "record"
    record.mkdir()
    killed = subprocess.run([sys.executable, str(HERE / "_kill_inside_save.py"), str(kill_at), point, str(record),
                             *_job(tmp_path, "r", seed)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, f"{why}: {killed.stderr[-2000:]}"

    run_dir, store = tmp_path / "r", tmp_path / "r" / "checkpoints"
    previous, dying = (torch.load(record / f"save-{k}.pt") for k in (kill_at - 1, kill_at))
    assert (previous["step"], dying["step"]) == (kill_at - 1, kill_at), why
    assert not _same(previous["weights"], dying["weights"]), f"{why}: the crash had nothing to lose"
    # the link still names the previous step's directory, whole: its state and its weights
    live = (run_dir / "checkpoint").resolve()
    assert live == store / f"step-{kill_at - 1}" and checkpoint_step(live) == kill_at - 1, (why, live)
    assert _same(_hf_weights(run_dir / "checkpoint"), previous["weights"]), f"{why}: previous checkpoint changed"
    # the dying save's temporary directory is left behind, holding what it had written
    temps = sorted(store.glob(".tmp-*"))
    assert len(temps) == 1 and (temps[0] / "model.safetensors").is_file(), (why, os.listdir(store))
    assert (temps[0] / train_state.STATE_FILE).is_file() == (point == "before_rename"), why
    assert not (store / f"step-{kill_at}").exists(), why

    # the resume starts from the previous checkpoint, and its first save clears the stale directory
    resumed_from = []
    real_read = train_state.read_training_state

    def read_training_state(directory, run, rng):
        loop = real_read(directory, run, rng)
        resumed_from.append((Path(directory), loop.step))
        return loop

    monkeypatch.setattr(train_state, "read_training_state", read_training_state)
    _train(_job(tmp_path, "r", seed))
    assert resumed_from == [(live, kill_at - 1)], why
    assert not list(store.glob(".tmp-*")), f"{why}: stale temporary directory survived: {os.listdir(store)}"
    assert checkpoint_step((run_dir / "checkpoint").resolve()) == TOTAL_STEPS, why
    # and ends where a run that was never killed ends, bit for bit
    _train(_job(tmp_path, "straight", seed))
    assert _same(_hf_weights(run_dir / "checkpoint"), _hf_weights(tmp_path / "straight" / "checkpoint")), why
    assert _metrics(run_dir) == _metrics(tmp_path / "straight"), why
