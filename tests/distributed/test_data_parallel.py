"""2 ranks (gloo, FSDP2, real processes) compute what 1 process computes: as far as fp32 and
AdamW guarantee, which ``_same_training`` derives (rows, rewards, losses, gradients, weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.intermediate_size=64", "rollout.n=4", "rollout.max_tokens=4",
        "batch.prompts_per_step=4", "warm_start.batch_size=8", "data.train_size=200", "data.eval_size=8",
        "warm_start.steps=20", "trainer.total_steps=3", "trainer.eval_every=3", "trainer.threads=1",
        "refit.verify=true", "checkpoint.every=0", "logging.tensorboard=false", "logging.plot=false",
        "logging.progress=false"]
# The default loss aggregation (token-mean) runs in gae_critic and both DeepSeek cases.
CASES = {
    "grpo_seq_mean_token_mean_kl": ["algo.loss_agg_mode=seq-mean-token-mean", "algo.kl.coef=0.05"],
    "gae_critic": ["algo.advantage.estimator=gae", "algo.kl.coef=0.02", "algo.kl.use_loss=false"],
    # transformers' DeepseekV3ForCausalLM sharded by FSDP2: MLA (q/k head dim != v head dim in
    # the packed path), DeepSeekMoE with routing replay. (Not the balance loss: like every MoE
    # aux loss it is a product of batch statistics, computed per rank, so 2 ranks != 1.)
    "deepseek_v3_replay": ["model.arch=deepseek_v3", "rollout.routing_replay=true"],
    # transformers' DeepseekV4ForCausalLM (padded buckets: it cannot run packed), its top-k
    # layers replayed; the exported checkpoint named as save_pretrained names it.
    "deepseek_v4_replay": ["model.arch=deepseek_v4", "rollout.routing_replay=true"],
}
# The tiny model's rewards are mostly 0 (zero GRPO advantages: no gradient, weights that never
# move); the entropy bonus gives every step a gradient, so what is compared is not trivially equal.
MOVING = ["algo.policy_loss.entropy_coeff=0.01"]
LOSSES = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss")
HERE = Path(__file__).resolve().parent


def train_subprocess(out: Path, name: str, extra: list[str], timeout: float = 600, *,
                     record: bool = False) -> subprocess.CompletedProcess:
    """``hybridrl train`` in a fresh interpreter; ``record``: every rank records what its AdamW was
    fed into ``out/<name>.record`` (``_train_record``)."""
    args = ["train", *TINY, *extra, f"trainer.output_dir={out}", f"trainer.run_name={name}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "hybridrl", *args]
    if record:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-c", "import sys, _train_record; "
               f"sys.exit(_train_record.main({str(out / f'{name}.record')!r}, sys.argv[1:]))", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def train_in_process(out: Path, name: str, extra: list[str], monkeypatch=None) -> int:
    """The one-process reference run inside the test process: the same job as
    ``train_subprocess`` without a fresh interpreter (~5 s of imports saved); the test
    process's thread count and torch RNG are restored after. ``monkeypatch``: record the run
    into ``out/<name>.record`` (``_train_record``, undone with the test's monkeypatch)."""
    from hybridrl.cli import main

    if monkeypatch is not None:
        import _train_record

        _train_record.install(str(out / f"{name}.record"), monkeypatch.setattr)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        return main(["train", *TINY, *extra, f"trainer.output_dir={out}", f"trainer.run_name={name}"])
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    adapter = run / "checkpoint" / "adapter_model.safetensors"  # a LoRA run's checkpoint: the adapters
    return load_file(str(adapter if adapter.exists() else run / "checkpoint" / "model.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_one_process(tmp_path, monkeypatch, case):
    from _same_training import assert_same_training

    assert train_in_process(tmp_path, "one", CASES[case] + MOVING, monkeypatch) == 0
    two = train_subprocess(tmp_path, "two", CASES[case] + MOVING + ["launcher.nproc_per_node=2"], record=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_training(tmp_path, "one", "two", losses=LOSSES)


def test_two_rank_run_killed_then_resumed_is_bit_identical(tmp_path):
    """SIGKILL the whole 2-rank job (launcher and ranks) after a checkpoint, resume it from
    the sharded (DCP) checkpoint: the final weights equal an uninterrupted 2-rank run's."""
    import signal
    import time

    extra = ["launcher.nproc_per_node=2", "trainer.total_steps=6", "checkpoint.every=2", "algo.kl.coef=0.02"]
    straight = train_subprocess(tmp_path, "straight", extra)
    assert straight.returncode == 0, straight.stderr[-3000:]
    cmd = [sys.executable, "-m", "hybridrl", "train", *TINY, *extra, f"trainer.output_dir={tmp_path}",
           "trainer.run_name=killed"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run = tmp_path / "killed"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "checkpoint" / "trainer_state.pt").exists() and (run / "metrics.jsonl").exists() \
                and len((run / "metrics.jsonl").read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = train_subprocess(tmp_path, "killed", extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    a, b = _weights(tmp_path / "straight"), _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]  # noqa: E731
    assert strip(_rows(run)) == strip(_rows(tmp_path / "straight"))
