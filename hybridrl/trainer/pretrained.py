"""A local Hugging Face checkpoint directory, loaded for training: ``load_pretrained`` (model +
tokenizer) and ``load_tokenizer``, with ``check_checkpoint`` first, so that every way the
directory can be unusable is a one-line ValueError naming it (never the hub)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch


def load_pretrained(path: str, dtype: torch.dtype, *, where: str = "model.path"):
    """Model + tokenizer from a local HF checkpoint directory (never the hub); a vision-language
    config (one with a ``vision_config``: Qwen2.5-VL, Qwen3-VL) loads as an image-text-to-text model.

    Every way the directory can be unusable is a one-line ValueError naming ``where=path``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    p = check_checkpoint(path, where)
    tokenizer = load_tokenizer(path, where)
    auto = AutoModelForImageTextToText if "vision_config" in _read_json(p / "config.json", path, where) \
        else AutoModelForCausalLM
    with checkpoint_errors(path, where, "cannot load the model"):
        model = auto.from_pretrained(p, dtype=dtype, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


_TOKENIZER_FIX = "the directory needs the tokenizer files saved with the model (tokenizer.json, ...)"


def load_tokenizer(path: str, where: str = "model.path"):
    from transformers import AutoTokenizer

    with checkpoint_errors(path, where, "cannot load its tokenizer", _TOKENIZER_FIX):
        tokenizer = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
        # without its files, transformers builds an empty tokenizer of the model's class
        empty = not tokenizer.encode("0 a", add_special_tokens=False)
    if empty:
        raise ValueError(f"{where}={path}: cannot load its tokenizer (no vocabulary found); {_TOKENIZER_FIX}")
    return tokenizer


_FIX = "point it at a local HF checkpoint directory (config.json and model.safetensors)"
_RESAVE = "save or copy the checkpoint again"


@contextlib.contextmanager
def checkpoint_errors(path: str, where: str, what: str, fix: str = _RESAVE) -> Iterator[None]:
    """Turn what a library raises while reading the checkpoint into one line naming it.

    Broad on purpose: transformers, tokenizers and safetensors raise OSError, ValueError
    with several lines, KeyError, SafetensorError or a bare Exception for a bad file; with
    ``HYBRIDRL_DEBUG=1`` the CLI shows the original traceback (it is chained)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise ValueError(f"{where}={path}: {what} ({_first_line(e)}); {fix}") from e


def check_checkpoint(path: str, where: str = "model.path") -> Path:
    """``path`` as a Path if it is a local HF checkpoint directory whose config.json parses
    and whose safetensors files are complete (their headers cover the file); else a
    one-line ValueError. Cheap: it maps the headers only."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{where}={path}: {'not a directory' if p.exists() else 'no such directory'}; {_FIX}")
    if (p / "adapter_config.json").is_file():
        raise ValueError(f"{where}={path}: a LoRA adapter checkpoint, not a model; run `hybridrl export {path} OUT "
                         "--merged` and use OUT/merged")
    if not (p / "config.json").is_file():
        raise ValueError(f"{where}={path}: no config.json there; {_FIX}")
    config = _read_json(p / "config.json", path, where)
    if not isinstance(config, dict):
        raise ValueError(f"{where}={path}: config.json is not a JSON object; {_RESAVE}")
    for shard in _safetensors_files(p, path, where):
        _check_safetensors(shard, path, where)
    return p


def _read_json(file: Path, path: str, where: str):
    try:
        return json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}={path}: {file.name} is not valid JSON ({_first_line(e)}); {_RESAVE}") from None


def _safetensors_files(p: Path, path: str, where: str) -> list[Path]:
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, path, where)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{where}={path}: {index.name} has no weight_map of file names; {_RESAVE}")
        shards = [p / name for name in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ValueError(f"{where}={path}: {index.name} lists {', '.join(missing[:3])}, not in the directory; "
                             f"{_RESAVE}")
        return shards
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    if any((p / name).is_file() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        return []  # the trainer's transformers loader reads these; errors surface when loading
    raise ValueError(f"{where}={path}: no weights there (model.safetensors or model.safetensors.index.json); "
                     f"the checkpoint is incomplete: {_RESAVE}")


def _check_safetensors(file: Path, path: str, where: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 - SafetensorError (a bare Exception subclass) or OSError
        raise ValueError(f"{where}={path}: {file.name} is truncated or corrupt ({_first_line(e)}); {_RESAVE}") from e


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].strip()}" if lines else type(error).__name__
