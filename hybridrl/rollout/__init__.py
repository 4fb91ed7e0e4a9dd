"""Built-in rollout engine. Names resolve lazily so `import hybridrl` stays fast."""

from __future__ import annotations

from hybridrl.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "hybridrl.rollout.backend": ["EngineSpec"],
    "hybridrl.rollout.engine": ["RolloutEngine"],
    "hybridrl.rollout.sampling_params": ["SamplingParams"],
    "hybridrl.rollout.rollouts": ["Rollouts"],
    "hybridrl.rollout.requests": ["RequestOutput", "StepOutput"],
})
