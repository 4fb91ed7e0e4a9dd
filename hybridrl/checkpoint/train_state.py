"""Everything an exact resume needs, saved next to the HF-format policy in one atomic
checkpoint directory, and restored into a freshly built run.

A checkpoint directory holds:

- the policy and tokenizer in Hugging Face format (``from_pretrained`` loads it),
- ``critic/`` (HF backbone + value head) when PPO with GAE is on,
- ``reference.safetensors`` (the frozen KL reference) when KL is on,
- ``trainer_state.pt``: the loop's counters (step, last eval accuracies, non-finite
  streak), the step's components' own ``state_dict()`` (``RLStep.state_dict``: optimizer
  and LR-schedule states, KL controller, shuffling generator, the engine's weight
  version), the step's python RNG (prompt order and per-prompt sampling seeds), and the
  global RNGs (python, torch: unseeded greedy decoding, numpy). This file only collects:
  every component writes and reads its own part.

Restoring loads the weights *into* the built components (the optimizers keep pointing
at the same parameters), then the engine is refit from the restored policy before the
first rollout. Loaded with ``weights_only=True``: only tensors and plain values.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
REFERENCE_FILE = "reference.safetensors"
FORMAT_VERSION = 2  # 2: the components' own state_dicts under "step"


@dataclass
class LoopState:
    """The loop's own counters (the components carry the rest)."""

    step: int  # last completed RL step
    warm_start_accuracy: float
    last_accuracy: float
    nonfinite_streak: int = 0


def write_training_state(directory: Path, run, loop: LoopState, rng: random.Random, *,
                         sharded: bool = False, sources: list | None = None) -> None:
    """Write the non-HF part of a checkpoint of ``run`` (a ``build.Run``) into ``directory``.

    ``sharded`` (data parallel): the weights and optimizer states are in ``dcp/`` (written
    by every rank, see ``distributed/checkpoint.py``); this file keeps the rest (rank 0),
    with ``sources``: every rank's batch-source state, in rank order."""
    from safetensors.torch import save_model

    step = run.step
    if not sharded:
        if step.critic is not None:
            step.critic.model.save_pretrained(directory / "critic")
        if step.reference is not None and not step.reference.shares_policy:  # LoRA: the base, saved once
            save_model(step.reference.model, str(directory / REFERENCE_FILE))
    np_state = np.random.get_state()
    state = {
        "format": FORMAT_VERSION,
        "sharded": sharded,
        "loop": vars(loop).copy(),
        "step": step.state_dict(optimizers=not sharded, source_states=sources),
        "rng": {
            "python_step": python_rng_state(rng.getstate()),
            "python_global": python_rng_state(random.getstate()),
            "torch": torch.get_rng_state(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        },
    }
    torch.save(state, directory / STATE_FILE)


def read_training_state(directory: Path, run, rng: random.Random) -> LoopState:
    """Restore ``directory`` into the freshly built ``run``; returns the loop counters.
    A data-parallel run (sharded models) restores its weights from ``dcp/`` on every rank."""
    from safetensors.torch import load_model

    from hybridrl.trainer.value_model import ValueModel

    state = _load(directory)
    step = run.step
    sharded = step.dp is not None
    if bool(state.get("sharded")) != sharded:
        raise ValueError(f"checkpoint.resume: {directory} was written by a "
                         f"{'multi' if state.get('sharded') else 'single'}-process run; resume it the same way "
                         "(a sharded checkpoint's HF export can start a new single-process run with model.path=...)")
    if (step.critic is None) != (state["step"]["critic"] is None):
        raise ValueError(f"checkpoint.resume: {directory} was written with a different algo.advantage.estimator "
                         "(critic present in one and not the other); resume with the run's own config")
    if sharded:
        from hybridrl.checkpoint.sharded import load_run_dcp

        load_run_dcp(directory, run)
    else:
        if run.lora is not None:
            load_adapter_weights(run.lora, directory)
        else:
            load_policy_weights(run.policy, directory)
        if step.critic is not None:
            saved = ValueModel.from_pretrained(directory / "critic")
            step.critic.model.load_state_dict(saved.state_dict())
        if step.reference is not None and not step.reference.shares_policy:
            load_model(step.reference.model, str(directory / REFERENCE_FILE))
    r = state["rng"]
    rng.setstate(python_rng_tuple(r["python_step"]))
    random.setstate(python_rng_tuple(r["python_global"]))
    torch.set_rng_state(r["torch"])
    kind, keys, *rest = r["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(rest[0]), int(rest[1]), rest[2]))
    step.load_state_dict(state["step"])  # last: it refits the engine from the restored policy
    return LoopState(**state["loop"])


def checkpoint_step(directory: Path) -> int:
    """The RL step a training checkpoint was written after (validates the file)."""
    return _load(directory)["loop"]["step"]


def _load(directory: Path) -> dict:
    path = directory / STATE_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint.resume: {directory} has no {STATE_FILE}; it is not a hybridrl training "
                         "checkpoint (an HF export can start a new run with model.path=...)")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt file is a user-facing one-liner
        raise ValueError(f"checkpoint.resume: {path} is unreadable ({type(e).__name__}); resume from an "
                         "earlier checkpoint in checkpoints/") from None
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint.resume: {path} has format {state.get('format')}, this hybridrl reads "
                         f"{FORMAT_VERSION}; resume it with the hybridrl that wrote it, or start a new run from its "
                         "HF export with model.path=...")
    return state


def load_policy_weights(model: torch.nn.Module, directory: Path) -> None:
    """Copy the HF safetensors in ``directory`` into ``model`` in place (tied weights allowed)."""
    from hybridrl.rollout.hf_checkpoint import iter_safetensors_dir

    tensors = dict(iter_safetensors_dir(str(directory)))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"checkpoint.resume: the policy in {directory} does not match the configured model "
                         f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}); "
                         "resume with the run's own config")


def load_adapter_weights(lora, directory: Path) -> None:
    """A LoRA run's checkpoint: peft's ``adapter_model.safetensors`` into the policy in place."""
    from safetensors.torch import load_file

    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        raise ValueError(f"checkpoint.resume: {directory} has no adapter_model.safetensors; it was not written by "
                         "a LoRA run (model.lora.rank > 0); resume with the run's own config")
    lora.load_trainable_state(load_file(str(path)), f"checkpoint.resume: {path}")


def python_rng_state(state: tuple) -> list:
    """``random.Random.getstate()`` as lists (what ``torch.load(weights_only=True)`` reads)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def python_rng_tuple(state: list) -> tuple:
    """The inverse of :func:`python_rng_state` (for ``setstate``)."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
