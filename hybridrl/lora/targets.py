"""Which ``nn.Linear`` modules of an HF model get LoRA adapters, checked before peft runs.

peft matches a list of ``target_modules`` by name suffix (``key == t`` or ``key`` ends
with ``"." + t``); we resolve the list the same way, once, so that the trainer (peft, given
the resolved full names) and the rollout engine (built before the policy is wrapped)
adapt exactly the same modules. Every way it cannot work is one line naming the key.
"""

from __future__ import annotations

import torch

from hybridrl.config.base import ConfigError


# A vision-language model's vision tower (transformers' Qwen VL ``model.visual``) is never
# adapted: LoRA targets the language model (its MLPs share the names gate/up/down_proj).
VISION_TOWER = "visual"


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def lora_targets(model: torch.nn.Module, target_modules: list[str], rank: int) -> list[str]:
    """Full module names of the ``nn.Linear`` modules ``target_modules`` selects, in model order.

    Entries that match nothing are skipped, as peft does (the default list names the
    projections of every family). Raises a one-line :class:`ConfigError` when the list as a
    whole matches no ``nn.Linear`` (listing the model's linear module names; MoE routed
    experts are fused 3-D parameters, routers are not linears), or when ``rank`` exceeds a
    targeted module's smaller dimension (its update would not be low-rank). A VL model's
    vision tower (``VISION_TOWER``) is left out: adapters go on the language model only."""
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and VISION_TOWER not in n.split(".")}
    chosen = [n for n in linears if any(_matches(n, t) for t in target_modules)]
    if not chosen:  # peft's rule too: entries may miss (one list serves several families), not all of them
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        others = sorted({type(m).__name__ for n, m in model.named_modules()
                         if n and not isinstance(m, torch.nn.Linear) and any(_matches(n, t) for t in target_modules)})
        what = (f"match only {', '.join(others)} modules, which are not nn.Linear (MoE routed experts are fused "
                "3-D parameters and take no adapter)") if others else "match no module of this model"
        raise ConfigError(f"model.lora.target_modules={list(target_modules)} {what}; its linear modules are "
                          f"{', '.join(suffixes)}")
    for name in chosen:
        layer = linears[name]
        smaller = min(layer.in_features, layer.out_features)
        if rank > smaller:
            raise ConfigError(f"model.lora.rank={rank} exceeds {name} ({layer.out_features} x {layer.in_features}): "
                              f"use a rank <= {smaller} or leave {name.rsplit('.', 1)[-1]} out of "
                              "model.lora.target_modules")
    return chosen
