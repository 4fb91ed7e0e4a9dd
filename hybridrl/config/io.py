"""Reading a :class:`~hybridrl.config.Config`: YAML files, dotted CLI overrides, type checks.

Unknown groups and keys fail with the nearest valid key suggested; values are checked
against the dataclass annotations (strings from the CLI parse as YAML first).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from hybridrl.config import GROUPS, Config, ConfigError
from hybridrl.did_you_mean import suggest


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# Keys of earlier releases -> where they live now (one-line error naming the new key).
RENAMED = {
    # the 28-field trainer group, split by concern (config/job.py)
    "trainer.prompts_per_step": "batch.prompts_per_step",
    "trainer.mini_batch_size": "batch.mini_batch_size",
    "trainer.ppo_epochs": "batch.ppo_epochs",
    "trainer.max_tokens_per_microbatch": "batch.max_tokens_per_microbatch",
    "trainer.shared_prefix": "batch.shared_prefix",
    "trainer.sft_steps": "warm_start.steps",
    "trainer.sft_batch_size": "warm_start.batch_size",
    "optim.sft_lr": "warm_start.lr",
    "trainer.save_checkpoint": "checkpoint.save",
    "trainer.save_every": "checkpoint.every",
    "trainer.keep_last": "checkpoint.keep_last",
    "trainer.resume": "checkpoint.resume",
    "trainer.launcher": "launcher.name",
    "trainer.nnodes": "launcher.nnodes",
    "trainer.nproc_per_node": "launcher.nproc_per_node",
    "trainer.num_workers": "launcher.num_workers",
    "trainer.ray_address": "launcher.ray_address",
    "trainer.ray_placement": "launcher.ray_placement",
    "trainer.dist_timeout_s": "launcher.timeout_s",
    "trainer.refit_bucket_mb": "refit.bucket_mb",
    "trainer.refit_verify": "refit.verify",
    "algo.adv_estimator": "algo.advantage.estimator",
    "algo.norm_adv_by_std_in_grpo": "algo.advantage.norm_by_std",
    "algo.gamma": "algo.advantage.gamma",
    "algo.lam": "algo.advantage.lam",
    "algo.clip_ratio_low": "algo.policy_loss.clip_ratio_low",
    "algo.clip_ratio_high": "algo.policy_loss.clip_ratio_high",
    "algo.clip_ratio_c": "algo.policy_loss.clip_ratio_c",
    "algo.entropy_coeff": "algo.policy_loss.entropy_coeff",
    "algo.kl_coef": "algo.kl.coef",
    "algo.kl_estimator": "algo.kl.estimator",
    "algo.use_kl_loss": "algo.kl.use_loss",
    "algo.adaptive_kl_target": "algo.kl.adaptive_target",
    "algo.kl_horizon": "algo.kl.horizon",
    "algo.tis_cap": "algo.correction.tis_cap",
    "algo.mismatch_seq_upper": "algo.correction.mismatch_seq_upper",
    "algo.mismatch_seq_lower": "algo.correction.mismatch_seq_lower",
    "algo.dynamic_sampling": "algo.dapo.dynamic_sampling",
    "algo.dynamic_sampling_refill_rounds": "algo.dapo.refill_rounds",
    "algo.overlong_filter": "algo.dapo.overlong_filter",
    "algo.overlong_buffer_len": "algo.dapo.overlong_buffer_len",
    "algo.overlong_penalty_factor": "algo.dapo.overlong_penalty_factor",
    "algo.cliprange_value": "algo.value.cliprange",
    "reward.function": "reward.functions",
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to the annotated type ``tp`` (strings from the CLI parse as YAML)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                if isinstance(value, (list, tuple)) and typing.get_origin(a) is list:
                    errors.insert(0, str(e))  # a list: the list branch's error says what is wrong inside it
                else:
                    errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[a,b]")
        return [_coerce(v, args[0], key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        raise ConfigError(f"{key}={value!r:.80}: expected a mapping of names to values, e.g. {{name: x, weight: 1}}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int beyond the float range (a YAML 9999...9)
                raise ConfigError(f"{key}: a {len(str(abs(value)))}-digit integer is beyond the float range; "
                                  "give a finite number") from None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        hint = " (YAML reads unquoted on/off/yes/no as booleans: quote the word)" if isinstance(value, bool) else ""
        raise ConfigError(f"{key}={value!r}: expected a string{hint}")
    return value


def _is_group(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def _build(cls: type, tree: Any, key: str, source: str) -> Any:
    """Instantiate dataclass ``cls`` from the mapping ``tree`` found at dotted ``key``."""
    if not isinstance(tree, dict):
        if key == "algo.policy_loss" and isinstance(tree, str):
            raise ConfigError(f"{source}: algo.policy_loss is a group now; use algo.policy_loss.name={tree}")
        raise ConfigError(f"{source}: {key} must be a mapping of keys (e.g. {key}.<key>=value)")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in tree.items():
        full = f"{key}.{k}"
        if k not in names:
            if full in RENAMED:
                raise ConfigError(f"{source}: {full} was renamed to {RENAMED[full]}; use {RENAMED[full]}=...")
            raise ConfigError(f"{source}: unknown key {full}; {_suggest_key(full, key, names)}")
        tp = hints[k]
        if _is_group(tp):
            kwargs[k] = _build(tp, v, full, source)
            continue
        try:
            kwargs[k] = _coerce(v, tp, full)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _suggest_key(full: str, group: str, names: list[str]) -> str:
    """Nearest valid key, looking through renamed keys too (``algo.kl_cof`` → ``algo.kl.coef``)."""
    renamed = {old.rsplit(".", 1)[1]: new for old, new in RENAMED.items() if old.rsplit(".", 1)[0] == group}
    hint = suggest(full.rsplit(".", 1)[1], list(names) + list(renamed), prefix=group + ".", quote=False)
    for old, new in renamed.items():
        hint = hint.replace(f"{group}.{old}?", f"{new}?")
    return hint


def _apply_preset(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """Preset values under the user's ``algo`` keys (explicit keys win)."""
    from hybridrl.config.groups import RolloutConfig
    from hybridrl.config.presets import PRESETS, preset_values

    algo = tree.get("algo")
    if not isinstance(algo, dict) or algo.get("preset") is None:
        return tree
    name = algo["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"{source}: algo.preset={name!r} is unknown; {suggest(name, PRESETS)}")
    rollout = tree.get("rollout") if isinstance(tree.get("rollout"), dict) else {}
    max_tokens = rollout.get("max_tokens", RolloutConfig().max_tokens)
    max_tokens = max_tokens if isinstance(max_tokens, int) else RolloutConfig().max_tokens
    return {**tree, "algo": _merge(preset_values(name, max_tokens), algo)}


def build_config(tree: dict[str, Any] | None = None, *, source: str = "config") -> Config:
    """Build a validated :class:`Config` from a nested dict (YAML-shaped)."""
    tree = tree or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: top level must be a mapping of groups ({', '.join(GROUPS)})")
    for gname in tree:
        if gname not in GROUPS:
            raise ConfigError(f"{source}: unknown group {gname!r}; {suggest(gname, list(GROUPS), quote=False)}")
    tree = _apply_preset(tree, source)
    groups = {g: _build(GROUPS[g], v, g, source) for g, v in tree.items()}
    try:
        return Config(**groups)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["trainer.total_steps=200", "algo.kl_coef=0"]`` → nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected group.key=value, e.g. trainer.total_steps=200")
        key, raw = item.split("=", 1)
        *groups, name = key.split(".")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]}); "
                              "quote it or fix the brackets") from None
        if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
            value = raw.strip()  # YAML 1.1 reads on/off/yes/no as booleans; keep the word (resume=off)
        node = tree
        for g in groups:
            node = node.setdefault(g, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {g} was also given a plain value")
        node[name] = value
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: ``extra``'s keys win, nested mappings merge key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (optional) plus dotted overrides → validated :class:`Config`."""
    tree: dict[str, Any] = {}
    source = "overrides"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {path}: file not found")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a UTF-8 text file; give a YAML config") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of groups ({', '.join(GROUPS)})")
        source = str(p)
    tree = _merge(tree, parse_overrides(overrides or []))
    return build_config(tree, source=source)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def help_text() -> str:
    """The groups and their keys with defaults and docs, for ``hybridrl train --help``."""
    lines: list[str] = []

    def walk(cls: type, prefix: str, depth: int) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _is_group(hints[f.name]):
                lines.append(f"{'  ' * depth}{prefix}{f.name}:")
                walk(hints[f.name], f"{prefix}{f.name}.", depth + 1)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"{'  ' * depth}{prefix}{f.name} = {default!r}  -- {f.metadata.get('help', '')}")

    for gname, cls in GROUPS.items():
        lines.append(f"{gname}:")
        walk(cls, f"{gname}.", 1)
    return "\n".join(lines)
