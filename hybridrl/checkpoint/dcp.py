"""Checkpoints of a data-parallel (FSDP2) run.

- ``dcp/``: the sharded training state (policy, optimizer; critic and its optimizer) via
  ``torch.distributed.checkpoint``: each rank writes its shards; it loads into any number
  of ranks (resharding), one process included (:func:`load_dcp`).
- The Hugging Face export beside it is written by rank 0 from parameters gathered bucket
  by bucket (one bucket of full tensors held at a time, never the whole model).

The trainer puts both in one atomic step directory (``trainer/sharded_checkpoint.py``).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hybridrl.distributed.fsdp import iter_full_parameters

DCP_DIR = "dcp"
EXPORT_BUCKET_BYTES = 256 << 20


def save_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             trainable_only: bool = False) -> None:
    """Every rank writes its shards of ``model`` (and ``optimizer``) under ``path``;
    ``trainable_only``: the parameters that require grad (a LoRA policy's adapters)."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is not None:
        _complete_optimizer_state(optimizer)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    state = {"model": msd} if optimizer is None else {"model": msd, "optim": osd}
    dcp.save(state, checkpoint_id=str(path))


def _complete_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter without optimizer state the state a load would build.

    A fresh optimizer's load (``get_state_dict`` -> ``_init_optim_state``) builds state for
    *every* trainable parameter with one zero-gradient, zero-lr step, then expects the
    checkpoint to hold each one ("Missing key in checkpoint state_dict"). A parameter that
    never received a gradient has none: DeepSeek-V4's lightning indexer (its top-k picks
    carry no gradient), an unused head. The same zero-gradient, zero-lr step on those
    parameters alone writes that state without moving any weight or any other state."""
    if not optimizer.state:
        return  # nothing trained yet: DCP initializes every state itself, on save and load
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if p.requires_grad and p not in optimizer.state]
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = None  # the others are skipped: their moments stay as they are
        for p in missing:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g


def load_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              trainable_only: bool = False) -> None:
    """Load a DCP checkpoint into ``model`` (sharded or not, any world size) in place
    (``trainable_only``: as :func:`save_dcp` wrote it; the frozen parameters are left as they are)."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    state = {"model": msd} if optimizer is None else {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}),
                   options=StateDictOptions(strict=not trainable_only, ignore_frozen_params=trainable_only))


def unsharded_twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s class before FSDP2 wrapped it, built on the meta device (no memory): what
    transformers' reverse weight conversion must see. It picks its renames by module class
    name, and FSDP2 renames every sharded module's class (``FSDPDeepseekV4ForCausalLM``), so on
    the wrapped model DeepSeek-V4's anchored renames hit other names than ``save_pretrained``'s."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model
    original = next(c for c in type(model).__mro__[1:] if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        return original(model.config)


def export_hf(model: torch.nn.Module, directory: Path | None, *, bucket_bytes: int = EXPORT_BUCKET_BYTES) -> None:
    """Gather ``model``'s parameters bucket by bucket; rank 0 (``directory`` not None) writes
    them as safetensors shards + index, HF layout: the names and layout ``save_pretrained``
    writes (transformers' reverse weight conversion per bucket: fused MoE experts become
    per-expert tensors) plus the persistent buffers (DeepSeek-V3's router correction bias).
    Every rank must call this together."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from hybridrl.refit.transport import named_persistent_buffers

    files: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    size, total, n = 0, 0, 0
    naming = unsharded_twin(model) if directory is not None else model

    def flush() -> None:
        nonlocal bucket, size, n
        if bucket and directory is not None:
            n += 1
            name = f"model-{n:05d}.safetensors"
            bucket = revert_weight_conversion(naming, bucket)
            save_file({k: v.contiguous().cpu() for k, v in bucket.items()}, str(directory / name),
                      metadata={"format": "pt"})
            files.update({k: name for k in bucket})
        bucket, size = {}, 0

    for name, tensor in itertools.chain(iter_full_parameters(model), named_persistent_buffers(model)):
        bucket[name] = tensor
        size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            flush()
    flush()
    if directory is None:
        return
    if n == 1:  # one file: the plain single-file layout
        (directory / "model-00001.safetensors").rename(directory / "model.safetensors")
        return
    index = {"metadata": {"total_size": total}, "weight_map": files}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
