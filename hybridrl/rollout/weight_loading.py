"""Weight loading: HF-named tensors -> each parameter's `weight_loader`, in place.

The first load and every refit run this same loop, so a load never reallocates what a
captured CUDA graph holds. Sources: any `(name, tensor)` iterable (a `state_dict()`
or `named_parameters()` stream) or a local safetensors checkpoint directory.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import torch
from torch import nn

from hybridrl.rollout.layers.linear import LinearBase


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Write every tensor through its parameter's loader; returns the HF names written.

    A tied `lm_head.weight` is accepted and ignored (the embedding is the same storage).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in named_tensors:
            if hf_name == "lm_head.weight" and model.lm_head.tied:
                continue
            name, shard_id = model.resolve(hf_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"weight {hf_name!r} has no slot in the rollout model; check that the "
                                 f"checkpoint's architecture matches the engine config")
            try:
                param.weight_loader(param, tensor.detach(), shard_id)
            except ValueError as e:
                raise ValueError(f"loading {hf_name!r}: {e}") from None
            loaded.add(hf_name)
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.method.process_weights_after_loading(module)
    return loaded


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
