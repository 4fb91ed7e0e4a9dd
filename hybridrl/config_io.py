"""Reading a :class:`~hybridrl.config.Config`: YAML files, dotted CLI overrides, type checks.

Unknown groups and keys fail with the nearest valid key suggested; values are checked
against the dataclass annotations (strings from the CLI parse as YAML first).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from hybridrl.config import GROUPS, Config, ConfigError


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _suggest(name: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    return f"; valid keys: {', '.join(prefix + c for c in sorted(choices))}"


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
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r}: expected a string")
    return value


def _resolve_type(cls: type, name: str) -> Any:  # noqa: D401
    return typing.get_type_hints(cls)[name]


def build_config(tree: dict[str, Any] | None = None, *, source: str = "config") -> Config:
    """Build a validated :class:`Config` from a nested dict (YAML-shaped)."""
    tree = tree or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: top level must be a mapping of groups ({', '.join(GROUPS)})")
    groups: dict[str, Any] = {}
    for gname, gval in tree.items():
        if gname not in GROUPS:
            raise ConfigError(f"{source}: unknown group {gname!r}{_suggest(gname, list(GROUPS))}")
        cls = GROUPS[gname]
        if not isinstance(gval, dict):
            raise ConfigError(f"{source}: group {gname!r} must be a mapping of keys")
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for k, v in gval.items():
            if k not in names:
                raise ConfigError(f"{source}: unknown key {gname}.{k}{_suggest(k, names, gname + '.')}")
            try:
                kwargs[k] = _coerce(v, _resolve_type(cls, k), f"{gname}.{k}")
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        try:
            groups[gname] = cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
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
        group, name = key.split(".", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        tree.setdefault(group, {})[name] = value
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k].update(v)
        else:
            out[k] = v
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
        source = str(p)
    tree = _merge(tree, parse_overrides(overrides or []))
    return build_config(tree, source=source)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def help_text() -> str:
    """The groups and their keys with defaults and docs, for ``hybridrl train --help``."""
    lines = []
    for gname, cls in GROUPS.items():
        lines.append(f"{gname}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {gname}.{f.name} = {default!r}  -- {f.metadata.get('help', '')}")
    return "\n".join(lines)
