"""Chunked prefill: running requests' inter-token latency while a prompt 8x the prefill budget
arrives, and that prompt's time to first token — the engine with ``chunked_prefill=True``
(a chunk of the budget per step, between decode steps) vs the same engine with ``False``
(the long prompt admitted alone and prefilled whole in one step).

    python benchmarks/chunked_prefill.py [--quick] [--json PATH]

Workload: the 56M "small" Qwen2 (random init), 4 decoders generating greedily; after
``WARM`` steps the long prompt arrives. Every step gives each decoder one token, so a
decoder's inter-token latency is the step's wall time: p50 and max over the steps from the
long prompt's arrival until the decoders finish. Each case is run ``repeats`` times,
interleaved, the median per metric kept.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMALL, parse_args, report, row  # noqa: E402

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams

WARM = 4
"""decode steps of the decoders before the long prompt arrives."""
DECODERS = 4


def make_engine(hf, budget: int, max_seq_len: int, chunked: bool) -> RolloutEngine:
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=DECODERS + 2, max_seq_len=max_seq_len),
                           max_prefill_tokens=budget)
    engine.chunked_prefill = chunked
    engine.load_weights(hf.named_parameters())
    return engine


def one_run(engine: RolloutEngine, long: list[int], decoders: list[list[int]], new_tokens: int) -> dict:
    """ITL p50 / max (ms) of the decoders from the long prompt's arrival; its TTFT (ms)."""
    for i, p in enumerate(decoders):
        engine.add_request(f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=new_tokens))
    for _ in range(WARM):
        engine.step()
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=4))
    t_arrive, ttft, itl = time.perf_counter(), None, []
    live = {f"d{i}" for i in range(len(decoders))}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        out = engine.step()
        t1 = time.perf_counter()
        if live:
            itl.append(t1 - t0)
        live -= {r.request_id for r in out.finished}
        sampled = {s.request_id for s in out.running} | {r.request_id for r in out.finished}
        if ttft is None and "long" in sampled:
            ttft = t1 - t_arrive
    return {"itl_p50": 1e3 * statistics.median(itl), "itl_max": 1e3 * max(itl), "ttft": 1e3 * ttft}


def main() -> None:
    args = parse_args(__doc__)
    budget, repeats = (32, 3) if args.quick else (128, 5)
    prompt_len, new_tokens = 8 * budget, 48 if args.quick else 96
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, max_position_embeddings=4096)).eval()
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, SMALL["vocab_size"], (prompt_len,), generator=g).tolist()
    decoders = [torch.randint(0, SMALL["vocab_size"], (8,), generator=g).tolist() for _ in range(DECODERS)]
    max_seq_len = prompt_len + 16
    engines = {c: make_engine(hf, budget, max_seq_len, c) for c in (True, False)}
    for e in engines.values():  # warm-up (allocator, first-call costs)
        one_run(e, long[:2 * budget], decoders, 8)
    runs = {True: [], False: []}
    for _ in range(repeats):
        for c, e in engines.items():
            runs[c].append(one_run(e, long, decoders, new_tokens))
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    case = f"small, {DECODERS} decoding, budget {budget}, prompt {prompt_len}"
    base = "same engine, chunked_prefill=False (long prompt prefilled whole, alone)"
    rows = [row(case=case, metric=metric, ours=med[True][key], baseline=med[False][key], baseline_name=base,
                higher_is_better=False)
            for metric, key in (("ITL p50 ms", "itl_p50"), ("ITL max ms", "itl_max"), ("long TTFT ms", "ttft"))]
    report(rows, args.json)


if __name__ == "__main__":
    main()
