"""Atomic Hugging Face-format checkpoints.

Each save writes a complete directory ``<root>/checkpoints/step-<N>`` under a temporary
name, fsyncs it, renames it into place, and then atomically repoints the symlink
``<root>/checkpoint`` at it (a new symlink renamed over the old one with
``os.replace``). A crash at any point leaves ``checkpoint`` resolving to a complete
directory: the previous one until the final rename, the new one after it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def save_checkpoint_atomic(model, tokenizer, path: str | Path, *, step: int = 0,
                           extra_files: dict[str, str] | None = None, keep_last: int = 1) -> Path:
    """Write ``model`` + ``tokenizer`` (``save_pretrained``, safetensors) and point ``path`` at it.

    ``path`` becomes a symlink to ``<parent>/checkpoints/step-<step>``; HF loaders follow it.
    Returns ``path``. Older step directories beyond ``keep_last`` are removed afterwards.
    """
    path = Path(path)
    store = path.parent / "checkpoints"
    store.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(store)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store))
    final = store / f"step-{step}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(store)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _point_symlink(path, final)
    _prune(store, keep=max(keep_last, 1), current=final)
    return path


def _point_symlink(link: Path, target: Path) -> None:
    if link.exists() and not link.is_symlink():
        # a plain directory from elsewhere: move it aside rather than delete user data
        os.replace(link, link.with_name(link.name + ".previous"))
    tmp_link = link.with_name(f".{link.name}.link-{os.getpid()}")
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(os.path.relpath(target, link.parent), tmp_link)
    os.replace(tmp_link, link)  # atomic: readers see the old or the new target
    _fsync_dir(link.parent)


def _prune(store: Path, *, keep: int, current: Path) -> None:
    steps = sorted((p for p in store.glob("step-*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in steps[:-keep]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(store: Path) -> None:
    for stale in store.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for f in directory.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
