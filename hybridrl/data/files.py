"""Prompt datasets from jsonl or parquet files.

A row needs a prompt column (plain text, or a list of chat messages rendered with the
tokenizer's chat template) and may have an answer column passed to the reward. For a
vision-language model (``vision=VLPromptRenderer``, see ``vl_prompts.py``) a chat prompt may
hold image items, its images inline or in the image column; a bad image skips the row with
its reason (missing file, undecodable, too large, too many), text-only rows load as before.
Bad rows (invalid UTF-8 or JSON, missing prompt, wrong type, too long) are skipped and
counted by reason, with the ``file:line`` of each reason's first row, never fatal. A file
that cannot be read at all (missing, unreadable, not parquet) is a one-line ValueError.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.data.vision import ImageInputs
from hybridrl.data.vl_prompts import BadImage, VLPromptRenderer


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    answer: Any
    source: str  # "file:row" for error messages
    images: ImageInputs | None = None  # a vision-language prompt's images (its ids hold their tokens)


INVALID_UTF8 = "invalid UTF-8"
UNPARSEABLE = "unparseable"


class NoChatTemplate(ValueError):
    """Chat-message prompts with a tokenizer that has no chat template: a setup problem,
    not a bad row, so it stops the load."""


@dataclass
class LoadReport:
    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    first: dict[str, str] = field(default_factory=dict)  # reason -> "file:line" of its first row
    skipped_answer: int = 0  # rows kept without a ground truth (the reward sees None)

    def skip(self, reason: str, source: str) -> None:
        self.skipped[reason] += 1
        self.first.setdefault(reason, source)

    def summary(self) -> str:
        why = ", ".join(f"{n} {k} (first at {self.first[k]})" if k in self.first else f"{n} {k}"
                        for k, n in self.skipped.items()) or "none"
        extra = f"; {self.skipped_answer} without an answer" if self.skipped_answer else ""
        return f"{self.loaded} prompts loaded, skipped: {why}{extra}"


@dataclass(frozen=True)
class _Unparsed:
    """A jsonl line that is not a JSON value, and why."""

    reason: str


def _parse_line(raw: bytes, first: bool) -> Any:
    """One jsonl line as its JSON value, or :class:`_Unparsed`."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")  # a BOM may open the file
    except UnicodeDecodeError:
        return _Unparsed(INVALID_UTF8)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; RecursionError: "[[[[..."
        return _Unparsed(UNPARSEABLE)


def _read_rows(path: Path):
    """``(line or row number, row)``, where a jsonl line that did not parse is :class:`_Unparsed`."""
    if path.is_dir():
        yield from _read_datasets_dir(path)
    elif path.suffix in (".jsonl", ".json"):
        with path.open("rb") as f:  # bytes: one bad UTF-8 line must not abort the file
            for i, raw in enumerate(f, start=1):
                if raw.strip():
                    yield i, _parse_line(raw, first=i == 1)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError...: the whole file is unusable
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"data file {path}: cannot read it as parquet ({why}); "
                             "check the file or export it again") from e
        yield from enumerate(rows, start=1)
    else:
        raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use .jsonl or .parquet")


