"""End-to-end GPU check (run by scripts/gpu_check.sh): a few GRPO steps of the default job.

    python scripts/gpu_e2e.py [--device cuda] [--steps 5] [--out DIR] [--tiny]

Two runs of the default job (built-in arithmetic task and model, no warm start so it is
quick): ``model.dtype=bfloat16``, and the same with ``rollout.quantization=fp8``; both with
``refit.verify=true`` (every refit's addresses and checksums checked) and CUDA
graphs on. After the steps it asserts that the decode graphs were captured and actually
replayed, that every step refit the engine (weight_version advanced once per step, after
the first load) and that the step metrics are finite. One JSON line per run goes to
stdout and ``DIR/e2e.json``. On CPU (``--device cpu``, what the tests run) there are no
graphs, so that assertion is skipped; ``--tiny`` shrinks the job for that.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path

CASES = {
    "bf16": ["model.dtype=bfloat16"],
    "fp8": ["model.dtype=bfloat16", "rollout.quantization=fp8"],
}
TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.intermediate_size=64", "rollout.n=2", "rollout.max_tokens=4",
        "batch.prompts_per_step=2", "data.train_size=50", "data.eval_size=4"]


def run_case(name: str, extra: list[str], *, device: str, steps: int, out_dir: Path, tiny: bool) -> dict:
    from hybridrl.config.io import load_config
    from hybridrl.job.build import build_run

    overrides = [f"trainer.device={device}", "refit.verify=true", "warm_start.steps=0",
                 f"trainer.total_steps={steps}", "checkpoint.save=false", "checkpoint.resume=off",
                 "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
                 f"trainer.output_dir={out_dir}", f"trainer.run_name=e2e_{name}_{time.time_ns()}",
                 *extra, *(TINY if tiny else [])]
    t0 = time.perf_counter()
    run = build_run(load_config(None, overrides), console=lambda s: None)
    try:
        engine = run.step.rollout.engine
        runner = engine.runner
        first_version = engine.weight_version
        run.step.start(random.Random(0), 1)  # the batch source draws every step's prompts
        metrics: dict[str, float] = {}
        for _ in range(steps):
            metrics = run.step()
        graphs = runner.graphs
        fp8_layers = [m for m in engine.model.modules() if hasattr(m, "weight_dequant_cache")]
        result = dict(
            case=name, device=str(engine.device), steps=steps, seconds=round(time.perf_counter() - t0, 1),
            graphs_captured=graphs is not None, graph_sizes=sorted(graphs.graphs) if graphs else [],
            graph_replays=graphs.replays if graphs else 0, flash_decode=runner.flash_decode,
            fp8_scaled_mm_layers=sum(m.weight_dequant_cache is None for m in fp8_layers),
            fp8_dequant_cache_layers=sum(m.weight_dequant_cache is not None for m in fp8_layers),
            weight_version=engine.weight_version, reward_mean=metrics.get("reward/mean"))
        problems = []
        if engine.device.type == "cuda" and not (graphs is not None and graphs.replays > 0):
            problems.append("decode graphs were not captured and replayed")
        if engine.weight_version != first_version + steps:
            problems.append(f"weight_version {engine.weight_version} != {first_version} + {steps} steps")
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            problems.append(f"non-finite metrics: {bad[:5]}")
        result["ok"], result["problems"] = not problems, problems
        return result
    finally:
        run.step.close()
        run.log.close()
        run.step.scorer.close()
        run.directory.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="gpu_out")
    ap.add_argument("--tiny", action="store_true", help="a tiny job (CPU smoke test)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.cases.split(","):
        try:
            r = run_case(name, CASES[name], device=args.device, steps=args.steps, out_dir=out / "e2e_runs",
                         tiny=args.tiny)
        except Exception as e:  # noqa: BLE001 - report and go on to the next case
            traceback.print_exc()
            r = dict(case=name, ok=False, problems=[f"{type(e).__name__}: {e}"])
        print(json.dumps(r), flush=True)
        results.append(r)
        (out / "e2e.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
