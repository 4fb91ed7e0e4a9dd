"""Atomic Hugging Face-format checkpoints.

The checkpoint is written into a temporary sibling directory and moved into place with
``os.replace`` of a directory swap, so a crash mid-save leaves the previous checkpoint
intact: readers see either the old complete directory or the new complete one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def save_checkpoint_atomic(model, tokenizer, path: str | Path, *, extra_files: dict[str, str] | None = None) -> Path:
    """Write ``model`` + ``tokenizer`` (``save_pretrained``, safetensors) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        _fsync_dir_files(tmp)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)  # atomic rename; the previous checkpoint stays whole under `old`
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _fsync_dir_files(directory: Path) -> None:
    for f in directory.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
