"""Score conversations with a sequence-classification checkpoint, in token-budgeted micro-batches.

A reward model (Skywork-Reward and its kin: ``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ``Qwen3ForSequenceClassification``) is a decoder whose
``score`` head (``Linear(hidden, num_labels=1)``) reads the hidden state of one token.
transformers picks that token per row as the rightmost one whose id is not
``config.pad_token_id`` (the last token when there is no pad id). We pick the same token
from each row's *own* ids before padding, and pad with an attention mask and position ids
``cumsum(mask) - 1``, so a score does not depend on the padding side, on which rows share a
micro-batch, or on a pad id that also occurs inside the text.

The conversation is rendered with the reward model's own tokenizer: its chat template over
``[user: prompt, assistant: response]`` when it has one, else ``prompt + response`` with the
tokenizer's usual special tokens. The policy's vocabulary plays no part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def render(tokenizer, prompt: str, response: str) -> list[int]:
    """The token ids the reward model reads for one (prompt, response) pair."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote its own bos
    return tokenizer(prompt + response)["input_ids"]


def pooled_index(ids: list[int], pad_token_id: int | None) -> int:
    """The position whose hidden state the score head reads: transformers' rule (the
    rightmost id that is not the pad id; 0 when every id is; the last with no pad id)."""
    if pad_token_id is None:
        return len(ids) - 1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] != pad_token_id:
            return i
    return 0


def plan_microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices grouped so that ``rows * longest <= max_tokens`` (padded tokens), longest
    rows first, so rows of similar length share a micro-batch and padding stays small. A
    row longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        # sorted longest first: a micro-batch's first row is its longest
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass
class LoadedScorer:
    """A sequence-classification model and its tokenizer, loaded from one directory."""

    model: Any  # a *ForSequenceClassification (its base model and its ``score`` head)
    tokenizer: Any
    pad_token_id: int | None  # config.pad_token_id: what transformers' pooling skips
    fill_id: int  # the id written into padding (masked out, never read)
    left_padding: bool


def load_scorer(path: str, dtype: str, device: str, padding_side: str = "right") -> LoadedScorer:
    """Load ``path`` (a local HF directory) as a one-label sequence classifier, or raise a
    one-line ValueError naming ``path``. ``padding_side`` changes no score (tests flip it)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001 - whatever transformers raised, as one line
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"reward_model: path={path!r} did not load ({type(e).__name__}: {why}); give a directory "
                         f"saved with save_pretrained (model and tokenizer)") from None
    score = getattr(model, "score", None)
    if not isinstance(score, torch.nn.Linear) or model.base_model is model:
        raise ValueError(f"reward_model: path={path!r} is a {type(model).__name__}, which has no base model + "
                         f"'score' head; use a Llama/Qwen2/Qwen3-style *ForSequenceClassification checkpoint")
    model.eval().requires_grad_(False).to(device)
    pad = model.config.get_text_config().pad_token_id
    fill = pad if pad is not None else tokenizer.pad_token_id
    return LoadedScorer(model=model, tokenizer=tokenizer, pad_token_id=pad, fill_id=fill if fill is not None else 0,
                        left_padding=padding_side == "left")


def check_checkpoint(path: Any) -> str:
    """``path`` as a string after cheap checks (no model load): a directory whose
    config.json names a sequence classifier with one label; else a one-line ValueError."""
    import json

    fix = "give a local Hugging Face directory saved with save_pretrained (config.json, weights, tokenizer)"
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"reward_model: path={path!r} is missing; {fix}")
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        what = "has no config.json" if Path(path).expanduser().is_dir() else "is not a directory"
        raise ValueError(f"reward_model: path={str(path)!r} {what}; {fix} (no downloads: a hub name does not work)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"reward_model: path={str(path)!r}: config.json is not valid JSON ({e}); {fix}") from None
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)  # transformers' default is 2
    if labels != 1:
        raise ValueError(f"reward_model: path={str(path)!r} has num_labels={labels}; a reward model has one output "
                         f"(num_labels=1, the score)")
    return str(Path(path).expanduser())


def score_rows(scorer: LoadedScorer, rows: list[list[int]], max_tokens: int, device: str) -> list[float]:
    """One float32 score per row of token ids (any order of lengths), micro-batched."""
    import torch

    scores = [0.0] * len(rows)
    with torch.inference_mode():
        for batch in plan_microbatches([len(r) for r in rows], max_tokens):
            values = _forward(scorer, [rows[i] for i in batch], device)
            for i, value in zip(batch, values):
                scores[i] = value
    return scores


def _forward(scorer: LoadedScorer, rows: list[list[int]], device: str) -> list[float]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), scorer.fill_id, dtype=torch.long)  # (B, S)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, S)
    pooled = torch.empty(len(rows), dtype=torch.long)  # (B,) position read by the head
    for b, row in enumerate(rows):
        start = width - len(row) if scorer.left_padding else 0
        ids[b, start:start + len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, start:start + len(row)] = 1
        pooled[b] = start + pooled_index(row, scorer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # a row's positions start at 0 on either side
    ids, mask, positions, pooled = (t.to(device) for t in (ids, mask, positions, pooled))
    hidden = scorer.model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                     use_cache=False).last_hidden_state  # (B, S, H)
    picked = hidden[torch.arange(len(rows), device=hidden.device), pooled]  # (B, H)
    return scorer.model.score(picked)[:, 0].float().tolist()
