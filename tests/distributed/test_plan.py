"""``hybridrl plan`` against what 2 real ranks hold, and its CLI for the Qwen2.5 shapes."""

from __future__ import annotations

import socket
import subprocess
import sys

import torch
import torch.multiprocessing as mp

import _workers


def test_plan_matches_two_real_ranks(tmp_path):
    from hybridrl.distributed.plan import EngineLoad, plan_memory

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "state")
    mp.spawn(_workers.measured_state_bytes, args=(2, port, out), nprocs=2, join=True)
    measured = [torch.load(f"{out}.{r}") for r in range(2)]
    cfg = _workers.small_model(hidden=256, vocab=1024, layers=3).config
    plan = plan_memory(cfg, world_size=2, trainer_dtype=torch.float32, bucket_bytes=1 << 20,
                       engine=EngineLoad(dtype=torch.float32, batch=4, seq_len=16))
    for m in measured:  # rank 0 holds the larger share when rows do not split evenly
        for key in ("params", "grads", "optimizer"):
            assert abs(getattr(plan, key) - m[key]) <= 0.10 * m[key], (key, getattr(plan, key), m[key])


def test_plan_cli_for_qwen_shapes():
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "plan", "--shape", "qwen2.5-7b", "launcher.nnodes=8",
                           "launcher.nproc_per_node=8", "model.dtype=bfloat16", "--device-gib", "80"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "64 data-parallel ranks" in proc.stdout and "fits 80.0 GiB?" in proc.stdout
    params = float(next(line for line in proc.stdout.splitlines() if "trainer parameters" in line).split()[-2])
    assert 0.20 < params < 0.25  # 7.6e9 bf16 parameters / 64 ranks = 0.22 GiB


def test_plan_per_tensor_parallel_rank_is_the_engines_own_shard():
    """``hybridrl plan`` at TP=2 reads the engine's own layers (built on meta as TP rank 0) and
    matches what a real TP=2 engine holds (the 2-rank test measures the same model)."""
    import transformers

    from hybridrl.distributed.plan import EngineLoad, engine_bytes, plan_memory

    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    whole = engine_bytes(cfg, dtype=torch.float32, quantization=None)
    half = engine_bytes(cfg, dtype=torch.float32, quantization=None, tensor_parallel_size=2)
    assert 0.5 * whole < half <= 0.55 * whole  # every split layer halves; norms (and rank 0's padded vocabulary row) whole
    one = plan_memory(cfg, world_size=2, trainer_dtype=torch.float32, bucket_bytes=1 << 20,
                      engine=EngineLoad(dtype=torch.float32, batch=4, seq_len=16))
    two = plan_memory(cfg, world_size=2, trainer_dtype=torch.float32, bucket_bytes=1 << 20,
                      engine=EngineLoad(dtype=torch.float32, batch=4, seq_len=16, tensor_parallel_size=2))
    assert two.engine_weights == half and two.params == one.params  # the trainer's FSDP shard is unchanged
    assert two.kv_cache == one.kv_cache  # the group serves 2x the rows over half the KV heads
    assert "generation as 1 x TP 2" in two.table() and "TP shard, 1/2" in two.table()
