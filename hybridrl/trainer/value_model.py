"""The PPO value model: a Hugging Face base-model backbone (``AutoModel``) + a scalar value head.

Alignment matches the log-probs (docs/interfaces.md): ``values[b, t]`` is the value of the
state *before* token t, i.e. V(input_ids[b, :t]), read from the hidden state at t-1 — the
same position whose logits predict token t. So ``values`` lines up with ``response_mask``
and ``logprobs`` ``[B, L]``; position 0 and padding (attention_mask 0) hold 0.
Its optimizer and update live in ``critic.py`` (the Critic component).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybridrl.trainer.v4_indexer import engine_selection

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """``backbone`` (an HF base model returning ``last_hidden_state``) + ``value_head`` Linear(H, 1)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, bias=False, dtype=torch.float32)
        # small init (OpenRLHF): initial values ≈ 0 without freezing the backbone's gradient
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1))

    @classmethod
    def from_config(cls, hf_config, *, dtype: torch.dtype = torch.float32, seed: int | None = None) -> "ValueModel":
        """Random-init critic from an HF config (e.g. the actor's ``model.config``)."""
        from transformers import AutoModel

        if seed is not None:
            torch.manual_seed(seed)
        return cls(AutoModel.from_config(hf_config, dtype=dtype))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> "ValueModel":
        """From a local checkpoint directory: a saved critic, or any causal-LM / base-model checkpoint
        (the usual PPO start: the actor's or reward model's weights; ``lm_head`` is dropped and a
        fresh value head is created)."""
        from transformers import AutoModel

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"critic path {str(path)!r}: no config.json; point it at a local HF checkpoint directory")
        model = cls(AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True))
        head = path / VALUE_HEAD_FILE
        if head.is_file():
            from safetensors.torch import load_file

            model.value_head.load_state_dict(load_file(str(head)))
        return model

    def save_pretrained(self, path: str | Path) -> None:
        """HF-format backbone (config.json + safetensors) and ``value_head.safetensors``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()},
                  str(path / VALUE_HEAD_FILE))

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``input_ids, attention_mask [B, L]`` → ``values [B, L]`` float32 (V(prefix before t); see module doc)."""
        with engine_selection(self.backbone):  # DeepSeek-V4: a value independent of the padding (v4_indexer.py)
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        v = self.value_head(hidden.float()).squeeze(-1)  # (B, L): value after reading token t
        v = torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)  # shift: position t ← state before t
        return torch.where(attention_mask.bool(), v, 0.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.values(input_ids, attention_mask)
