"""The part of a golden run that holds on any CPU: a short run from stored weights.

A full golden run cannot be compared across CPU kernels: its 40 supervised warm-start
steps turn last-ulp differences of a GEMM into weight differences of ~1e-3 (Adam
normalizes tiny gradients), and from there sampled tokens change within a few steps.
What *is* portable: the recipe's first steps from weights that are the same bits on
every machine. So ``start/`` holds one warm-started policy (bf16-valued, float32 on
load: every machine reads the same bits), and a portable run is the case's recipe from
it, with no warm start, for ``STEPS`` steps. Its tokens are (with overwhelming
probability) the recorded ones, since the engine's probabilities differ in the last
ulps only; everything downstream (rewards, advantages, KL, clipping, corrections, the
update) differs by rounding alone, which ``RTOL`` / ``ATOL`` bound.

The tolerance was measured, not guessed: the portable runs were made on one machine
under three different ATen kernel sets (``ATEN_CPU_CAPABILITY=default / avx2 /
avx512``) and compared (``python -m tests.trainer.golden_portable measure``); the
largest relative difference of any metric in any step was recorded in ``MEASURED``.
``RTOL`` is well above it and far below what any change of the recipe moves (a clip
ratio of 0.25 instead of 0.2 moves ``actor/pg_clipfrac`` by tens of percent: tested).

Re-make the start weights (``make-start``) or the recordings (``record``) only when the
recipe's numbers are meant to change; say so in the commit.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

PORTABLE_DIR = Path(__file__).parent / "golden" / "portable"
START_DIR = PORTABLE_DIR / "start"
STEPS = 3
START_SFT_STEPS = 300  # enough for non-zero rewards at step 1, so every case's loss is live
# largest relative difference across three ATen kernel sets (default/avx2/avx512), over
# every metric, step and case; filled by `measure`
MEASURED = 2.0e-5
RTOL = 2e-3
ATOL = 1e-6  # metrics that are ~0 (a KL at step 1, a ratio deviation) differ in absolute terms


def portable_overrides(case_overrides: list[str], common: list[str]) -> list[str]:
    return common + case_overrides + [f"model.path={START_DIR}", "warm_start.steps=0",
                                      f"trainer.total_steps={STEPS}", f"trainer.eval_every={STEPS}"]


def run_portable(case_overrides: list[str], common: list[str], out_dir: Path) -> list[dict]:
    from test_golden import run_overrides

    return run_overrides(portable_overrides(case_overrides, common), out_dir)


def compare(rows: list[dict], want: list[dict], rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """Problems, one line each: a step missing, a metric missing, a value out of tolerance."""
    problems = []
    if len(rows) != len(want):
        problems.append(f"{len(rows)} logged steps, recorded {len(want)}")
    for got, rec in zip(rows, want):
        missing = set(rec) - set(got)
        if missing:
            problems.append(f"step {rec['step']}: metrics no longer logged: {sorted(missing)}")
        for key in sorted(set(rec) & set(got)):
            a, b = got[key], rec[key]
            if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
                continue
            if isinstance(b, (int, float)) and isinstance(a, (int, float)):
                if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol):
                    problems.append(f"step {rec['step']}: {key} = {a!r}, recorded {b!r}")
            elif a != b:
                problems.append(f"step {rec['step']}: {key} = {a!r}, recorded {b!r}")
    return problems


def largest_relative_difference(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        for key in set(x) & set(y):
            u, v = x[key], y[key]
            if isinstance(u, (int, float)) and isinstance(v, (int, float)) and not (math.isnan(u) or math.isnan(v)):
                if abs(u - v) > ATOL:
                    worst = max(worst, abs(u - v) / max(abs(u), abs(v)))
    return worst


def make_start() -> None:
    """The start weights: the recipe's built-in model after START_SFT_STEPS warm-start
    steps, rounded to bf16 values (stored as bf16; loaded as float32, exactly)."""
    import tempfile

    import torch

    from hybridrl.config.io import load_config
    from hybridrl.job.build import build_run
    from hybridrl.job.loop import warm_start
    from test_golden import COMMON

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, COMMON + [f"warm_start.steps={START_SFT_STEPS}", f"trainer.output_dir={tmp}"])
        run = build_run(cfg)
        try:
            warm_start(run, cfg)
            START_DIR.mkdir(parents=True, exist_ok=True)
            run.policy.to(torch.bfloat16).save_pretrained(START_DIR, safe_serialization=True)
            run.tokenizer.save_pretrained(START_DIR)
        finally:
            run.step.scorer.close()
            run.directory.close()


def record() -> None:
    import tempfile

    import torch

    from test_golden import CASES, COMMON

    for case, overrides in sorted(CASES.items()):
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_portable(overrides, COMMON, Path(tmp))
        path = PORTABLE_DIR / f"{case}.json"
        path.write_text(json.dumps({"recorded_on": torch.backends.cpu.get_cpu_capability(),
                                    "overrides": overrides, "rows": rows}, indent=1))
        print(f"recorded {path}")


def measure() -> None:
    """Run every case's portable run under three ATen kernel sets, print the largest
    relative difference between any two (run this to re-derive MEASURED)."""
    import os
    import subprocess
    import tempfile

    from test_golden import CASES

    runs: dict[str, dict[str, list]] = {}
    for capability in ("default", "avx2", "avx512"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
            subprocess.run([sys.executable, __file__, "dump", str(out)], env=env, check=True)
            runs[capability] = json.loads(out.read_text())
    worst = 0.0
    for case in sorted(CASES):
        per = [runs[c][case] for c in runs]
        diffs = [largest_relative_difference(per[i], per[j]) for i in range(3) for j in range(i + 1, 3)]
        print(f"{case}: largest relative difference across kernel sets {max(diffs):.3g}")
        worst = max(worst, *diffs)
    print(f"MEASURED = {worst:.3g}")


def _dump(out: str) -> None:
    import tempfile

    from test_golden import CASES, COMMON

    result = {}
    for case, overrides in sorted(CASES.items()):
        with tempfile.TemporaryDirectory() as tmp:
            result[case] = run_portable(overrides, COMMON, Path(tmp))
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "make-start":
        make_start()
    elif command == "record":
        record()
    elif command == "measure":
        measure()
    elif command == "dump":
        _dump(sys.argv[2])
    else:
        sys.exit("usage: python tests/trainer/golden_portable.py make-start | record | measure")
