"""LoRA RL: the policy trains peft adapters; the engine gets the adapter (or the merged
targeted weights) at each refit; the reference is the base under ``disable_adapter()``.

- ``targets.py``  which modules get adapters, and the one-line errors when that cannot work;
- ``policy.py``   :class:`LoRAPolicy`: the peft-wrapped policy and the tensors a refit,
                  a checkpoint and an export take from it.
"""

from hybridrl.lora.policy import LoRAPolicy, apply_lora
from hybridrl.lora.targets import lora_targets

__all__ = ["LoRAPolicy", "apply_lora", "lora_targets"]
