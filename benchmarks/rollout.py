"""Rollout throughput: hybridrl RolloutEngine vs transformers `generate` (dynamic and
static cache), same model, prompts, sampling (temperature 1, no stop tokens, every row
generates the full length: min_new_tokens = max_new_tokens on the HF side), dtype and
thread count, measured in the same run with the sides interleaved (best of repeats).

Also reports the weight-streaming floor for the small model at batch 1: weight bytes
read per token / memcpy bandwidth measured now (the issue's definition; a second row uses
the read-only bandwidth of a streaming sum, a stricter floor), and the RL default job's rollout
(`hybridrl train` defaults: 32 prompts x n=8 of 5-9 tokens, <= 8 new, stop on eos).

    python benchmarks/rollout.py [--quick] [--json PATH] [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_interleaved  # noqa: E402

from hybridrl.rollout import RolloutEngine, SamplingParams

PROMPT_LEN = 32
MODELS = {
    "tiny": dict(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352),
    "small": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=1408),
}


def _memcpy_bandwidth() -> float:
    """Bytes per second of a plain ``copy_`` of 256 MiB into preallocated storage (bytes
    copied / time: the issue's floor). Larger than the small model's weights, so it streams
    from memory as they do."""
    src = torch.randn(256 * 2**20 // 4)
    dst = torch.empty_like(src)
    return src.numel() * 4 / best_interleaved([lambda: dst.copy_(src)], 5)[0]


def _read_bandwidth() -> float:
    """Bytes per second streamed by a reduction over 256 MiB (reads only, like weights): a
    stricter floor than memcpy's, reported alongside."""
    src = torch.randn(256 * 2**20 // 4)
    return src.numel() * 4 / best_interleaved([src.sum], 5)[0]


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
    ours = lambda: engine.generate(prompts.tolist(), params)  # noqa: E731
    gens = []
    for cache in ("dynamic", "static"):
        kw = dict(cache_implementation="static") if cache == "static" else {}
        gens.append(lambda kw=kw: hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **kw))
    with torch.inference_mode():
        ours, *bases = best_interleaved([ours] + gens, repeats)
    rows, tokens = [], batch * new_tokens
    for cache, base in zip(("dynamic", "static"), bases):
        rows.append(dict(case=f"{size} b={batch} T={new_tokens}", metric="tokens/s", ours=tokens / ours,
                         baseline=tokens / base, baseline_name=f"hf generate ({cache} cache)",
                         higher_is_better=True))
    if size == "small" and batch == 1:
        for name, bandwidth in (("memcpy", _memcpy_bandwidth()), ("read-only", _read_bandwidth())):
            floor = bandwidth / _weight_bytes_per_token(hf)
            rows.append(dict(case=f"{size} b=1 T={new_tokens}", metric="tokens/s", ours=tokens / ours, baseline=floor,
                             baseline_name=f"weight-streaming floor ({name} {bandwidth / 1e9:.1f} GB/s)",
                             higher_is_better=True))
    return rows


def bench_rl_job(dtype: torch.dtype, repeats: int) -> list[dict]:
    """The default `hybridrl train` rollout: 2-layer hidden-128 Qwen2 (untied, vocab 19), 32 prompts
    of 5-9 tokens x n=8 samples, <= 8 new tokens, temperature 1, stop on eos (both sides)."""
    cfg = transformers.Qwen2Config(vocab_size=19, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512, tie_word_embeddings=False,
                                   max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()
    n, new_tokens = 8, 8
    prompts = [torch.randint(2, 19, (int(torch.randint(5, 10, (1,))),)).tolist() for _ in range(32)]
    engine = RolloutEngine(cfg, max_batch_size=len(prompts) * n, max_seq_len=9 + new_tokens, dtype=dtype)
    engine.load_weights(hf.named_parameters())
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=(1,), n=n, seed=0)
    rows = [p for p in prompts for _ in range(n)]
    S = max(map(len, rows))
    ids = torch.tensor([[0] * (S - len(p)) + p for p in rows])  # HF wants left padding
    mask = (ids != 0).long()
    gen = lambda: hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,  # noqa: E731
                              top_p=1.0, max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=1)
    with torch.inference_mode():
        ours, base = best_interleaved([lambda: engine.generate(prompts, params), gen], repeats)
    return [dict(case="rl job 32x8 T<=8", metric="rollouts/s", ours=len(rows) / ours, baseline=len(rows) / base,
                 baseline_name="hf generate (dynamic cache)", higher_is_better=True)]


def bench_compaction(dtype: torch.dtype, repeats: int, new_tokens: int) -> list[dict]:
    """Finished rows stop costing compute: batch 64 whose rows stop at varied lengths (random
    init, vocab 64, stop token 1: geometric lengths), compaction on vs off, same seeds."""
    cfg = transformers.Qwen2Config(**MODELS["tiny"], tie_word_embeddings=False, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()
    prompts = [torch.randint(2, 64, (32,)).tolist() for _ in range(64)]
    engine = RolloutEngine(cfg, max_batch_size=64, max_seq_len=32 + new_tokens, dtype=dtype)
    engine.load_weights(hf.named_parameters())
    params = [SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=(1,), seed=i) for i in range(64)]

    def run(compact: bool):
        engine.compact_finished_rows = compact
        return engine.generate(prompts, params)

    on, off = run(True), run(False)
    assert on.response_token_ids == off.response_token_ids, "compaction changed the samples"
    tokens = sum(map(len, on.response_token_ids))
    with torch.inference_mode():
        t_on, t_off = best_interleaved([lambda: run(True), lambda: run(False)], repeats)
    engine.compact_finished_rows = True
    return [dict(case=f"compaction b=64 T<={new_tokens} (mean len {tokens / 64:.0f})", metric="tokens/s",
                 ours=tokens / t_on, baseline=tokens / t_off, baseline_name="same engine, no compaction",
                 higher_is_better=True)]


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
        cases, new_tokens, repeats = [("tiny", 1), ("tiny", 16), ("small", 1), ("small", 16)], 32, 2
    else:
        cases, new_tokens, repeats = [(s, b) for s in ("tiny", "small") for b in (1, 16, 64)], 128, 2
    rows = bench_rl_job(dtype, 3 if args.quick else 10)
    rows += bench_compaction(dtype, repeats, 128)
    _print(rows)
    for size, batch in cases:
        rows += bench_case(size, batch, new_tokens, dtype, repeats)
        _print(rows[-(4 if (size, batch) == ("small", 1) else 2):])
    print(f"\nthreads={torch.get_num_threads()} dtype={args.dtype}")
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


def _print(rows) -> None:
    print(f"{'case':<36} {'ours':>10} {'baseline':>10} {'ratio':>7}  baseline")
    for r in rows:
        print(f"{r['case']:<36} {r['ours']:>10.1f} {r['baseline']:>10.1f} {r['ours'] / r['baseline']:>6.2f}x  "
              f"{r['baseline_name']}", flush=True)


if __name__ == "__main__":
    main()
