"""Suite-wide collection rules.

``make test`` runs the suite on two pytest-xdist workers (``--dist loadgroup``). Tests that
cannot share the host with a copy of themselves run on one worker, one after another:

- ``tests/vllm``: vLLM's CPU build binds its OpenMP threads to cores and names its CPU
  all-reduce's /dev/shm segments after the group alone (two tensor-parallel engines at once
  collide: ``create shm in SHMManager failed. errno: 17``);
- the Ray tests: each starts a local cluster of its own.
"""

from __future__ import annotations

import pytest

SERIAL_GROUPS = {"vllm": ("tests/vllm/",), "ray": ("tests/distributed/test_launchers.py",)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid
        for group, prefixes in SERIAL_GROUPS.items():
            if path.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))
