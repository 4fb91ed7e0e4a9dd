"""``hybridrl export``: a LoRA run's checkpoint as folders other tools load.

- ``OUT/adapter``: a peft adapter folder (``PeftModel.from_pretrained(base, OUT/adapter)``);
  its ``base_model_name_or_path`` names the base folder;
- ``OUT/base``: the base model in HF format, when it is not the run's ``model.path`` (the
  built-in task's warm-started base, ``lora_base.safetensors`` in the run directory);
- ``OUT/merged`` (``--merged``): one HF model with the adapter merged in.

Everything is written into a temporary sibling of ``OUT`` and renamed at the end, so a
failed export leaves no partial folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def export_lora(checkpoint: str, out: str, *, merged: bool = False) -> Path:
    """Export the LoRA checkpoint directory ``checkpoint`` into ``out`` (must not exist); returns ``out``."""
    from hybridrl.config.io import load_config

    ckpt, dest = Path(checkpoint).resolve(), Path(out).resolve()
    if not (ckpt / "hybridrl_config.yaml").is_file():
        raise ValueError(f"hybridrl export: {checkpoint} is not a hybridrl checkpoint (no hybridrl_config.yaml); "
                         "give a run's checkpoint directory, e.g. runs/NAME/checkpoint")
    missing = [f for f in ADAPTER_FILES if not (ckpt / f).is_file()]
    if missing:
        raise ValueError(f"hybridrl export: {checkpoint} has no {missing[0]}; it is not a LoRA run's checkpoint "
                         "(model.lora.rank > 0) — a full run's checkpoint is already an HF model folder")
    if dest.exists():
        raise ValueError(f"hybridrl export: {out} already exists; choose a new output directory")
    cfg = load_config(str(ckpt / "hybridrl_config.yaml"))
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        base, tokenizer, base_dir = _base_model(cfg, ckpt, tmp)
        adapter = tmp / "adapter"
        adapter.mkdir(parents=True)
        for name in ADAPTER_FILES:
            shutil.copy2(ckpt / name, adapter / name)
        config = json.loads((adapter / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(dest / "base") if base_dir is None else base_dir
        (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2))
        if merged:
            from peft import PeftModel

            model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
            model.save_pretrained(tmp / "merged", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "merged")
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _base_model(cfg, ckpt: Path, tmp: Path):
    """The run's base model and tokenizer; writes ``tmp/base`` unless the base is ``model.path``
    (then returns that path as the adapter's base)."""
    from hybridrl.trainer.pretrained import load_pretrained, load_tokenizer

    tokenizer = load_tokenizer(str(ckpt), "hybridrl export")
    run_dir = ckpt.parent.parent  # RUN/checkpoints/step-N (RUN/checkpoint links there)
    base_file = run_dir / "lora_base.safetensors"
    if not base_file.is_file():
        if cfg.model.path is None:
            raise ValueError(f"hybridrl export: {base_file} is missing; export from the run's own directory "
                             "(runs/NAME/checkpoint), where the run wrote its base")
        base, _ = load_pretrained(cfg.model.path, cfg.model.torch_dtype)
        return base, tokenizer, str(Path(cfg.model.path).resolve())
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    with safe_open(str(base_file), framework="pt") as f:
        meta = f.metadata() or {}
    if "hf_config" not in meta:
        raise ValueError(f"hybridrl export: {base_file} carries no model config (written by an older hybridrl); "
                         "rerun the job with this version")
    hf_config = json.loads(meta["hf_config"])
    config = AutoConfig.for_model(**hf_config)
    auto = AutoModelForImageTextToText if "vision_config" in hf_config else AutoModelForCausalLM  # VL layout
    base = auto.from_config(config, dtype=cfg.model.torch_dtype)
    tensors = load_file(str(base_file))
    missing, unexpected = base.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"hybridrl export: {base_file} does not match its model config (missing "
                         f"{sorted(set(missing) - tied)[:3]}); the run directory is damaged")
    base.save_pretrained(tmp / "base", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "base")
    return base, tokenizer, None
