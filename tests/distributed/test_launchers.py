"""Launchers with real processes: the elastic launcher's fault path, torchrun, Ray (a
local cluster and a simulated two-host one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from test_data_parallel import TINY, train_subprocess


def _marked_processes(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (our launch's descendants)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_failing_rank_ends_the_job_in_one_line_without_orphans(tmp_path):
    reward = tmp_path / "flaky.py"
    reward.write_text("import os\nif os.environ.get('RANK') == '1':\n    raise RuntimeError('boom on rank 1')\n"
                      "def fn(response, answer, prompt):\n    return 0.0\n")
    marker = f"HYBRIDRL_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    env = {**os.environ, key: value}
    # Rank 0 waits for rank 1 in a collective whose timeout (launcher.timeout_s) is an hour:
    # the job ending at all, within this run's guard, shows the failure stopped it, not a timeout.
    cmd = [sys.executable, "-m", "hybridrl", "train", *TINY, f"trainer.output_dir={tmp_path}",
           "launcher.nproc_per_node=2", f"reward.functions={reward}:fn", "launcher.timeout_s=3600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridrl: error: rank 1 failed:") and "boom on rank 1" in last, proc.stderr[-2000:]
    time.sleep(1.0)
    assert _marked_processes(marker) == []


def test_torchrun_runs_the_same_job(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hybridrl",
           "train", *TINY, f"trainer.output_dir={tmp_path}", "trainer.run_name=tr"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "tr" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


ray = pytest.importorskip("ray")


def test_ray_local_cluster_two_workers(tmp_path):
    proc = train_subprocess(tmp_path, "ray", ["launcher.name=ray", "launcher.num_workers=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["rollout/weight_version"] + 1 == r["refit/weight_version"] for r in rows[1:])


def test_ray_two_simulated_hosts_strict_spread(tmp_path):
    """Two Ray nodes on this machine, one rank per node (STRICT_SPREAD): the cross-host path."""
    from ray.cluster_utils import Cluster

    from hybridrl.config.io import load_config
    from hybridrl.launch.ray_cluster import launch_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        cfg = load_config(None, TINY + [f"trainer.output_dir={tmp_path}", "trainer.run_name=hosts",
                                        "launcher.name=ray", "launcher.num_workers=2",
                                        "launcher.ray_placement=STRICT_SPREAD"])
        launch_ray(cfg)
        rows = [json.loads(line) for line in (tmp_path / "hosts" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_async_rollout_worker_on_another_host(tmp_path, capfd):
    """trainer.mode=async under launcher.name=ray: the rollout worker is a Ray actor; with two
    one-CPU nodes it lands on the other node than the trainer's rank, and every refit crosses
    the object store (verified). With LoRA: after the actor's first load a refit carries only
    the adapters (a partial refit in the actor)."""
    from ray.cluster_utils import Cluster

    from hybridrl.config.io import load_config
    from hybridrl.launch.ray_cluster import launch_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address)
        cfg = load_config(None, TINY + [f"trainer.output_dir={tmp_path}", "trainer.run_name=async",
                                        "launcher.name=ray", "trainer.mode=async", "pipeline.max_staleness=1",
                                        "model.lora.rank=4", "refit.verify=true"])
        launch_ray(cfg)
        rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        assert max(r["async/staleness_max"] for r in rows[1:]) == 1  # overlapped, within the bound
    finally:
        ray.shutdown()
        cluster.shutdown()
    out = capfd.readouterr()
    assert "1 rollout worker(s) as Ray actors" in out.out + out.err
