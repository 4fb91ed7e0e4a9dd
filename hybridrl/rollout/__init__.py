"""Built-in rollout engine. Names resolve lazily so `import hybridrl` stays fast."""

from __future__ import annotations

__all__ = ["EngineSpec", "RolloutEngine", "SamplingParams", "Rollouts"]

_MODULES = {
    "EngineSpec": "hybridrl.rollout.backend",
    "RolloutEngine": "hybridrl.rollout.engine",
    "SamplingParams": "hybridrl.rollout.sampling_params",
    "Rollouts": "hybridrl.rollout.rollouts",
}


def __getattr__(name: str):
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'hybridrl.rollout' has no attribute {name!r}")
