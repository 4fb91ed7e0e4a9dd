"""Run by ``torch.multiprocessing.spawn`` in test_vl_fsdp.py: one gloo rank of a VL policy
sharded with FSDP2, its log-probs and vision-tower gradients written by rank 0."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def sharded_logprobs_and_grads(rank: int, world: int, port: int, arch: str, seed: int, out: str) -> None:
    from hybridrl.distributed.fsdp import full_tensor, shard_model
    from hybridrl.trainer.forward import compute_logprobs_entropy, fsdp_forward_methods
    from hybridrl.trainer.vision_model import vision_parameters
    from tests.trainer._vl import draw_model, draw_rows, pad_rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=4)
    shard_model(model, fsdp_forward_methods())
    ids, mask, response = pad_rows(rows, "left")
    lp, _ = compute_logprobs_entropy(model, ids, mask, response, images=images)
    lp.sum().backward()
    grads = {n: full_tensor(p.grad) for n, p in vision_parameters(model)}
    if rank == 0:
        torch.save({"logprobs": lp.detach(), "grads": grads}, out)
    dist.barrier()
    dist.destroy_process_group()
