"""The CUDA paths, timed: decode-step graph replay vs eager, and refit vs ``copy_``, for
bf16 and FP8 engines (the subject of scripts/gpu_check.sh on a lent GPU).

    python benchmarks/cuda_paths.py [--quick] [--json PATH] [--device cuda|cpu]

Per engine precision (bf16, fp8 per channel, fp8 128x128 blocks), on the small benchmark
model (vocab 32000, hidden 512, 8 layers):
- decode step at batch 1 / 16 / 64: captured CUDA graph replay vs the same step eager
  (``decode_eager``, what the graph captured), ms per step; every replay is also checked
  bitwise against eager (a stale address would show here first);
- refit of the whole model, in process: GB/s vs a plain ``copy_`` of the same bytes.
On CPU (no graphs) only the eager and refit rows run, so the script stays testable.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from hybridrl.refit import refit_from_model
from hybridrl.rollout import RolloutEngine

SMALL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=1408, tie_word_embeddings=False)
QUANTIZATIONS = {"bf16": None, "fp8": "fp8", "fp8_block": "fp8_block"}


def _seconds(fn, device: torch.device, repeats: int) -> float:
    """Best wall time of ``fn`` with the device drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_engine(name: str, hf, named, device, batches, repeats) -> list[dict]:
    eng = RolloutEngine(hf.config, max_batch_size=max(batches), max_seq_len=256, dtype=torch.bfloat16,
                        device=device, quantization=QUANTIZATIONS[name])
    eng.load_weights(named)  # on CUDA this also captures the graphs
    runner, rows = eng.runner, []
    for batch in batches:
        tokens = torch.randint(0, hf.config.vocab_size, (batch,), device=device)
        positions = torch.full((batch,), 100, dtype=torch.long, device=device)

        def eager():
            with torch.inference_mode():
                return runner.decode_eager(tokens, positions, runner.max_seq_len)

        t_eager = _seconds(eager, device, repeats)
        if runner.graphs is not None:
            replay = lambda: runner.graphs.replay(tokens, positions)  # noqa: E731
            if not torch.equal(replay().clone(), eager()):
                raise SystemExit(f"{name} b={batch}: graph replay differs from eager")
            t_graph = _seconds(replay, device, repeats)
            rows.append(dict(case=f"{name} b={batch}", metric="decode step ms", ours=t_graph * 1e3,
                             baseline=t_eager * 1e3, baseline_name="eager decode step", higher_is_better=False))
        else:
            rows.append(dict(case=f"{name} b={batch}", metric="decode step ms (eager)", ours=t_eager * 1e3,
                             baseline=t_eager * 1e3, baseline_name="(no graphs on this device)",
                             higher_is_better=False))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for d, (_, t) in zip(dst, named):
            d.copy_(t)

    t_refit = _seconds(lambda: refit_from_model(eng, named), device, repeats)
    t_copy = _seconds(memcpy, device, repeats)
    rows.append(dict(case=f"{name} refit", metric="GB/s", ours=nbytes / t_refit / 1e9, baseline=nbytes / t_copy / 1e9,
                     baseline_name="copy_ of the same bytes", higher_is_better=True))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 16, fewer repeats")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**SMALL, max_position_embeddings=256)).to(torch.bfloat16).eval()
    named = [(n, p.detach().to(device)) for n, p in hf.named_parameters()]
    batches, repeats = ((1, 16), 3) if args.quick else ((1, 16, 64), 10)
    rows = []
    for name in QUANTIZATIONS:
        rows += bench_engine(name, hf, named, device, batches, repeats)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    report(rows, args.json)


if __name__ == "__main__":
    main()
