"""LoRA RL against full fine-tuning, same run: refit payload and time, trainer memory, learning.

Refit (issue #27): a Qwen2.5-0.5B-Instruct-shaped model (random init, bf16: vocabulary
151936, hidden 896, 24 layers, 14 / 2 heads, MLP 4864, tied head) with rank-16 adapters
on q/k/v/o/gate/up/down. Ours: the adapter-mode refit (A/B only, verified off as in
training) and the merged-mode refit (``W + scale·B·A`` of the targeted weights); baseline:
the full refit a full-fine-tuning run does every step (every weight, same engine dtype,
same bucket). Goals: adapter payload <= 2% and time <= 0.1x of the full refit.

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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMALL, best_interleaved, format_table, goal_line, parse_args, report, row  # noqa: E402

from hybridrl.lora import apply_lora  # noqa: E402
from hybridrl.refit import refit_from_model  # noqa: E402
from hybridrl.rollout import EngineSpec, RolloutEngine  # noqa: E402
from hybridrl.rollout.layers.lora_adapter import AdapterSpec  # noqa: E402

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKET = 256 << 20  # refit.bucket_mb's default


def _mib(named) -> float:
    return sum(t.numel() * t.element_size() for _, t in named) / 2**20


def refit_rows(repeats: int) -> list[dict]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, max_position_embeddings=64)).to(torch.bfloat16).eval()
    lora = apply_lora(hf, rank=16, alpha=32, dropout=0.0, target_modules=TARGETS)
    with torch.no_grad():  # a trained adapter's values (B = 0 at init)
        for layer in lora.layers.values():
            layer.lora_B["default"].weight.normal_(0, 0.02)
    spec = EngineSpec(max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16)
    adapter_spec = EngineSpec(max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16,
                              lora=AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)))
    full_engine, merged_engine, adapter_engine = (RolloutEngine(hf.config, s) for s in (spec, spec, adapter_spec))
    full = lora.refit_tensors("merged", full=True)  # what a full-fine-tuning run sends: every weight
    adapter = lora.refit_tensors("adapter", full=False, dtype=torch.bfloat16)  # as RolloutWorker sends it
    merged = lora.refit_tensors("merged", full=False)
    refit_from_model(full_engine, full, bucket_bytes=BUCKET)
    refit_from_model(merged_engine, full, bucket_bytes=BUCKET)
    refit_from_model(adapter_engine, lora.refit_tensors("adapter", full=True), bucket_bytes=BUCKET)

    def partial(engine, named):
        return lambda: refit_from_model(engine, named, bucket_bytes=BUCKET, partial=True)

    t_full, t_adapter, t_merged = best_interleaved(
        [lambda: refit_from_model(full_engine, full, bucket_bytes=BUCKET), partial(adapter_engine, adapter),
         partial(merged_engine, merged)], repeats)
    # merged: the product W + scale·B·A is computed in the trainer each refit; count it too
    t_merge = best_interleaved([lora.merged_tensors], repeats)[0]
    base = f"full refit, every weight ({_mib(full):.0f} MiB bf16)"
    case = "qwen2.5-0.5b bf16 r16 qkvo+mlp"
    return [
        row(case=f"{case} adapter", metric="refit payload MiB", ours=_mib(adapter), baseline=_mib(full),
            baseline_name=base, higher_is_better=False),
        row(case=f"{case} adapter", metric="refit s", ours=t_adapter, baseline=t_full, baseline_name=base,
            higher_is_better=False),
        row(case=f"{case} merged", metric="refit payload MiB", ours=_mib(merged), baseline=_mib(full),
            baseline_name=base, higher_is_better=False),
        row(case=f"{case} merged", metric="refit s (+ merge in trainer)", ours=t_merged + t_merge, baseline=t_full,
            baseline_name=base, higher_is_better=False),
    ]


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
run.step(random.Random(0))
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
        rows += refit_rows(repeats=3 if args.quick else 7)
        print(format_table(rows), flush=True)
        if not args.quick:
            rows += learning_rows(Path(tmp), Path("bench_out") / "lora_learning.png")
    print(f"\n{time.perf_counter() - t0:.0f} s, rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MiB")
    report(rows, args.json)
    for r in rows:
        if r["metric"] == "refit payload MiB" and r["case"].endswith("adapter"):
            print(goal_line("adapter refit payload / full refit <= 0.02 (issue #27)", r["baseline"] / r["ours"], 50))
        if r["metric"] == "refit s" and r["case"].endswith("adapter"):
            print(goal_line("adapter refit time / full refit <= 0.1 (issue #27)", r["baseline"] / r["ours"], 10))


if __name__ == "__main__":
    main()
