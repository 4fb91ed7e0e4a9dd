"""Typed run configuration: one dataclass per component, validated at construction.

``Config`` holds the groups (``model``, ``data``, ``rollout``, ``reward``, ``algo``,
``optim``, ``trainer``, ``logging``); ``algo`` nests one dataclass per concern
(``algo.advantage``, ``algo.policy_loss``, ``algo.kl``, ``algo.correction``,
``algo.dapo``, ``algo.value``) and takes published recipes as ``algo.preset``.
Reading YAML and dotted overrides: ``hybridrl/config/io.py``.
"""

from hybridrl.config.algo import (AdvantageConfig, AlgoConfig, CorrectionConfig, DapoConfig, KLConfig,
                                  PolicyLossConfig, ValueConfig)
from hybridrl.config.base import ConfigError
from hybridrl.config.groups import (GROUPS, Config, DataConfig, EvalConfig, LoggingConfig, ModelConfig, OptimConfig,
                                    RewardConfig, RolloutConfig, TrainerConfig)
from hybridrl.config.presets import PRESETS

__all__ = [
    "AdvantageConfig", "AlgoConfig", "Config", "ConfigError", "CorrectionConfig", "DapoConfig", "DataConfig", "EvalConfig",
    "GROUPS", "KLConfig", "LoggingConfig", "ModelConfig", "OptimConfig", "PRESETS", "PolicyLossConfig",
    "RewardConfig", "RolloutConfig", "TrainerConfig", "ValueConfig",
]
