"""Scaling out: data-parallel ranks, each with an FSDP2 shard of the trainer and a full
rollout engine of its own (verl's hybrid engine), launched by torchrun / the elastic
launcher (``launcher.nproc_per_node``) or as Ray actors (``launcher.name=ray``).

Tensor-parallel engines are out of scope: every rank's engine holds the whole model.
"""
