"""Prompt datasets from jsonl or parquet files.

A row needs a prompt column (plain text, or a list of chat messages rendered with the
tokenizer's chat template) and may have an answer column passed to the reward.
Bad rows (missing prompt, wrong type, too long) are skipped and counted, never fatal.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    answer: Any
    source: str  # "file:row" for error messages


@dataclass
class LoadReport:
    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_answer: int = 0  # rows kept without a ground truth (the reward sees None)

    def summary(self) -> str:
        why = ", ".join(f"{n} {k}" for k, n in self.skipped.items()) or "none"
        extra = f"; {self.skipped_answer} without an answer" if self.skipped_answer else ""
        return f"{self.loaded} prompts loaded, skipped: {why}{extra}"


def _read_rows(path: Path):
    if path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError:
                    yield i, None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
    else:
        raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use .jsonl or .parquet")


def render_prompt(tokenizer, prompt: Any) -> list[int] | None:
    """Token ids for a text prompt or a chat-message list (None when malformed)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        return ids
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat-message prompts need a tokenizer with a chat_template; "
                             "add one to the checkpoint's tokenizer_config.json or use text prompts")
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # BatchEncoding in transformers 5
    return None


def load_prompt_files(files: list[str], tokenizer, *, prompt_key: str, answer_key: str,
                      max_prompt_length: int) -> tuple[list[PromptRecord], LoadReport]:
    records: list[PromptRecord] = []
    report = LoadReport()
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"data file {name}: not found; check data.train_files / data.val_files")
        for row_no, row in _read_rows(path):
            src = f"{name}:{row_no}"
            if not isinstance(row, dict):
                report.skipped["unparseable"] += 1
                continue
            if prompt_key not in row:
                report.skipped[f"no '{prompt_key}' column"] += 1
                continue
            try:
                ids = render_prompt(tokenizer, row[prompt_key])
            except ValueError:
                raise  # a setup problem (no chat template), not a bad row
            except Exception:  # noqa: BLE001 - a malformed row is skipped and counted, never fatal
                ids = None
            if ids is None:
                report.skipped["malformed prompt"] += 1
                continue
            if not ids or (tokenizer.bos_token_id is not None and ids == [tokenizer.bos_token_id]):
                report.skipped["empty prompt"] += 1
                continue
            if len(ids) > max_prompt_length:
                report.skipped["longer than data.max_prompt_length"] += 1
                continue
            if row.get(answer_key) is None:
                report.skipped_answer += 1
            records.append(PromptRecord(ids, row.get(answer_key), src))
            report.loaded += 1
    return records, report
