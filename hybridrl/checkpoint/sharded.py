"""Checkpoints of a data-parallel run: the sharded state (DCP, every rank) and the
bucketwise Hugging Face export (rank 0) in one atomic step directory.

The DCP shards are written to a staging directory every rank can see, then rank 0 moves
them into the step directory it publishes (``checkpoint.save_step_dir``), together with
the export and ``trainer_state.pt``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from hybridrl.checkpoint.dcp import DCP_DIR, export_hf, load_dcp, save_dcp
from hybridrl.checkpoint.atomic import save_step_dir


def save_data_parallel(run, cfg, step_no: int, config_yaml: str,
                       write_state: Callable[[Path, list], None]) -> Path | None:
    """A checkpoint of a data-parallel run (``run``: ``trainer.build.Run``); returns the
    step directory on rank 0, None on the other ranks. ``write_state(dir)`` writes
    ``trainer_state.pt`` (rank 0), with every rank's batch-source state (``sources``: each
    rank's source holds its own share of the untrained groups)."""
    dp, actor, critic, reference = run.step.dp, run.step.actor, run.step.critic, run.step.reference
    staging = run.run_dir / "checkpoints" / f".dcp-staging-{step_no}"
    if dp.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    lora = run.lora  # LoRA: the adapters (+ their optimizer state) only; the base is the run's lora_base
    save_dcp(staging / "policy", actor.model, actor.optimizer, trainable_only=lora is not None)
    if critic is not None:
        save_dcp(staging / "critic", critic.model, critic.optimizer)
    if reference is not None and not reference.shares_policy:
        save_dcp(staging / "reference", reference.model)
    dist.barrier()
    adapter = lora.trainable_state() if lora is not None else None  # gathered on every rank
    sources: list = [None] * dist.get_world_size()
    dist.all_gather_object(sources, run.step.source.state_dict())
    if not dp.is_main:
        if lora is None:
            export_hf(actor.model, None)
        dist.barrier()
        return None

    def write(directory: Path) -> None:
        if lora is not None:
            lora.write_adapter(directory, adapter)
        else:
            export_hf(actor.model, directory)
        actor.model.config.save_pretrained(directory)
        run.tokenizer.save_pretrained(directory)
        (directory / "hybridrl_config.yaml").write_text(config_yaml)
        shutil.move(str(staging), str(directory / DCP_DIR))
        write_state(directory, sources)

    try:
        return save_step_dir(run.run_dir / "checkpoint", step_no, write, keep_last=cfg.checkpoint.keep_last)
    finally:
        dist.barrier()


def load_run_dcp(directory: Path, run) -> None:
    """Every rank loads its shards of the policy (+ optimizer), critic and reference."""
    step = run.step
    load_dcp(directory / DCP_DIR / "policy", step.actor.model, step.actor.optimizer,
             trainable_only=run.lora is not None)
    if step.critic is not None:
        load_dcp(directory / DCP_DIR / "critic", step.critic.model, step.critic.optimizer)
    if step.reference is not None and not step.reference.shares_policy:
        load_dcp(directory / DCP_DIR / "reference", step.reference.model)
