"""Tensor-parallel built-in engine on 2 real ranks (gloo) vs the same engine whole: logits,
greedy and seeded sampled tokens for dense (KV heads split and replicated), MoE and
DeepSeek-V3 (MLA) models; each rank's weights are about half."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

import _tp_workers


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", ["qwen2", "llama_kv1", "qwen2_moe", "deepseek_v3"])
def test_tp2_engine_equals_the_whole_engine(tmp_path, family):
    out = str(tmp_path / "tp")
    mp.spawn(_tp_workers.engine_equality, args=(2, _port(), family, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in ranks:
        # fp32: only the order of the sums differs; 1e-5 relative to the largest logit (~20 here)
        assert r["logit_gap"] <= 1e-5 * max(1.0, r["logit_scale"]), (r["logit_gap"], r["logit_scale"])
        assert r["greedy_equal"] and r["sampled_equal"]
        assert r["logprob_gap"] < 1e-5, r["logprob_gap"]
        # weights per rank: half of every split layer; the norms, routers (and MLA's
        # down-projections) stay whole
        assert r["bytes_sharded"] <= 0.62 * r["bytes_whole"], (r["bytes_sharded"], r["bytes_whole"])
        if family == "qwen2":  # KV heads split: half the cache; replicated (kv1) / latent (MLA): all of it
            assert r["kv_sharded"] * 2 == r["kv_whole"]
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # the group samples one sequence per request
