"""Reward functions: the API, a registry of built-ins, and a runner that isolates failures.

Built-ins: ``exact_match``, ``last_number``, ``gsm8k``, ``math_verify`` (needs the
``math`` extra), ``format`` (a regex; options: ``pattern``), ``reward_model`` (a local
sequence-classification checkpoint; options: ``path``, ``normalize``, ``placement``...) and ``judge`` (a local
causal LM that grades each response, served by our engine; options: ``judge.JudgeOptions``). ``build_reward`` turns a
config spec (a name, a ``path/to/file.py:fn``, or a weighted list) into a reward.
"""

# the task modules register their built-ins when imported
import hybridrl.rewards.gsm8k  # noqa: F401
import hybridrl.rewards.judge  # noqa: F401
import hybridrl.rewards.math_equivalence  # noqa: F401
import hybridrl.rewards.reasoning_gym  # noqa: F401 - reasoning-gym itself is imported at the first call
import hybridrl.rewards.reward_model  # noqa: F401
from hybridrl.rewards.breaker import RewardBrokenError
from hybridrl.rewards.combine import CombinedReward, combine
from hybridrl.rewards.outcome import RewardFailure
from hybridrl.rewards.regex_format import FormatReward, format_reward
from hybridrl.rewards.registry import (REWARD_FACTORIES, REWARD_FNS, get_reward_fn, register_reward,
                                       register_reward_factory)
from hybridrl.rewards.runner import RewardBatch, RewardRunner
from hybridrl.rewards.spec import build_reward

__all__ = ["get_reward_fn", "register_reward", "register_reward_factory", "REWARD_FNS", "REWARD_FACTORIES",
           "RewardFailure", "RewardBrokenError", "RewardRunner", "RewardBatch", "build_reward", "combine", "CombinedReward",
           "format_reward", "FormatReward"]
