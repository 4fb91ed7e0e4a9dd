"""LoRA RL against full fine-tuning, same run: trainer memory and learning (issue #27; its
refit rows, payload and time, are in ``benchmarks/refit.py``).

Memory: the trainer's peak RSS for one RL step of the same job (``rl_job``-sized model,
GRPO with a KL reference) with LoRA (rank 16, no reference copy, AdamW state for the
adapters only) vs full fine-tuning, each in a fresh process (``ru_maxrss``).

Learning (without ``--quick``): the default job (``hybridrl train``) full vs LoRA rank 8 at
``optim.lr=1e-3`` (10x the full run's, the "LoRA without regret" rule), held-out accuracy
and wall time, and the two curves in ``bench_out/lora_learning.png``.

    python benchmarks/lora.py [--quick] [--json PATH]
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMALL, format_table, parse_args, report, row  # noqa: E402


MEMORY_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from _common import rl_job
from hybridrl.config.io import load_config
from hybridrl.job.build import build_run
from hybridrl.job import loop
import random
cfg = load_config(None, json.loads(sys.argv[2]))
run = build_run(cfg)
loop._attach_reference(run, cfg)
run.step.start(random.Random(0), 1)
run.step()
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]  # this process's peak (ru_maxrss survives exec)
print(json.dumps({"rss_mib": int(hwm.split()[1]) / 1024}))
"""


def memory_rows(tmp: Path) -> list[dict]:
    """Peak RSS of one RL step, each side in a fresh process (the model is SMALL-shaped: 56M)."""
    common = [f"model.hidden_size={SMALL['hidden_size']}", f"model.num_hidden_layers={SMALL['num_hidden_layers']}",
              f"model.num_attention_heads={SMALL['num_attention_heads']}",
              f"model.num_key_value_heads={SMALL['num_key_value_heads']}",
              f"model.intermediate_size={SMALL['intermediate_size']}", "warm_start.steps=0", "algo.kl.coef=0.01",
              "rollout.n=4", "batch.prompts_per_step=4", "logging.progress=false", "logging.tensorboard=false",
              "trainer.threads=2", "reward.workers=1", "data.eval_size=8"]
    out = {}
    for side, extra in (("lora", ["model.lora.rank=16"]), ("full", [])):
        args = common + extra + [f"trainer.output_dir={tmp}", f"trainer.run_name=mem-{side}-{time.time_ns()}"]
        res = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(Path(__file__).parent), json.dumps(args)],
                             capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise RuntimeError(f"memory child ({side}) failed: {res.stderr[-1500:]}")
        out[side] = json.loads(res.stdout.strip().splitlines()[-1])["rss_mib"]
    return [row(case="rl step, 8-layer 512-wide qwen2 (24M), GRPO + KL", metric="trainer peak RSS MiB",
                ours=out["lora"], baseline=out["full"],
                baseline_name="full fine-tuning (AdamW over all weights + a reference copy)", higher_is_better=False)]


def learning_rows(tmp: Path, png: Path) -> list[dict]:
    """The default job, full vs LoRA rank 8 (lr 1e-3), one run each."""
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    results = {}
    for side, extra in (("full", []), ("lora", ["model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-3"])):
        cfg = load_config(None, extra + [f"trainer.output_dir={tmp}", f"trainer.run_name=learn-{side}-{time.time_ns()}",
                                         "logging.progress=false"])
        results[side] = train(cfg)
    _plot(results, png)
    full, lora = results["full"], results["lora"]
    return [
        row(case="default job, LoRA r8 lr 1e-3", metric="held-out accuracy", ours=lora.final_accuracy,
            baseline=full.final_accuracy, baseline_name="full fine-tuning, lr 1e-4", higher_is_better=True),
        row(case="default job, LoRA r8 lr 1e-3", metric="wall s", ours=lora.seconds, baseline=full.seconds,
            baseline_name="full fine-tuning, lr 1e-4", higher_is_better=False),
    ]


def _plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for side, result in results.items():
        pts = [(r["step"], r["eval/accuracy"]) for r in result.history if "eval/accuracy" in r]
        ax.plot([s for s, _ in pts], [a for _, a in pts], marker="o", label=f"{side} ({result.seconds:.0f} s)")
    ax.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("default job: full fine-tuning vs LoRA rank 8")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main():
    args = parse_args(__doc__.splitlines()[0])
    import tempfile

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = memory_rows(Path(tmp))
        print(f"memory rows: {time.perf_counter() - t0:.0f} s", flush=True)
        print(format_table(rows), flush=True)
        if not args.quick:
            rows += learning_rows(Path(tmp), Path("bench_out") / "lora_learning.png")
    print(f"\n{time.perf_counter() - t0:.0f} s, rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MiB")
    report(rows, args.json)


if __name__ == "__main__":
    main()
