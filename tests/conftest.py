"""Suite-wide collection rules.

``make test`` runs the suite on two pytest-xdist workers (``--dist loadgroup``). Tests that
cannot share the host with a copy of themselves run on one worker, one after another:

- ``tests/vllm``: vLLM's CPU build binds its OpenMP threads to cores and names its CPU
  all-reduce's /dev/shm segments after the group alone (two tensor-parallel engines at once
  collide: ``create shm in SHMManager failed. errno: 17``);
- the Ray tests: each starts a local cluster of its own.

Each worker runs on its own share of the cores (``sched_setaffinity``; its subprocesses
inherit it): torch's OpenMP threads spin while they wait for each other, so two workers
that each used every core slowed some tests 10-30x (measured: a 4 s doctor test took 139 s).
``trainer.threads=0`` ("all cores") then means the worker's cores.
"""

from __future__ import annotations

import os

import pytest

SERIAL_GROUPS = {"vllm": ("tests/vllm/",), "ray": ("tests/distributed/test_launchers.py",)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid
        for group, prefixes in SERIAL_GROUPS.items():
            if path.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return
    index = int(worker.removeprefix("gw"))
    share = cores[index::count]
    os.sched_setaffinity(0, share)
    import torch

    torch.set_num_threads(len(share))
