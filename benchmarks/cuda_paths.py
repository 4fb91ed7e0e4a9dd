"""The CUDA paths, timed: decode-step graph replay vs eager, decode cost vs max_seq_len, and
refit vs ``copy_``, for bf16 and FP8 engines (the subject of scripts/gpu_check.sh on a lent GPU).

    python benchmarks/cuda_paths.py [--quick] [--json PATH] [--device cuda|cpu]

Per engine precision (bf16, fp8 per channel, fp8 128x128 blocks), on the small benchmark
model (vocab 32000, hidden 512, 8 layers):
- decode step at batch 1 / 16 / 64: captured CUDA graph replay vs the same step eager
  (``decode_eager``, what the graph captured), ms per step; every replay is also checked
  bitwise against eager at the same (captured) batch size (a stale address would show
  here first);
- refit of the whole model, in process: GB/s vs a plain ``copy_`` of the same bytes.
And once (bf16): the decode step at max_seq_len 4096 vs 512 for the same live length
(256 tokens) and batch 16 — a graph attends over every slot of its cache rows, so this
ratio is ~1 only when decode attention reads per-row lengths (flash-attn's
``cache_seqlens``); the case name says which kernel ran.
On CPU (no graphs) the eager rows, the long-context row (the step a graph would run:
kv_len = max_seq_len) and the refit rows run, so the script stays testable.

Rows are written to ``--json`` after every engine, and on an error the rows so far are
written with the error before the script exits 1 (a timeout in gpu_check.sh then still
leaves what was measured).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, row, write_json  # noqa: E402

from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine

SMALL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=1408, tie_word_embeddings=False)
QUANTIZATIONS = {"bf16": None, "fp8": "fp8", "fp8_block": "fp8_block"}
LONG, SHORT, LIVE, LONG_BATCH = 4096, 512, 256, 16  # the max_seq_len row


def _seconds(fn, device: torch.device, repeats: int) -> float:
    """Best wall time of ``fn`` with the device drained before and after."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
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
    eng = RolloutEngine(hf.config, EngineSpec(max_batch_size=max(batches), max_seq_len=256, dtype=torch.bfloat16,
                                              device=device, quantization=QUANTIZATIONS[name]))
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
            if batch not in runner.graphs.batch_sizes:
                raise SystemExit(f"{name} b={batch}: not a captured size; compare at captured sizes only")
            if not torch.equal(replay().clone(), eager()):
                raise SystemExit(f"{name} b={batch}: graph replay differs from eager")
            t_graph = _seconds(replay, device, repeats)
            rows.append(row(case=f"{name} b={batch}", metric="decode step ms", ours=t_graph * 1e3,
                            baseline=t_eager * 1e3, baseline_name="eager decode step", higher_is_better=False))
        else:
            rows.append(row(case=f"{name} b={batch}", metric="decode step ms (eager)", ours=t_eager * 1e3,
                            baseline=t_eager * 1e3, baseline_name="(no graphs on this device)",
                            higher_is_better=False))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for d, (_, t) in zip(dst, named):
            d.copy_(t)

    t_refit = _seconds(lambda: refit_from_model(eng, named), device, repeats)
    t_copy = _seconds(memcpy, device, repeats)
    rows.append(row(case=f"{name} refit", metric="GB/s", ours=nbytes / t_refit / 1e9, baseline=nbytes / t_copy / 1e9,
                    baseline_name="copy_ of the same bytes", higher_is_better=True))
    return rows


def _decode_step_seconds(hf, named, device, max_seq_len: int, repeats: int) -> tuple[float, str]:
    """One decode step at batch LONG_BATCH, every row at live length LIVE, as the engine runs
    it with graphs (on CPU: the step a graph would capture, kv_len = max_seq_len)."""
    eng = RolloutEngine(hf.config, EngineSpec(max_batch_size=LONG_BATCH, max_seq_len=max_seq_len, dtype=torch.bfloat16,
                                              device=device))
    eng.load_weights(named)
    runner = eng.runner
    tokens = torch.randint(0, hf.config.vocab_size, (LONG_BATCH,), device=device)
    positions = torch.full((LONG_BATCH,), LIVE - 1, dtype=torch.long, device=device)
    if runner.graphs is not None:
        step = lambda: runner.graphs.replay(tokens, positions)  # noqa: E731
    else:
        def step():
            with torch.inference_mode():
                return runner.decode_eager(tokens, positions, max_seq_len)
    kernel = "flash" if runner.flash_decode else "sdpa"
    return _seconds(step, device, repeats), kernel


def bench_long_context(hf, named, device, repeats) -> list[dict]:
    t_long, kernel = _decode_step_seconds(hf, named, device, LONG, repeats)
    t_short, _ = _decode_step_seconds(hf, named, device, SHORT, repeats)
    mode = "graph" if device.type == "cuda" else "eager, kv_len=max_seq_len"
    return [row(case=f"bf16 b={LONG_BATCH} live={LIVE} ({kernel})", metric=f"decode ms @max_seq_len {LONG}",
                ours=t_long * 1e3, baseline=t_short * 1e3, higher_is_better=False,
                baseline_name=f"same step @max_seq_len {SHORT} ({mode}; ~1x = cost follows live length)")]


def _write(path: str | None, rows: list[dict], error: str | None = None) -> None:
    if path:
        write_json(path, rows, error=error)  # atomic, with the machine stamp and load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 16, fewer repeats")
    ap.add_argument("--json", help="write the rows here (after every engine, and on an error)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows: list[dict] = []

    def on_term(signum, frame):  # `timeout` sends SIGTERM: leave the rows and the reason
        raise TimeoutError(f"terminated by signal {signum} (a timeout?)")

    signal.signal(signal.SIGTERM, on_term)
    try:
        torch.manual_seed(0)
        print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
        hf = Qwen2ForCausalLM(Qwen2Config(**SMALL, max_position_embeddings=LONG)).to(torch.bfloat16).eval()
        named = [(n, p.detach().to(device)) for n, p in hf.named_parameters()]
        batches, repeats = ((1, 16), 3) if args.quick else ((1, 16, 64), 10)
        for name in QUANTIZATIONS:
            rows += bench_engine(name, hf, named, device, batches, repeats)
            _write(args.json, rows)
        rows += bench_long_context(hf, named, device, repeats)
        _write(args.json, rows)
    except BaseException as e:  # noqa: BLE001 - write what was measured, then fail
        message = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        if rows:
            print(format_table(rows))
        _write(args.json, rows, error=message)
        print(f"cuda_paths: FAILED after {len(rows)} rows: {message}", file=sys.stderr)
        sys.exit(1)
    print(format_table(rows))
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
