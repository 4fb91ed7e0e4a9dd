"""The LoRA-trained policy: an HF causal LM wrapped by peft, and what leaves it.

The trainer works on :attr:`LoRAPolicy.model` — the HF model with peft's LoRA layers
injected (``peft_model.base_model.model``): every forward, FSDP2 sharding and log-prob path
of the full-fine-tuning run applies unchanged, and only the adapters require grad.

Names. peft renames a targeted module ``X``'s weight to ``X.base_layer.weight`` and adds
``X.lora_A.default.weight [r, in]`` / ``X.lora_B.default.weight [out, r]``. Towards the engine
the names are the HF ones: the base weight is ``X.weight`` again and the adapter is
``X.lora_A.weight`` / ``X.lora_B.weight`` (what the engine's route table expects), so
:meth:`base_tensors` is exactly the state dict of the model before wrapping.

The update a refit carries (peft's own definition): ``W' = W + scale · B @ A`` with
``scale = alpha / rank``; the adapter output is ``scale · B(A(x))``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from hybridrl.lora.targets import lora_targets

ADAPTER = "default"  # peft's adapter name; one adapter per policy


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank calls it in step)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str],
               init: str = "zeros") -> "LoRAPolicy":
    """Wrap ``model`` (in place: its linears are replaced) with peft LoRA adapters on the
    modules ``target_modules`` selects (``lora_targets``: one-line errors first). ``init``:
    ``zeros`` (peft's default: A Kaiming-uniform, B = 0) or ``gaussian`` (A ~ N(0, 1/r), B = 0);
    both start as the base model exactly."""
    from peft import LoraConfig, get_peft_model

    import re

    targets = lora_targets(model, target_modules, rank)
    pattern = "|".join(re.escape(t) for t in targets)  # a full-match regex of exactly the resolved names
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern, bias="none",
                        init_lora_weights=True if init == "zeros" else "gaussian")
    with _no_v4_adapter_conversion():
        peft_model = get_peft_model(model, config)
    policy = LoRAPolicy(peft_model, targets)
    missed = [n for n, layer in policy.layers.items() if not hasattr(layer, "lora_A")]
    if missed:
        raise RuntimeError(f"peft did not adapt {len(missed)} of the targeted modules ({', '.join(missed[:3])}); "
                           "check the installed peft version")
    return policy


@contextlib.contextmanager
def _no_v4_adapter_conversion():
    """peft 0.21 under transformers 5 rewrites a new adapter's targets as if it were a
    transformers-4 adapter being loaded: on MoE models it maps gate/up/down_proj onto the
    fused experts and silently drops the dense and shared-expert projections (measured on
    DeepSeek-V3: 6 of 12 targets lost). A new adapter needs no such conversion, so it is
    switched off while the adapter is created (``apply_lora`` still checks every target)."""
    from peft.tuners import tuners_utils

    saved = getattr(tuners_utils, "is_transformers_ge_v5", None)
    tuners_utils.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        tuners_utils.is_transformers_ge_v5 = saved


class LoRAPolicy:
    """``peft_model`` (a ``PeftModel``) and the full names of its adapted modules, ``targets``."""

    def __init__(self, peft_model, targets: list[str]):
        self.peft_model = peft_model
        self.model = peft_model.base_model.model  # the HF model with LoRA layers inside
        self.targets = list(targets)
        config = peft_model.peft_config[ADAPTER]
        self.rank, self.alpha = int(config.r), float(config.lora_alpha)
        self.scale = self.alpha / self.rank
        self.layers = {name: self.model.get_submodule(name) for name in self.targets}
        self.base_version = 0
        """+1 whenever the base weights change (a warm start, a resume's load): an engine that
        holds an older base needs a full refit, not just the adapters."""

    def adapter_disabled(self):
        """Context in which the policy computes the base model (the KL reference)."""
        return self.peft_model.disable_adapter()

    def base_parameters(self) -> list[torch.nn.Parameter]:
        """The base model's parameters, in ``named_parameters`` order (the order of the model
        before wrapping: peft registers ``base_layer`` before the adapters)."""
        return [p for n, p in self.model.named_parameters() if not is_adapter(n)]

    @contextlib.contextmanager
    def training_base(self):
        """The base trainable and the adapters off (a warm start that builds the base): the
        same forward, parameters and order as the unwrapped model, so the base it leaves is
        bitwise the one a full-fine-tuning run's warm start leaves. Frozen again on exit."""
        params = self.base_parameters()
        for p in params:
            p.requires_grad_(True)
        try:
            with self.adapter_disabled():
                yield params
        finally:
            for p in params:
                p.requires_grad_(False)
            self.base_version += 1

    def load_base(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Copy HF-named base tensors (``base_tensors()``'s names) into the policy in place."""
        from hybridrl.refit.transport import named_persistent_buffers

        own = [(hf_name(n), p) for n, p in self.model.named_parameters() if not is_adapter(n)]
        own += [(hf_name(n), b) for n, b in named_persistent_buffers(self.model)]
        missing = sorted(n for n, _ in own if n not in tensors)
        if missing or len(tensors) != len(own):
            raise ValueError(f"{where}: the saved base model does not match the configured model (missing "
                             f"{missing[:3]}); resume with the run's own config")
        with torch.no_grad():
            for name, t in own:
                t.copy_(tensors[name])
        self.base_version += 1

    # -- tensors towards the engine (HF names; whole tensors, gathered from FSDP2 shards) --
    def adapter_tensors(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """``X.lora_A.weight [r, in]`` and ``X.lora_B.weight [out, r]`` of every target, cast to
        ``dtype`` (the engine's: peft keeps adapters in float32 over a bf16 base, and the
        engine holds them in its own dtype, so a refit sends no more than that)."""
        out = []
        for name, layer in self.layers.items():
            for part, m in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                t = _full(m[ADAPTER].weight.detach())
                out.append((f"{name}.{part}.weight", t if dtype is None else t.to(dtype)))
        return out

    def merged_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``X.weight = W + scale · B @ A`` of every target (the product in float32, cast to W's dtype)."""
        out = []
        for name, layer in self.layers.items():
            w = _full(layer.base_layer.weight.detach())
            a, b = (_full(m[ADAPTER].weight.detach()) for m in (layer.lora_A, layer.lora_B))
            delta = (b.float() @ a.float()) * self.scale
            out.append((f"{name}.weight", (w.float() + delta).to(w.dtype)))
        return out

    def base_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and persistent buffer of the base model under its HF name (the
        model before wrapping); adapters left out."""
        from hybridrl.refit.transport import named_persistent_buffers

        out = [(hf_name(n), _full(p.detach())) for n, p in self.model.named_parameters() if not is_adapter(n)]
        return out + [(hf_name(n), b) for n, b in named_persistent_buffers(self.model)]

    def refit_tensors(self, mode: str, *, full: bool, dtype: torch.dtype | None = None
                      ) -> list[tuple[str, torch.Tensor]]:
        """What one refit sends: ``full`` (an engine that never held the base) — the base,
        with the targets merged (``mode="merged"``) or plus the adapter (``"adapter"``);
        otherwise only the adapter, or only the merged targets. ``dtype``: the engine's,
        for the adapters (see ``adapter_tensors``)."""
        if mode == "adapter":
            return (self.base_tensors() if full else []) + self.adapter_tensors(dtype)
        if mode != "merged":
            raise ValueError(f"LoRAPolicy.refit_tensors: mode={mode!r}; use adapter or merged")
        merged = self.merged_tensors()
        if not full:
            return merged
        replaced = dict(merged)
        return [(n, replaced.get(n, t)) for n, t in self.base_tensors()]

    def refit_payload(self, mode: str, held_base: int | None, dtype: torch.dtype | None = None
                      ) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """(tensors, partial) of the next refit of an engine that holds base version
        ``held_base`` (None: it holds nothing of this policy): the whole base too when that
        is not :attr:`base_version`, else only the adapters / merged targets (partial).
        After the refit succeeds the engine holds :attr:`base_version`."""
        full = held_base is None or held_base != self.base_version
        return self.refit_tensors(mode, full=full, dtype=dtype), not full

    # -- trainable state (checkpoints) -------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The adapters in peft's saved-file naming (``base_model.model.X.lora_A.weight``)."""
        from peft import get_peft_model_state_dict

        return {k: _full(v).contiguous() for k, v in get_peft_model_state_dict(self.peft_model).items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Copy saved adapters (peft naming) into the policy in place; a mismatch is one line naming ``where``."""
        from peft import set_peft_model_state_dict

        expected = set(self.trainable_state())
        if set(state) != expected:
            extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
            raise ValueError(f"{where}: the saved adapter does not match model.lora (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}); resume with the run's own config")
        with torch.no_grad():
            set_peft_model_state_dict(self.peft_model, state)

    def save_adapter(self, directory: Path) -> None:
        """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that
        ``PeftModel.from_pretrained(base, directory)`` loads."""
        self.peft_model.save_pretrained(str(directory), safe_serialization=True)

    def write_adapter(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        """:meth:`save_adapter` from an already gathered :meth:`trainable_state` (a sharded
        run: every rank gathers, one writes)."""
        from safetensors.torch import save_file

        self.peft_model.peft_config[ADAPTER].save_pretrained(str(directory))
        save_file({k: v.cpu() for k, v in state.items()}, str(Path(directory) / "adapter_model.safetensors"),
                  metadata={"format": "pt"})

    def merged_copy(self) -> torch.nn.Module:
        """A plain HF model with the adapters merged in (``merge_and_unload`` of a copy)."""
        import copy

        return copy.deepcopy(self.peft_model).merge_and_unload()

    def describe(self) -> str:
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        return (f"LoRA rank {self.rank}, alpha {self.alpha:g} on {len(self.targets)} modules: "
                f"{trainable / 1e6:.3f}M trainable of {total / 1e6:.2f}M")


def is_adapter(param_name: str) -> bool:
    return ".lora_A." in param_name or ".lora_B." in param_name


def hf_name(param_name: str) -> str:
    """A base parameter's HF name (peft's ``X.base_layer.weight`` -> ``X.weight``)."""
    return param_name.replace(".base_layer.", ".")

