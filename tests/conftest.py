"""Suite-wide rules for running the tests on several pytest-xdist workers (``make test``).

**Cores.** Each worker runs on its own share of the cores (``sched_setaffinity``; its
subprocesses inherit it): torch's OpenMP threads spin while they wait for each other, so
workers that each used every core slowed some tests 10-30x (measured: a 4 s doctor test took
139 s). ``trainer.threads=0`` ("all cores") then means the worker's cores.

**Tests that cannot run beside each other** take a host-wide lock (``fcntl.flock`` on a file
in the temp dir) for their duration, whichever worker runs them:

- ``vllm-tp``: vLLM tensor-parallel engines. vLLM's CPU all-reduce names its /dev/shm
  segments after the group alone, so two at once collide (``create shm in SHMManager
  failed. errno: 17``);
- ``ray``: Ray clusters (a plain ``ray.init()`` may join another test's cluster).

A lock, not an ``xdist_group`` marker: xdist 3.8's ``--dist loadgroup`` does not group under
pytest 9.2 (it renames ``item._nodeid``, which pytest no longer reads; checked).

**Seeds** (``tests/_seeds.py``): every test runs with its global generators seeded from one
per-test seed, fresh each run; a failure's report names it, and ``pytest --seed N`` (or
``HYBRIDRL_TEST_SEED=N``) replays it. Rules for tests, written here because they are the
suite's contract: every random input comes from that seed (``tests._seeds.fresh_seed()``
for a test's own draws); an outcome test derives its threshold from what the numerics
guarantee, or compares two runs on the same machine; no wall-clock bounds.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest

import _seeds

HOST_LOCKS = {
    "vllm-tp": ("tests/vllm_backend/test_vllm_tensor_parallel.py",
                "tests/vllm_backend/test_vllm_training.py::test_two_ranks_with_one_vllm_tp2_engine"),
    "ray": ("tests/distributed/test_launchers.py::test_ray",),
}


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed every test's random inputs with this (replays a failure's seed)")


@pytest.fixture(autouse=True)
def _seeded(request):
    seed = _seeds.choose(request.config.getoption("--seed"))
    request.node.user_properties.append(("seed", seed))
    _seeds.begin(seed)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("seed", f"seed {seed}: replay with `pytest --seed {seed} '{item.nodeid}'`"))


def pytest_configure(config):
    # inductor's kernel cache per CPU capability for every compile in the suite (transformers'
    # static-cache generate in the benchmarks too): kernels cached under another
    # ATEN_CPU_CAPABILITY crashed a worker ("Fatal Python error: Aborted"); rollout/compile.py
    from hybridrl.rollout.compile import keyed_inductor_cache

    keyed_inductor_cache()
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... (a replacement worker: a higher N)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return
    share = cores[int(worker.removeprefix("gw")) % count::count]
    if not share:
        return
    os.sched_setaffinity(0, share)
    import torch

    torch.set_num_threads(len(share))


@pytest.fixture(autouse=True)
def _host_lock(request):
    group = next((g for g, prefixes in HOST_LOCKS.items() if request.node.nodeid.startswith(prefixes)), None)
    if group is None:
        yield
        return
    import fcntl

    path = os.path.join(tempfile.gettempdir(), f"hybridrl-tests-{group}.lock")
    with open(path, "a") as f, contextlib.ExitStack() as stack:
        fcntl.flock(f, fcntl.LOCK_EX)
        stack.callback(fcntl.flock, f, fcntl.LOCK_UN)
        yield
