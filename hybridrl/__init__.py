"""hybridrl: RL post-training of language models on a hybrid engine.

The public names import lazily so that ``import hybridrl`` stays fast and GPU-free.
"""

from __future__ import annotations

from hybridrl.lazy_exports import lazy_exports

__version__ = "0.1.0"

__getattr__, __all__ = lazy_exports(__name__, {
    "hybridrl.rollout": ["EngineSpec", "RolloutEngine", "SamplingParams", "Rollouts"],
    "hybridrl.config": ["Config"],
    "hybridrl.config.io": ["load_config"],
    "hybridrl.job.loop": ["train"],
    "hybridrl.refit": ["refit_from_model", "refit_session"],
})
