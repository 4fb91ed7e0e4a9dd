"""A tensor-parallel VL engine (2 gloo ranks): the language model split as for text models,
the vision tower replicated whole on each rank; logits and greedy answers with images ==
the whole engine's. Configs drawn per run (the seed is in the failure message)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.rollout import _vl as vl


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_tp2_vl_engine_equals_the_whole_engine(tmp_path, family):
    seed = vl.fresh_seed()
    out = str(tmp_path / "tp")
    mp.spawn(vl.tp_worker, args=(2, _port(), family, seed, out), nprocs=2, join=True)
    for r in (torch.load(f"{out}.{rank}") for rank in range(2)):
        # fp32, only the order of the partial sums differs (as tests/distributed/test_tensor_parallel.py)
        assert r["logit_gap"] <= 1e-5 * max(1.0, r["logit_scale"]), (r, seed)
        assert r["greedy_equal"] and r["logprob_gap"] < 1e-5 and r["tower_whole"], (r, seed)
