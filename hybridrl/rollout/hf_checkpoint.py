"""Hugging Face checkpoint directories as ``(name, tensor)`` streams (safetensors, local only).

The stream feeds ``RolloutEngine.load_weights`` like any trainer's ``named_parameters()``:
a checkpoint is one more source for the same in-place weight update.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch


def iter_safetensors_dir(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from `model.safetensors` or the shards listed in `model.safetensors.index.json`."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}; "
                         f"pass a local Hugging Face checkpoint directory saved with safetensors")
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
