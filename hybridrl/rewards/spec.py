"""Build a reward from its config: a name/path string, or a weighted list of rewards.

``reward.functions`` is either ``"gsm8k"`` / ``"path/to/file.py:fn"`` / ``"module:fn"``,
or a list of ``{"name": str, "weight": float = 1.0, "label": str = name, **options}``,
where options go to the reward's factory (``format``'s ``pattern``)::

    [{"name": "math_verify", "weight": 1.0},
     {"name": "format", "weight": 0.1, "pattern": "^<think>.*</think>"}]

A list of one entry with weight 1 and no label is that reward alone (no extra metrics).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hybridrl.rewards.combine import CombinedReward, check_weight, unique_labels
from hybridrl.rewards.registry import RewardFn, get_reward_fn

_RESERVED = ("name", "weight", "label")


def build_reward(spec: str | Sequence[Mapping[str, Any]] | RewardFn, *,
                 where: str = "reward.functions") -> RewardFn:
    """The reward callable that ``spec`` describes (a callable is returned as is)."""
    if isinstance(spec, str):
        return get_reward_fn(spec, where=where)
    if callable(spec):
        return spec
    if not isinstance(spec, Sequence) or not spec:
        raise ValueError(f"{where}={spec!r}: give a reward name, a path/to/file.py:fn, "
                         f"or a non-empty list of {{name, weight}} entries")
    parts = [_build_part(entry, f"{where}[{i}]") for i, entry in enumerate(spec)]
    if len(parts) == 1 and parts[0][2] == 1.0 and "label" not in spec[0]:
        return parts[0][1]
    return CombinedReward(unique_labels(parts))


def _build_part(entry: Any, where: str) -> tuple[str, RewardFn, float]:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}={entry!r}: each entry must be a mapping like {{name: gsm8k, weight: 1.0}}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: missing 'name' (a built-in reward, path/to/file.py:fn or module:fn)")
    options = {k: v for k, v in entry.items() if k not in _RESERVED}
    odd = [k for k in options if not isinstance(k, str)]
    if odd:
        raise ValueError(f"{where}: option names must be strings, got {odd[0]!r}; write {{name: ..., option: value}}")
    fn = get_reward_fn(name, where=f"{where}.name", **options)
    label = entry.get("label", name.rpartition(":")[2])
    if not isinstance(label, str) or not label:
        raise ValueError(f"{where}.label={label!r}: must be a non-empty string")
    return label, fn, check_weight(entry.get("weight", 1.0), where)
