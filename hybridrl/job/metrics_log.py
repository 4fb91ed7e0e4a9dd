"""Metrics sinks: ``metrics.jsonl`` (one line per step), TensorBoard, and ``curves.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends to ``metrics.jsonl`` and TensorBoard. ``resume_after=N`` continues a run:
    rows of steps after N (work lost with the interrupted run) are dropped from the file,
    atomically, and TensorBoard purges its events after step N."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_after: int | None = None,
                 write: bool = True):
        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        self.jsonl, self.tb = None, None
        if not write:  # data-parallel ranks other than 0 keep their rows in memory only
            return
        if resume_after is not None and path.exists():
            self.rows = [r for r in _read_rows(path) if r.get("step", 0) <= resume_after]
            tmp = path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(path)
        self.jsonl = path.open("a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - tensorboard is a base dependency
                raise ImportError("TensorBoard logging needs `pip install tensorboard` "
                                  "(or set logging.tensorboard=false)") from e
            purge = None if resume_after is None else resume_after + 1
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.rows.append(row)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return rows


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


def plot_curves(rows: list[dict[str, Any]], path: Path, *, warm_start_accuracy: float | None = None) -> None:
    """Reward mean and held-out accuracy vs RL step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [r["step"] for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    ax.plot(steps, rewards, label="train reward (batch mean)", alpha=0.35, lw=1)
    if len(rewards) >= 10:
        k = max(5, len(rewards) // 20)  # moving average over ~5% of the run
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, c="C0", lw=2, label=f"train reward ({k}-step mean)")
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if ev:
        ax.plot([s for s, _ in ev], [a for _, a in ev], "o-", label="held-out accuracy (greedy)")
    sampled = sorted({k for r in rows for k in r if k.startswith(("eval/pass@", "eval/maj@"))})
    for key in sampled:  # pass@k / maj@k when eval.k > 0
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([s for s, _ in pts], [a for _, a in pts], ".--", label=f"held-out {key[5:]}")
    if warm_start_accuracy is not None:
        ax.axhline(warm_start_accuracy, ls="--", c="gray", label="after warm start")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("hybridrl: reward and accuracy")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
