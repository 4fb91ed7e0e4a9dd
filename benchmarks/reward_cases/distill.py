"""Step time of on-policy distillation vs GRPO at the same batch (``benchmarks/rewards.py``).

Both are the default job (the arithmetic task, the built-in 0.5M Qwen2, 32 prompts x 8
samples) after a short warm start; OPD adds the teacher's scoring pass (a prefill of every
row on the teacher's engine, as each group finishes) and, in ``mode=loss``, a full-vocabulary
divergence per micro-batch of the update. The teacher is a model of the policy's size and
tokenizer (random init: its values do not change the cost). Step time = the step's phases
summed (rollout, log-probs, advantages, update, refit), median over the measured steps.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _teacher(directory: Path) -> str:
    from hybridrl.config.model import ModelConfig
    from hybridrl.job.model_factory import builtin_model, builtin_tokenizer

    tok = builtin_tokenizer()
    model = builtin_model(tok, ModelConfig(), seed=7)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def _step_seconds(out: Path, name: str, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "hybridrl", "train", f"trainer.output_dir={out}", f"trainer.run_name={name}",
           f"trainer.total_steps={steps}", "trainer.eval_every=1000", "warm_start.steps=50", "eval.k=0",
           "data.eval_size=8", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
           "checkpoint.save=false", "checkpoint.every=0", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    times = [sum(v for k, v in r.items() if k.startswith("time/") and k.endswith("_s"))
             for r in rows if r.get("step", 0) > 1 and "time/update_s" in r]  # step 1 warms the caches up
    return statistics.median(times)


def rows(quick: bool) -> list[dict]:
    """The three jobs interleaved (``repeats`` rounds, the best round of each: a shared
    machine's load drifts hit them alike)."""
    steps, repeats = (4, 1) if quick else (10, 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        teacher = _teacher(out / "teacher")
        jobs = {"grpo": [], "advantage": [f"algo.distill.teacher={teacher}", "algo.distill.mode=advantage"],
                "loss": [f"algo.distill.teacher={teacher}", "algo.distill.mode=loss"]}
        best = _interleaved(out, steps, repeats, jobs)
    base = "hybridrl GRPO, same job (exact-answer reward, no teacher)"
    return [{"case": f"default job 32x8, OPD mode={mode}", "metric": "step s", "ours": best[mode],
             "baseline": best["grpo"], "baseline_name": base, "higher_is_better": False}
            for mode in ("advantage", "loss")]


def _interleaved(out: Path, steps: int, repeats: int, jobs: dict[str, list[str]]) -> dict[str, float]:
    seen: dict[str, list[float]] = {name: [] for name in jobs}
    for r in range(repeats):
        for name, extra in jobs.items():
            seen[name].append(_step_seconds(out, f"{name}{r}", steps, extra))
    return {name: min(v) for name, v in seen.items()}
