"""Typed run configuration: one dataclass per component, validated at construction.

``Config`` holds the groups (``model``, ``data``, ``rollout``, ``reward``, ``algo``,
``optim``, ``batch``, ``warm_start``, ``trainer``, ``checkpoint``, ``launcher``, ``refit``,
``eval``, ``logging``; the job's groups are in ``job.py``); ``algo`` nests one dataclass per concern
(``algo.advantage``, ``algo.policy_loss``, ``algo.kl``, ``algo.correction``,
``algo.dapo``, ``algo.value``) and takes published recipes as ``algo.preset``.
Reading YAML and dotted overrides: ``hybridrl/config/io.py``.
"""

from hybridrl.config.algo import (AdvantageConfig, AlgoConfig, CorrectionConfig, DapoConfig, KLConfig,
                                  PolicyLossConfig, ValueConfig)
from hybridrl.config.base import ConfigError
from hybridrl.config.groups import (GROUPS, Config, DataConfig, EvalConfig, LoggingConfig, OptimConfig, RewardConfig,
                                    RolloutConfig)
from hybridrl.config.model import LoRAConfig, ModelConfig
from hybridrl.config.job import (BatchConfig, CheckpointConfig, LauncherConfig, PipelineConfig, RefitConfig,
                                 TrainerConfig, WarmStartConfig)
from hybridrl.config.presets import PRESETS

__all__ = [
    "AdvantageConfig", "AlgoConfig", "BatchConfig", "CheckpointConfig", "LauncherConfig", "RefitConfig",
    "WarmStartConfig", "Config", "ConfigError", "CorrectionConfig", "DapoConfig", "DataConfig", "EvalConfig",
    "GROUPS", "KLConfig", "LoggingConfig", "LoRAConfig", "ModelConfig", "OptimConfig", "PipelineConfig", "PRESETS", "PolicyLossConfig",
    "RewardConfig", "RolloutConfig", "TrainerConfig", "ValueConfig",
]
