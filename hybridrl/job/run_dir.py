"""The run directory: never deleted or overwritten silently, used by one run at a time.

``open_run_dir(output_dir, run_name, resume)`` decides, before any work, whether the run
starts fresh or continues from a checkpoint:

- a new (or empty) directory starts a new run;
- ``resume=auto`` continues an existing run from its latest checkpoint (``checkpoint``);
- ``resume=off`` refuses a directory that already holds a run;
- ``resume=PATH`` continues from that checkpoint directory.

An existing run without a checkpoint is never wiped: the error names the choices. A
lock file (``.lock``, ``flock``) held for the whole run stops a second run from using
the same directory; the kernel releases it when the process dies, so a killed run never
leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

RUN_FILES = ("metrics.jsonl", "checkpoint", "checkpoints", "tensorboard", "curves.png")


@dataclass
class RunDir:
    path: Path
    resume_from: Path | None  # checkpoint directory to continue from; None = a new run
    _lock_fd: int

    def close(self) -> None:
        """Release the lock (also released by the kernel when the process exits)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def open_run_dir(output_dir: str, run_name: str, resume: str) -> RunDir:
    root = Path(output_dir).resolve()
    path = (root / run_name).resolve()
    if path.parent != root:
        raise ValueError(f"trainer.run_name={run_name!r} leaves trainer.output_dir={output_dir!r}; "
                         "use a plain directory name")
    path.mkdir(parents=True, exist_ok=True)
    fd = _lock(path)
    try:
        return RunDir(path, _resume_source(path, resume), fd)
    except BaseException:
        os.close(fd)
        raise


def _lock(path: Path) -> int:
    fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"run directory {path} is in use by another hybridrl run (pid {holder}); wait for it "
                         "to finish or choose another trainer.run_name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _resume_source(path: Path, resume: str) -> Path | None:
    existing = [name for name in RUN_FILES if _holds_data(path / name)]
    latest = path / "checkpoint"
    if resume not in ("auto", "off"):
        source = Path(resume).expanduser()
        if not source.is_dir():
            raise ValueError(f"checkpoint.resume={resume!r}: no such checkpoint directory")
        return source.resolve()
    if not existing:
        return None
    if resume == "off":
        raise ValueError(f"run directory {path} already holds a run ({', '.join(existing)}); continue it with "
                         "checkpoint.resume=auto, or choose another trainer.run_name")
    if latest.is_symlink() and latest.exists():
        return latest.resolve()
    raise ValueError(f"run directory {path} holds a run ({', '.join(existing)}) but no checkpoint to resume "
                     "from; choose another trainer.run_name, or move that directory away")


def _holds_data(p: Path) -> bool:
    """An empty metrics file or directory (a run stopped during setup) holds nothing to lose."""
    if p.is_symlink():
        return True
    if p.is_dir():
        return any(p.iterdir())
    return p.exists() and p.stat().st_size > 0
