"""Reward functions: the API, a registry of built-ins, and a runner that isolates failures."""

from hybridrl.rewards.registry import get_reward_fn, register_reward, REWARD_FNS
from hybridrl.rewards.runner import RewardRunner, RewardBatch

__all__ = ["get_reward_fn", "register_reward", "REWARD_FNS", "RewardRunner", "RewardBatch"]
