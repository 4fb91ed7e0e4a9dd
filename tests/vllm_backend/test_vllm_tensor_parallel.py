"""The vLLM backend on 2 ranks: vLLM's external_launcher (TP=2) in the trainer's processes,
refit of whole HF tensors into each rank's shard (vLLM's loaders keep their partition), the
reload check and the verifier on each shard, greedy == transformers after each of two refits;
LoRA (adapter mode and merged partial reloads) on the same shards."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp
from _vllm_helpers import SKIP_NO_VLLM

import _vllm_tp_workers

pytestmark = SKIP_NO_VLLM


def test_vllm_tp2_refits_and_generates_like_transformers(tmp_path):
    """Also LoRA on the shards: adapter-only refits (vLLM keeps each rank's slice of A or B,
    checked against the slot) and merged partial reloads, greedy == the peft model."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "vtp")
    mp.spawn(_vllm_tp_workers.vllm_tp_refit_and_generate, args=(2, port, out), nprocs=2, join=True)
    r0, r1 = (torch.load(f"{out}.{r}") for r in range(2))
    for step in "abcd":
        assert r0[step]["tokens"] == r1[step]["tokens"]
    assert r0["a"]["tokens"] != r0["b"]["tokens"]  # the second refit reached both shards
    assert r0["b"]["tokens"] != r0["c"]["tokens"]  # so did the adapter
    assert [r0[s]["version"] for s in "abcd"] == [1, 2, 3, 4]
    assert [r0[s]["lora_id"] for s in "abcd"] == [1, 2, 3, 4]  # a new adapter id every refit
    assert max(r0["c"]["logprob_gap"], r1["c"]["logprob_gap"]) < 1e-4  # fp32, all-reduce order aside
    # each rank holds half of every split weight: heads, MLP width, vocabulary
    assert r0["held"]["model.layers.0.self_attn.q_proj.weight"] == (128, 256)
    assert r0["held"]["model.layers.0.self_attn.o_proj.weight"] == (256, 128)
    assert r0["held"]["model.embed_tokens.weight"] == (128, 256)
    assert r0["held"]["model.norm.weight"] == (256,)
    # column-parallel: B's rows split, A whole; row-parallel: A's columns split, B whole
    assert r0["held"]["model.layers.0.self_attn.q_proj.lora_B.weight"] == (128, 4)
    assert r0["held"]["model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 256)
    assert r0["held"]["model.layers.0.mlp.down_proj.lora_A.weight"] == (4, 256)
    assert r0["held"]["model.layers.0.mlp.down_proj.lora_B.weight"] == (256, 4)
