"""Functions run by ``torch.multiprocessing.spawn`` in the distributed tests (gloo, CPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybridrl.refit.memory import peak_rss_delta


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def finish() -> None:
    """Leave together, then end the process without running C++ destructors: gloo's worker
    threads can still be joinable when the group (or the interpreter) is torn down, which
    aborts the process (SIGABRT, "terminate called without an active exception") after its
    work succeeded — seen even after a barrier under load. Every result is already on disk."""
    import sys

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def small_model(seed: int = 0, *, hidden: int = 64, vocab: int = 96, layers: int = 3):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def refit_memory(rank: int, world: int, port: int, bucket: int, out: str) -> None:
    """Shard, refit this rank's engine from the shards (verify on), record the peak."""
    from hybridrl.distributed.fsdp import shard_model
    from hybridrl.distributed.refit import refit_sharded
    from hybridrl.rollout import EngineSpec, RolloutEngine

    init(rank, world, port)
    model = small_model(hidden=512, vocab=4096, layers=4)  # ~50 MB float32: bucket-bounded vs whole model is clear
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    largest = max(t.numel() * t.element_size() for t in full.values())
    total = sum(t.numel() * t.element_size() for t in full.values())
    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=16))
    shard_model(model)
    refit_sharded(engine, model, bucket_bytes=bucket, verify=True)  # first load (allocator warm-up)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    for t in full.values():
        t.add_(0.01)
    # memory of the refit itself (verify's own snapshots and checksums are a debug mode on top);
    # the least of three refits: a single one can carry a one-off growth of malloc's arenas
    # (gloo's threads), which is not the refit's working set
    peak = min(peak_rss_delta(lambda: refit_sharded(engine, model, bucket_bytes=bucket)) for _ in range(3))
    refit_sharded(engine, model, bucket_bytes=bucket, verify=True)
    versions = [None] * world
    dist.all_gather_object(versions, engine.weight_version)
    held = {n: engine.weight_routes[n].held() for n in full}
    exact = all(torch.equal(held[n].to(full[n].dtype), full[n]) for n in full)
    torch.save({"peak": peak, "bound": bucket + largest, "model": total, "versions": versions, "exact": exact},
               f"{out}.{rank}")
    finish()


def dcp_save(rank: int, world: int, port: int, path: str, out: str) -> None:
    """``world`` ranks (sharded when > 1) save a DCP checkpoint of a perturbed model."""
    from hybridrl.checkpoint.dcp import save_dcp
    from hybridrl.distributed.fsdp import iter_full_parameters, shard_model

    init(rank, world, port)
    model = small_model(seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    if world > 1:
        shard_model(model)
    save_dcp(path, model)
    full = dict(iter_full_parameters(model))
    if rank == 0:
        torch.save(full, out)
    finish()


def dcp_load(rank: int, world: int, port: int, path: str, out: str) -> None:
    """``world`` ranks load a DCP checkpoint into a fresh (differently seeded) model."""
    from hybridrl.checkpoint.dcp import load_dcp
    from hybridrl.distributed.fsdp import iter_full_parameters, shard_model

    init(rank, world, port)
    model = small_model(seed=2)
    if world > 1:
        shard_model(model)
    load_dcp(path, model)
    full = dict(iter_full_parameters(model))
    if rank == 0:
        torch.save(full, out)
    finish()


def measured_state_bytes(rank: int, world: int, port: int, out: str) -> None:
    """Bytes this rank really holds for parameter shards, gradients and AdamW state after
    one optimizer step of the sharded model."""
    from torch.distributed.tensor import DTensor

    from hybridrl.distributed.fsdp import shard_model

    init(rank, world, port)
    model = small_model(hidden=256, vocab=1024, layers=3)
    shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    grads = sum(local(p.grad) for p in model.parameters())
    moments = sum(local(v) for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
    torch.save({"params": params, "grads": grads, "optimizer": moments}, f"{out}.{rank}")
    finish()
