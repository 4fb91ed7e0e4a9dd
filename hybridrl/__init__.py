"""hybridrl: RL post-training of language models on a hybrid engine.

The public names import lazily so that ``import hybridrl`` stays fast and GPU-free.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "EngineSpec": "hybridrl.rollout",
    "RolloutEngine": "hybridrl.rollout",
    "SamplingParams": "hybridrl.rollout",
    "Rollouts": "hybridrl.rollout",
    "Config": "hybridrl.config",
    "load_config": "hybridrl.config.io",
    "train": "hybridrl.job.loop",
    "refit_from_model": "hybridrl.refit",
    "refit_session": "hybridrl.refit",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")
