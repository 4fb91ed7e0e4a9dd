"""Continuous batching rows of ``rollout.py`` (issue #23): ours (the request scheduler under
``RolloutEngine.generate``) against the run-to-completion loop it replaced
(``_run_to_completion.py``: chunks of max_batch_size, each run to its longest row, finished
rows compacted out), vLLM, re-prefilling a conversation, and exact vs kept KV at a refit.

Every side samples with the same per-request seeds; where two sides must produce the same
tokens (ours vs run-to-completion up to fp32-rounding flips, ours with a cached prefix vs
without), the run checks it before timing.
"""

from __future__ import annotations

import random
import time

import torch
from _common import interleaved_times, median, row
from _run_to_completion import generate_run_to_completion

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams

RTC = "run to completion (the engine before continuous batching: chunks of max_batch_size, compaction)"


def heavy_tailed_lengths(count: int, cap: int, scale: int, seed: int = 0) -> list[int]:
    """Pareto(alpha = 1.1) response lengths, ``scale`` tokens at the least, capped at ``cap``:
    most answers short, a few run to the cap (the long tail of RL responses)."""
    rng = random.Random(seed)
    return [min(cap, max(1, int(scale / (1.0 - rng.random()) ** (1 / 1.1)))) for _ in range(count)]


def long_tail_workload(vocab: int, count: int, cap: int, scale: int):
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 48))] for _ in range(count)]
    lengths = heavy_tailed_lengths(count, cap, scale)
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=i) for i, n in enumerate(lengths)]
    return prompts, params, lengths


def bench_long_tail(hf, *, count: int, rows: int, cap: int, scale: int, repeats: int, vllm=None,
                    vllm_label: str = "") -> list[dict]:
    """tokens/s of ``count`` requests with heavy-tailed lengths on ``rows`` rows: ours vs
    run-to-completion (same engine, same tokens), and vs ``vllm`` when given."""
    prompts, params, lengths = long_tail_workload(hf.config.vocab_size, count, cap, scale)
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=rows, max_seq_len=48 + cap,
                                                 dtype=next(hf.parameters()).dtype))
    engine.load_weights(hf.named_parameters())
    with torch.inference_mode():
        ours_out = engine.generate(prompts, params)
        rtc_out = generate_run_to_completion(engine, prompts, params)
    # Same seeds, same tokens, except where a logit differs by fp32 rounding between batch
    # compositions and a uniform falls on the boundary (measured: 1 row of 64 diverged, after
    # log-prob differences <= 1e-6); a scheduling bug would change most rows.
    same = sum(a == b for a, b in zip(ours_out.response_token_ids, rtc_out.response_token_ids)) / count
    print(f"long tail: {100 * same:.0f}% of the requests sampled identical tokens on both sides", flush=True)
    assert same >= 0.8, f"continuous batching changed {100 * (1 - same):.0f}% of the samples"
    tokens = sum(lengths)
    fns = [lambda: engine.generate(prompts, params), lambda: generate_run_to_completion(engine, prompts, params)]
    if vllm is not None:
        fns.append(lambda: vllm.generate(prompts, params))
    with torch.inference_mode():
        times = interleaved_times(fns, repeats, warmup=0)
    case = f"long tail {count} req, {rows} rows, T<={cap} (mean {tokens / count:.0f})"
    out = [row(case=case, metric="tokens/s", ours=tokens / min(times[0]), baseline=tokens / min(times[1]),
               baseline_name=RTC, higher_is_better=True)]
    if vllm is not None:
        out += [row(case=case, metric="tokens/s", ours=tokens / min(times[0]), baseline=tokens / min(times[2]),
                    baseline_name=vllm_label, higher_is_better=True),
                row(case=case, metric="tokens/s (median)", ours=tokens / median(times[0]),
                    baseline=tokens / median(times[2]), baseline_name=vllm_label, higher_is_better=True)]
    return out