def _read_datasets_dir(path: Path):
    """Rows of a Hugging Face ``datasets`` directory written by ``save_to_disk`` (a Dataset,
    or the ``train`` split of a DatasetDict)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data file {path}: a `datasets` directory needs the datasets package: "
                         "pip install 'hybridrl[data]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - FileNotFoundError / ValueError / arrow errors: not a dataset dir
        raise ValueError(f"data file {path}: not a dataset saved with save_to_disk "
                         f"({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"data file {path}: a DatasetDict without a 'train' split (has {list(ds)}); "
                             "point at one split's directory")
        ds = ds["train"]
    yield from enumerate(ds, start=1)


def with_system_prompt(prompt: Any, system_prompt: str | None) -> Any:
    """A chat prompt gets a leading system message (unless it has one); a text prompt gets
    the system prompt as its first line."""
    if not system_prompt:
        return prompt
    if isinstance(prompt, str):
        return f"{system_prompt}\n{prompt}"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and prompt[0].get("role") != "system":
        return [{"role": "system", "content": system_prompt}, *prompt]
    return prompt


def _is_chat(prompt: Any) -> bool:
    return bool(isinstance(prompt, list) and prompt
                and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def render_prompt(tokenizer, prompt: Any) -> list[int] | None:
    """Token ids for a text prompt or a chat-message list (None when malformed)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        return ids
    if _is_chat(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise NoChatTemplate("chat-message prompts need a tokenizer with a chat_template; "
                                 "add one to the checkpoint's tokenizer_config.json or use text prompts")
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # BatchEncoding in transformers 5
    return None


@dataclass(frozen=True)
class _Columns:
    """How a file's rows are read: the columns, the length bound, the tokenizer and, for a
    vision-language model, the prompt renderer; ``base_dir``: where image paths start."""

    tokenizer: Any
    prompt_key: str
    answer_key: str
    max_prompt_length: int
    vision: VLPromptRenderer | None
    base_dir: Path


def load_prompt_files(files: list[str], tokenizer, *, prompt_key: str, answer_key: str,
                      max_prompt_length: int, system_prompt: str | None = None,
                      vision: VLPromptRenderer | None = None) -> tuple[list[PromptRecord], LoadReport]:
    """Prompt records of ``files`` and the report of what was skipped. ``vision``: render chat
    prompts with images for a vision-language model (each record's ``images``)."""
    records: list[PromptRecord] = []
    report = LoadReport()
    for name in files:
        path = Path(name)
        if not path.exists():
            raise ValueError(f"data file {name}: not found; check data.train_files / data.val_files")
        cols = _Columns(tokenizer, prompt_key, answer_key, max_prompt_length, vision,
                        path if path.is_dir() else path.parent)
        try:
            for row_no, row in _read_rows(path):
                if system_prompt and isinstance(row, dict) and prompt_key in row:
                    row = {**row, prompt_key: with_system_prompt(row[prompt_key], system_prompt)}
                _add_row(row, f"{name}:{row_no}", cols, records, report)
        except OSError as e:  # unreadable (permissions, I/O error): the file, not a row
            raise ValueError(f"data file {name}: cannot read it ({e.strerror or e}); "
                             "check its permissions") from e
    return records, report


def _render(row: dict, cols: _Columns) -> tuple[list[int] | None, ImageInputs | None]:
    """The prompt's ids (None when malformed) and images; :class:`BadImage` for a bad image."""
    prompt = row[cols.prompt_key]
    if cols.vision is not None and _is_chat(prompt):
        if not getattr(cols.tokenizer, "chat_template", None):
            raise NoChatTemplate("chat-message prompts need a tokenizer with a chat_template; "
                                 "add one to the checkpoint's tokenizer_config.json or use text prompts")
        images = cols.vision.row_images(prompt, row.get(cols.vision.image_key), cols.base_dir)
        return cols.vision.render(prompt, images)
    return render_prompt(cols.tokenizer, prompt), None


def _add_row(row: Any, src: str, cols: _Columns, records: list[PromptRecord], report: LoadReport) -> None:
    """Append ``row`` to ``records``, or count why it is skipped."""
    tokenizer, prompt_key, answer_key = cols.tokenizer, cols.prompt_key, cols.answer_key
    if isinstance(row, _Unparsed):
        report.skip(row.reason, src)
        return
    if not isinstance(row, dict):
        report.skip(UNPARSEABLE, src)
        return
    if prompt_key not in row:
        report.skip(f"no '{prompt_key}' column", src)
        return
    images = None
    try:
        ids, images = _render(row, cols)
    except NoChatTemplate as e:
        raise NoChatTemplate(f"{src}: {e}") from None  # a setup problem, not a bad row
    except BadImage as e:
        report.skip(str(e), src)
        return
    except Exception:  # noqa: BLE001 - a malformed row is skipped and counted, never fatal
        ids = None
    if ids is None:
        report.skip("malformed prompt", src)
        return
    if not ids or (tokenizer.bos_token_id is not None and ids == [tokenizer.bos_token_id]):
        report.skip("empty prompt", src)
        return
    if len(ids) > cols.max_prompt_length:
        report.skip("longer than data.max_prompt_length", src)
        return
    if row.get(answer_key) is None:
        report.skipped_answer += 1
    records.append(PromptRecord(ids, row.get(answer_key), src, images))
    report.loaded += 1
