"""Atomic Hugging Face-format checkpoints.

Each save writes a complete directory ``<root>/checkpoints/step-<N>`` under a temporary
name, fsyncs it, renames it into place (never over an existing directory: a re-saved
step gets ``step-<N>.<k>``), and then atomically repoints the symlink
``<root>/checkpoint`` at it (a new symlink renamed over the old one with
``os.replace``). A crash at any point leaves ``checkpoint`` resolving to a complete
directory: the previous one until the final rename, the new one after it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


class CheckpointWriteError(OSError):
    """A save that could not complete (disk full, permissions); the previous checkpoint is intact."""


def save_step_dir(link: str | Path, step: int, write: Callable[[Path], None], *, keep_last: int = 1) -> Path:
    """Atomically publish a checkpoint directory built by ``write(tmp_dir)``.

    The directory lands in ``<link.parent>/checkpoints/step-<step>`` (``step-<step>.<k>``
    when that name is taken: re-saving a step never deletes the directory ``link`` may
    point at), then ``link`` is repointed at it and older step directories beyond
    ``keep_last`` are pruned. Returns the new directory. On any failure the temporary
    directory is removed and :class:`CheckpointWriteError` names the previous checkpoint.
    """
    link = Path(link)
    store = link.parent / "checkpoints"
    store.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(store)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store))
    final = _free_name(store, f"step-{step}")
    try:
        write(tmp)
        _fsync_tree(tmp)
        os.replace(tmp, final)  # final does not exist: a plain atomic rename
        _fsync_dir(store)
        _point_symlink(link, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            previous = os.path.realpath(link) if link.is_symlink() else "none"
            raise CheckpointWriteError(f"could not write checkpoint step {step} under {store} "
                                       f"({e.strerror or e}); previous checkpoint intact: {previous}") from e
        raise
    _prune(store, keep=max(keep_last, 1), current=final)
    return final


def save_checkpoint_atomic(model, tokenizer, path: str | Path, *, step: int = 0,
                           extra_files: dict[str, str] | None = None, keep_last: int = 1) -> Path:
    """Write ``model`` + ``tokenizer`` (``save_pretrained``, safetensors) and point ``path`` at it.

    ``path`` becomes a symlink to ``<parent>/checkpoints/step-<step>``; HF loaders follow it.
    Returns ``path``. Older step directories beyond ``keep_last`` are removed afterwards.
    """

    def write(tmp: Path) -> None:
        write_hf(tmp, model, tokenizer, extra_files)

    save_step_dir(path, step, write, keep_last=keep_last)
    return Path(path)


def write_hf(directory: Path, model, tokenizer, extra_files: dict[str, str] | None = None) -> None:
    """The Hugging Face part of a checkpoint: ``save_pretrained`` of model (None: not
    written here, e.g. a LoRA run's adapter folder) and tokenizer."""
    if model is not None:
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text)


def _free_name(store: Path, base: str) -> Path:
    candidate, k = store / base, 1
    while candidate.exists():
        candidate, k = store / f"{base}.{k}", k + 1
    return candidate


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
