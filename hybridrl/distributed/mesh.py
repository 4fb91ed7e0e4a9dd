"""The generation mesh: the trainer's ``N`` ranks viewed as ``DP_rollout x TP`` for rollouts.

The trainer shards one way (FSDP2 over all ``N`` ranks); generation another: ranks
``[g·T, (g+1)·T)`` form tensor-parallel group ``g`` and hold one engine between them
(``rollout/layers/tensor_parallel.py``). Each rank still draws its own share of a step's
prompts (data parallel, as without TP); a group gathers its ranks' shares, generates them
together — every rank of the group runs the same requests in the same order, which is what
pairs up the engine's collectives — and each rank keeps its own share's rollouts back.
The rollouts of a prompt depend on its seed alone, so a run at any ``T`` samples the tokens
a one-process run samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hybridrl.rollout.layers.tensor_parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class RolloutMesh:
    """This rank's generation group: ``tp`` (its TP rank and group), and the group's index."""

    tp: TensorParallel
    group_index: int
    num_groups: int

    def gather(self, items: list) -> tuple[list, int]:
        """Every group rank's ``items`` concatenated in rank order, and where this rank's begin."""
        if self.tp.size == 1:
            return list(items), 0
        parts: list = [None] * self.tp.size
        dist.all_gather_object(parts, list(items), group=self.tp.group)
        offset = sum(len(p) for p in parts[:self.tp.rank])
        return [x for p in parts for x in p], offset


def build_rollout_mesh(tensor_parallel_size: int) -> RolloutMesh:
    """Split the initialized world into ``world / T`` consecutive groups of ``T`` ranks. Every
    rank must call it (``new_group`` is collective over the world, for every group)."""
    T = tensor_parallel_size
    if T == 1:
        return RolloutMesh(SINGLE, 0, 1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % T:
        raise ValueError(f"rollout.tensor_parallel_size={T} does not divide the world of {world} ranks")
    groups = [dist.new_group(list(range(g * T, (g + 1) * T))) for g in range(world // T)]
    g = rank // T
    return RolloutMesh(TensorParallel(rank % T, T, groups[g]), g, world // T)
