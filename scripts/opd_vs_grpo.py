"""On-policy distillation vs GRPO from the same warm start (docs/bench/opd.md).

For each seed: the default job (``hybridrl train``: the arithmetic task, 3,000 warm-start
steps that learn the teacher's carry slip, ~0.57 held-out) continued by GRPO (its exact-answer
reward), and the same job continued by on-policy distillation from ``--teacher`` (a stronger
checkpoint of the same task, e.g. the default job's final checkpoint) with no reward in the
advantage. Held-out greedy accuracy every ``--eval-every`` steps, against steps and against
training seconds (the steps' phase times summed: eval excluded). Reports, per method, the
first step whose accuracy is within ``--margin`` of the teacher's, and the ratio.

    python scripts/opd_vs_grpo.py --teacher runs/opd_teacher/checkpoint --seeds 0 1 2

Writes ``--out``/opd_vs_grpo.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METHODS = {"grpo": [], "opd": ["algo.distill.teacher={teacher}"]}


def run(method: str, seed: int, args) -> list[dict]:
    name = f"{method}_seed{seed}"
    extra = [x.format(teacher=args.teacher) for x in METHODS[method]]
    cmd = [sys.executable, "-m", "hybridrl", "train", f"trainer.run_name={name}", f"trainer.seed={seed}",
           f"trainer.output_dir={args.out / 'runs'}", f"trainer.total_steps={args.steps}",
           f"trainer.eval_every={args.eval_every}", "logging.progress=false", "checkpoint.save=false",
           "checkpoint.every=0", "eval.k=0", f"trainer.threads={args.threads}", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    curve, seconds = [], 0.0
    for row in rows:
        seconds += sum(v for k, v in row.items() if k.startswith("time/") and k.endswith("_s"))
        if "eval/accuracy" in row:
            curve.append({"step": row["step"], "seconds": seconds, "accuracy": row["eval/accuracy"]})
    return curve


def teacher_accuracy(args) -> float:
    """The teacher's last held-out greedy accuracy, from the metrics of the run that wrote it
    (``<run>/checkpoint`` -> ``<run>/metrics.jsonl``: the same held-out prompts as these runs)."""
    log = Path(args.teacher).absolute().parent / "metrics.jsonl"
    if not log.is_file():
        raise SystemExit(f"--teacher {args.teacher}: no metrics.jsonl next to it ({log}); give a run's checkpoint/")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]


def first_within(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["step"] > 0 and p["accuracy"] >= target), None)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"grpo": "tab:blue", "opd": "tab:orange"}
    for seed, runs in result["runs"].items():
        for method, curve in runs.items():
            for ax, x in zip(axes, ("step", "seconds")):
                ax.plot([p[x] for p in curve], [p["accuracy"] for p in curve], color=colors[method], alpha=0.8,
                        label=method if seed == next(iter(result["runs"])) else None)
    for ax, label in zip(axes, ("RL step", "training seconds (eval excluded)")):
        ax.axhline(result["teacher_accuracy"], color="gray", ls="--", label="teacher")
        ax.axhline(result["target"], color="gray", ls=":", label=f"teacher - {result['margin']:.2f}")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend(loc="lower right")
    fig.suptitle(f"on-policy distillation vs GRPO from the same warm start ({len(result['runs'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--out", type=Path, default=Path("runs/opd_vs_grpo"))
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = all cores)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    acc = teacher_accuracy(args)
    result = {"teacher": args.teacher, "teacher_accuracy": acc, "margin": args.margin, "target": acc - args.margin,
              "steps": args.steps, "runs": {}, "reached": {}}
    t0, total, done = time.perf_counter(), 2 * len(args.seeds), 0
    for seed in args.seeds:
        result["runs"][seed] = {}
        for method in METHODS:
            result["runs"][seed][method] = curve = run(method, seed, args)
            hit = first_within(curve, result["target"])
            result["reached"].setdefault(method, []).append(hit)
            done += 1
            rate = (time.perf_counter() - t0) / done
            print(f"[{done}/{total}] seed {seed} {method}: final {curve[-1]['accuracy']:.3f}, within "
                  f"{args.margin:.2f} of the teacher ({acc:.3f}) at step "
                  f"{hit['step'] if hit else 'never'}; ETA {rate * (total - done):.0f} s", flush=True)
    json.dump(result, open(args.out / "opd_vs_grpo.json", "w"), indent=1)
    plot(result, args.out / "opd_vs_grpo.png")
    for method, hits in result["reached"].items():
        print(f"{method}: steps to within {args.margin:.2f} of the teacher per seed: "
              f"{[h['step'] if h else None for h in hits]}; seconds: "
              f"{[round(h['seconds'], 1) if h else None for h in hits]}")


if __name__ == "__main__":
    main()