def bench_conversation(hf, *, history: int, turn: int, reply: int, repeats: int) -> list[dict]:
    """A conversation of ``history`` cached tokens continued by a ``turn``-token message:
    ours reuses the retained prefix (``parent=``), the baseline re-prefills the whole
    conversation (same engine, same request without ``parent``). Time to the first token,
    and the whole turn with a ``reply``-token answer."""
    rng = random.Random(2)
    vocab = hf.config.vocab_size
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=2, max_seq_len=history + turn + reply + 8,
                                                 dtype=next(hf.parameters()).dtype))
    engine.load_weights(hf.named_parameters())
    opening = [rng.randrange(vocab) for _ in range(history - 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("history", opening, greedy, retain=True)
    first = engine.run_until_finished(["history"])["history"]
    message = opening + first.token_ids + [rng.randrange(vocab) for _ in range(turn)]
    calls = iter(range(10**9))

    def continue_turn(max_tokens: int, parent: str | None):
        rid = f"turn-{next(calls)}"
        engine.add_request(rid, message, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=7), parent=parent)
        return engine.run_until_finished([rid])[rid]

    with torch.inference_mode():
        cached, fresh = continue_turn(reply, "history"), continue_turn(reply, None)
    assert cached.cached_tokens == len(opening) + len(first.token_ids) - 1 and fresh.cached_tokens == 0
    assert cached.token_ids == fresh.token_ids, "the cached prefix changed the continuation"
    out = []
    case = f"continue a {len(message) - turn}-token conversation by {turn} tokens"
    for what, max_tokens in (("time to first token s", 1), (f"turn with a {reply}-token reply s", reply)):
        with torch.inference_mode():
            t_cached, t_fresh = interleaved_times([lambda: continue_turn(max_tokens, "history"),
                                                   lambda: continue_turn(max_tokens, None)], repeats)
        out.append(row(case=case, metric=what, ours=min(t_cached), baseline=min(t_fresh),
                       baseline_name="re-prefill the conversation (same engine, no parent)", higher_is_better=False))
    return out


def bench_no_regression(cases, repeats: int) -> list[dict]:
    """``cases``: (case name, engine, prompts, params, count, metric) — ours vs run-to-completion."""
    out = []
    for case, engine, prompts, params, count, metric in cases:
        with torch.inference_mode():
            for _ in range(3):
                engine.generate(prompts, params)
                generate_run_to_completion(engine, prompts, params)
            ours, rtc = interleaved_times([lambda: engine.generate(prompts, params),
                                           lambda: generate_run_to_completion(engine, prompts, params)], repeats)
        out.append(row(case=case, metric=metric, ours=count / min(ours), baseline=count / min(rtc), baseline_name=RTC,
                       higher_is_better=True))
    return out


def bench_kv_on_refit(hf, *, requests: int, tokens: int, refit_after: int, noise: float, repeats: int) -> list[dict]:
    """A refit in the middle of a generation (weights moved by ``noise`` relative Gaussian noise,
    about one RL step): ``keep`` continues on the KV the old weights wrote, ``recompute``
    (exact) prefills every request again with the new weights. Rows: the seconds from the
    refit to the end, and how many post-refit greedy tokens agree with the exact ones."""
    rng = random.Random(3)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(requests)]
    p = SamplingParams(temperature=0.0, max_tokens=tokens)
    old = {n: t.detach().clone() for n, t in hf.named_parameters()}
    g = torch.Generator().manual_seed(4)
    new = {n: t + noise * t.abs().mean() * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in old.items()}
    engines = {mode: RolloutEngine(hf.config, EngineSpec(max_batch_size=requests, max_seq_len=32 + tokens,
                                                        dtype=next(hf.parameters()).dtype), kv_on_refit=mode)
               for mode in ("keep", "recompute")}

    def run(mode: str):
        """(seconds from the refit to the end, outputs)."""
        engine = engines[mode]
        engine.load_weights(old.items())
        ids = [f"{mode}-{engine.weight_version}-{i}" for i in range(requests)]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, p)
        for _ in range(refit_after):
            engine.step()
        t0 = time.perf_counter()
        engine.load_weights(new.items())
        outs = engine.run_until_finished(ids)
        return time.perf_counter() - t0, [outs[i] for i in ids]

    times, outputs = {"keep": [], "recompute": []}, {}
    with torch.inference_mode():
        for _ in range(repeats):
            for mode in times:
                t, outputs[mode] = run(mode)
                times[mode].append(t)
    kept, exact = outputs["keep"], outputs["recompute"]
    after = [(k.token_ids[refit_after:], e.token_ids[refit_after:]) for k, e in zip(kept, exact)]
    agree = sum(a == b for ka, ea in after for a, b in zip(ka, ea)) / max(1, sum(len(ea) for _, ea in after))
    first_diff = [next((i for i, (a, b) in enumerate(zip(ka, ea)) if a != b), len(ea)) for ka, ea in after]
    case = f"refit mid-generation, {requests} req, after {refit_after} of {tokens} tokens, noise {noise:g}"
    name = "kv_on_refit=recompute (exact: every request prefilled again with the new weights)"
    return [row(case=case, metric="seconds refit -> done", ours=min(times["keep"]), baseline=min(times["recompute"]),
                baseline_name=name, higher_is_better=False),
            row(case=case, metric="post-refit greedy tokens = exact (%)", ours=100 * agree, baseline=100.0,
                baseline_name=name, higher_is_better=True),
            row(case=case, metric="tokens until first divergence (mean)", ours=sum(first_diff) / len(first_diff),
                baseline=float(tokens - refit_after), baseline_name=name, higher_is_better=True)]
