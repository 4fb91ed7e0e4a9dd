"""The vLLM backend on 2 ranks: vLLM's external_launcher (TP=2) in the trainer's processes,
refit of whole HF tensors into each rank's shard (vLLM's loaders keep their partition), the
reload check and the verifier on each shard, greedy == transformers after each of two refits."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp
from _vllm_helpers import SKIP_NO_VLLM

import _vllm_tp_workers

pytestmark = SKIP_NO_VLLM


def test_vllm_tp2_refits_and_generates_like_transformers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "vtp")
    mp.spawn(_vllm_tp_workers.vllm_tp_refit_and_generate, args=(2, port, out), nprocs=2, join=True)
    r0, r1 = (torch.load(f"{out}.{r}") for r in range(2))
    assert r0["a"]["tokens"] == r1["a"]["tokens"] and r0["b"]["tokens"] == r1["b"]["tokens"]
    assert r0["a"]["tokens"] != r0["b"]["tokens"]  # the second refit reached both shards
    assert r0["b"]["version"] == r1["b"]["version"] == 2
    # each rank holds half of every split weight: heads, MLP width, vocabulary
    assert r0["held"]["model.layers.0.self_attn.q_proj.weight"] == (128, 256)
    assert r0["held"]["model.layers.0.self_attn.o_proj.weight"] == (256, 128)
    assert r0["held"]["model.embed_tokens.weight"] == (128, 256)
    assert r0["held"]["model.norm.weight"] == (256,)
