"""Rollout throughput: hybridrl RolloutEngine vs transformers `generate` (dynamic and
static cache), same model, prompts, sampling (temperature 1, no stop tokens, every row
generates the full length), dtype and thread count, measured in the same run.

Also reports the weight-streaming floor for the small model at batch 1: weight bytes
read per token / memcpy bandwidth measured now.

    python benchmarks/rollout.py [--quick] [--json PATH] [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from hybridrl.rollout import RolloutEngine, SamplingParams

PROMPT_LEN = 32
MODELS = {
    "tiny": dict(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352),
    "small": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=1408),
}


def _timed(fn, repeats: int) -> float:
    """Best-of-`repeats` wall time (the machine is shared; the minimum is the least noisy)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _memcpy_bandwidth() -> float:
    """Bytes per second read by a large tensor copy (read-only weight streaming is at least this)."""
    src = torch.randn(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    return src.numel() * 4 / _timed(lambda: dst.copy_(src), 5)


def _weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Every weight is read once per decode step except the embedding (one row)."""
    total = 0
    for name, p in model.named_parameters():
        total += p[0].numel() * p.element_size() if "embed_tokens" in name else p.numel() * p.element_size()
    return total


def bench_case(size: str, batch: int, new_tokens: int, dtype: torch.dtype, repeats: int):
    cfg = transformers.Qwen2Config(**MODELS[size], tie_word_embeddings=False, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()
    engine = RolloutEngine(cfg, max_batch_size=batch, max_seq_len=PROMPT_LEN + new_tokens, dtype=dtype)
    engine.load_weights(hf.named_parameters())
    prompts = torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    ours = _timed(lambda: engine.generate(prompts.tolist(), params), repeats)
    rows, tokens = [], batch * new_tokens
    for cache in ("dynamic", "static"):
        kw = dict(cache_implementation="static") if cache == "static" else {}
        gen = lambda: hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,  # noqa: E731
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **kw)
        with torch.inference_mode():
            base = _timed(gen, repeats)
        rows.append(dict(case=f"{size} b={batch} T={new_tokens}", metric="tokens/s", ours=tokens / ours,
                         baseline=tokens / base, baseline_name=f"hf generate ({cache} cache)",
                         higher_is_better=True))
    if size == "small" and batch == 1:
        floor = _memcpy_bandwidth() / _weight_bytes_per_token(hf)
        rows.append(dict(case=f"{size} b=1 T={new_tokens}", metric="tokens/s", ours=tokens / ours, baseline=floor,
                         baseline_name="weight-streaming floor", higher_is_better=True))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and cases (< 1 min)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads for both sides (0 = torch default)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        cases, new_tokens, repeats = [("tiny", 1), ("tiny", 16), ("small", 1), ("small", 16)], 32, 1
    else:
        cases, new_tokens, repeats = [(s, b) for s in ("tiny", "small") for b in (1, 16, 64)], 128, 2
    rows = []
    for size, batch in cases:
        rows += bench_case(size, batch, new_tokens, dtype, repeats)
        _print(rows[-(3 if (size, batch) == ("small", 1) else 2):])
    print(f"\nthreads={torch.get_num_threads()} dtype={args.dtype}")
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


def _print(rows) -> None:
    print(f"{'case':<22} {'ours':>10} {'baseline':>10} {'ratio':>7}  baseline")
    for r in rows:
        print(f"{r['case']:<22} {r['ours']:>10.1f} {r['baseline']:>10.1f} {r['ours'] / r['baseline']:>6.2f}x  "
              f"{r['baseline_name']}", flush=True)


if __name__ == "__main__":
    main()
