"""Mixture of experts: rollout throughput and the trainer/engine log-prob gap with and
without routing replay, on a small random Qwen3-MoE (8 experts, top-2, hidden 256, 4 layers).

Rows:
- ``decode tok/s``: hybridrl ``RolloutEngine.generate`` vs transformers ``generate``
  (dynamic cache, its default grouped-GEMM experts), same model, prompts, sampling
  (temperature 1, every row generates the full length), dtype and threads, interleaved,
  best of repeats; batch 1 / 16 / 64 (``--quick``: 1 / 16, fewer tokens).
- ``mean |logp gap|`` (and ``max``): the engine's sampling log-probs vs the trainer's
  recomputation (transformers, float32, ``log_softmax(logits / T)`` at the sampled tokens),
  over response tokens, for an MXFP4-expert engine and a bf16 engine. ``ours`` = the trainer
  replays the engine's recorded expert choices (``hybridrl.rollout.routing``), ``baseline`` =
  the trainer routes on its own. What replay removes is the routing part of the gap; the
  rest is the engine's weight/rounding error.
- ``routing agreement``: fraction of (token, MoE layer) top-k sets the trainer chooses
  exactly as the engine did, without replay (with replay: 1 by construction).

    python benchmarks/moe.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_interleaved, moe_model as make_model, parse_args, report, row  # noqa: E402

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams  # noqa: E402
from hybridrl.rollout.routing import enable_routing_record, hf_routers, replay_routing  # noqa: E402

PROMPT_LEN = 32


def bench_decode(hf, batch: int, new_tokens: int, repeats: int) -> dict:
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=batch, max_seq_len=PROMPT_LEN + new_tokens))
    engine.load_weights(hf.named_parameters())
    prompts = torch.randint(0, hf.config.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    ours = lambda: engine.generate(prompts.tolist(), params)  # noqa: E731
    theirs = lambda: hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,  # noqa: E731
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t_ours, t_hf = best_interleaved([ours, theirs], repeats)
    tokens = batch * new_tokens
    return row(case=f"batch {batch} x {new_tokens} new", metric="decode tok/s", ours=tokens / t_ours,
               baseline=tokens / t_hf, baseline_name="transformers generate", higher_is_better=True)


def trainer_logprobs(hf, out, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, out.input_ids[:, 1:, None])[..., 0]
    full = torch.zeros_like(out.logprobs)
    full[:, 1:] = logp
    return full * out.response_mask


def trainer_choices(hf, out) -> torch.Tensor:
    """[B, L, layers, k] top-k sets the trainer's own routers pick (sorted, for set comparison)."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in hf_routers(hf)]
    try:
        with torch.no_grad():
            hf(input_ids=out.input_ids, attention_mask=out.attention_mask)
    finally:
        for h in hooks:
            h.remove()
    B, L = out.input_ids.shape
    return torch.stack(seen, dim=1).view(B, L, len(seen), -1).sort(dim=-1).values


def bench_gap(hf, label: str, n_prompts: int, new_tokens: int, **spec_kw) -> list[dict]:
    spec = EngineSpec(max_batch_size=n_prompts, max_seq_len=PROMPT_LEN + new_tokens, **spec_kw)
    engine = RolloutEngine(hf.config, spec)
    recorder = enable_routing_record(engine)
    engine.load_weights(hf.named_parameters())
    prompts = torch.randint(0, hf.config.vocab_size, (n_prompts, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    out = engine.generate(prompts.tolist(), SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=3))
    routed = recorder.take(out)
    resp = out.response_mask.bool()
    plain = trainer_logprobs(hf, out, 1.0)
    with replay_routing(hf, routed):
        replayed = trainer_logprobs(hf, out, 1.0)
    gap_plain, gap_replay = (plain - out.logprobs)[resp].abs(), (replayed - out.logprobs)[resp].abs()
    fed = routed[..., 0] >= 0
    agree = (trainer_choices(hf, out) == routed.long().sort(dim=-1).values).all(-1)[fed].float().mean()
    case = f"{label} engine vs fp32 trainer"
    return [
        row(case=case, metric="mean |logp gap|", ours=gap_replay.mean(), baseline=gap_plain.mean(),
            baseline_name="no routing replay", higher_is_better=False),
        row(case=case, metric="max |logp gap|", ours=gap_replay.max(), baseline=gap_plain.max(),
            baseline_name="no routing replay", higher_is_better=False),
        row(case=case, metric="routing agreement", ours=1.0, baseline=agree, baseline_name="no routing replay",
            higher_is_better=True),
    ]


def main() -> None:
    args = parse_args(__doc__, lambda ap: ap.add_argument("--threads", type=int, default=2))
    torch.set_num_threads(args.threads)
    hf = make_model()
    batches, new_tokens, repeats = ((1, 16), 16, 2) if args.quick else ((1, 16, 64), 64, 3)
    rows = [bench_decode(hf, b, new_tokens, repeats) for b in batches]
    n_prompts, gap_tokens = (8, 16) if args.quick else (32, 48)
    rows += bench_gap(hf, "mxfp4", n_prompts, gap_tokens, quantization="mxfp4")
    rows += bench_gap(hf, "bf16", n_prompts, gap_tokens, dtype=torch.bfloat16)
    report(rows, args.json)


if __name__ == "__main__":
    main()
