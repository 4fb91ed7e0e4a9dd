"""Mixture of experts: rollout throughput and the trainer/engine log-prob gap with and
without routing replay, on a small random Qwen3-MoE (8 experts, top-2, hidden 256, 4 layers).

Rows:
- ``tokens/s``: hybridrl ``RolloutEngine.generate`` vs transformers ``generate``
  (dynamic cache, its default grouped-GEMM experts), same model, prompts, sampling
  (temperature 1, every row generates the full length), dtype and threads, interleaved,
  best of 3 (full: 5) after a warm-up call; batch 1 / 16 / 64 x 128 new tokens
  (``--quick``: 1 / 16 x 16). The very measurement of ``rollout.py``'s MoE rows
  (``rollout.bench_case``: same sizes, repeats, warm-up and thread default), so the two
  scripts agree. The README's earlier ``moe.py`` rows were ~10x below ``rollout.py``'s for
  the same case (both sides, HF's too) because this script forced 2 intra-op threads
  (``--threads`` default 2) while those ``rollout.py`` rows ran ``--threads 1``, both on the
  shared 2 cores under load: 2 OpenMP threads competing with other processes for 2 cores
  stall at every barrier (the same case re-measured under load, batch 1 x 16: ours 360-386
  tok/s, HF 289 at 1 thread; ours 8-79, HF 9-77 at 2). Sizes were the same (quick: batch
  1 / 16 x 16 tokens, 2 repeats) and so was the decode loop. Now both default to torch's
  thread count and take ``--threads``.
- ``mean |logp gap|`` (and ``max``): the engine's sampling log-probs vs the trainer's
  recomputation (transformers, float32, ``log_softmax(logits / T)`` at the sampled tokens),
  over response tokens, for an MXFP4-expert engine and a bf16 engine. ``ours`` = the trainer
  replays the engine's recorded expert choices (``hybridrl.rollout.routing``), ``baseline`` =
  the trainer routes on its own. What replay removes is the routing part of the gap; the
  rest is the engine's weight/rounding error.
- ``routing agreement``: fraction of (token, MoE layer) top-k sets the trainer's forward
  uses that equal the engine's recorded choice for that token (as sets), over every token
  the engine fed through the model; both sides measured from transformers' routers' outputs
  (forward hooks) on the same inputs: ``ours`` with routing replay, ``baseline`` without.
  Also for DeepSeek-V3's DeepSeekMoE (``_mla.py``'s model: the grouped sigmoid router with its
  correction bias) with FP8 attention + MXFP4 experts and with a bf16 engine.

    python benchmarks/moe.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import moe_model as make_model, parse_args, report, row  # noqa: E402
from rollout import PROMPT_LEN, bench_case  # noqa: E402

from _mla import mla_model  # noqa: E402

from hybridrl.refit.transport import named_trainer_tensors  # noqa: E402
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams  # noqa: E402
from hybridrl.rollout.routing import enable_routing_record, hf_routers, replay_routing  # noqa: E402


def bench_decode(hf, batch: int, new_tokens: int, repeats: int) -> list[dict]:
    """``rollout.py``'s MoE rows: ours vs transformers ``generate`` (dynamic cache)."""
    return bench_case("moe", hf, batch, new_tokens, repeats, caches=("dynamic",))


def trainer_logprobs(hf, out, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, out.input_ids[:, 1:, None])[..., 0]
    full = torch.zeros_like(out.logprobs)
    full[:, 1:] = logp
    return full * out.response_mask


def trainer_choices(hf, out, routed: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L, layers, k] top-k sets the trainer's routers output in a forward over the
    rollouts (sorted, for set comparison): its own choice, or with ``routed`` replayed."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in hf_routers(hf)]
    try:
        with torch.no_grad(), (replay_routing(hf, routed) if routed is not None else contextlib.nullcontext()):
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
    engine.load_weights(named_trainer_tensors(hf))
    prompts = torch.randint(0, hf.config.vocab_size, (n_prompts, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    out = engine.generate(prompts.tolist(), SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=3))
    routed = recorder.take(out)
    resp = out.response_mask.bool()
    plain = trainer_logprobs(hf, out, 1.0)
    with replay_routing(hf, routed):
        replayed = trainer_logprobs(hf, out, 1.0)
    gap_plain, gap_replay = (plain - out.logprobs)[resp].abs(), (replayed - out.logprobs)[resp].abs()
    fed, engine_sets = routed[..., 0] >= 0, routed.long().sort(dim=-1).values
    agreement = lambda chosen: (chosen == engine_sets).all(-1)[fed].float().mean()  # noqa: E731
    agree_replay, agree_plain = agreement(trainer_choices(hf, out, routed)), agreement(trainer_choices(hf, out))
    case = f"{label} engine vs fp32 trainer"
    return [
        row(case=case, metric="mean |logp gap|", ours=gap_replay.mean(), baseline=gap_plain.mean(),
            baseline_name="no routing replay", higher_is_better=False),
        row(case=case, metric="max |logp gap|", ours=gap_replay.max(), baseline=gap_plain.max(),
            baseline_name="no routing replay", higher_is_better=False),
        row(case=case, metric="routing agreement", ours=agree_replay, baseline=agree_plain,
            baseline_name="no routing replay", higher_is_better=True),
    ]


def main() -> None:
    args = parse_args(__doc__, lambda ap: ap.add_argument(
        "--threads", type=int, default=0, help="intra-op threads for every side (0 = torch default)"))
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = make_model()
    batches, new_tokens, repeats = ((1, 16), 16, 3) if args.quick else ((1, 16, 64), 128, 5)  # as rollout.py
    rows = [r for b in batches for r in bench_decode(hf, b, new_tokens, repeats)]
    n_prompts, gap_tokens = (8, 16) if args.quick else (32, 48)
    rows += bench_gap(hf, "mxfp4", n_prompts, gap_tokens, quantization="mxfp4")
    rows += bench_gap(hf, "bf16", n_prompts, gap_tokens, dtype=torch.bfloat16)
    deepseek = mla_model(torch.float32)  # DeepSeekMoE: the grouped sigmoid router, replayed as for Qwen3-MoE
    rows += bench_gap(deepseek, "deepseek_v3 fp8+mxfp4", n_prompts, gap_tokens, quantization="fp8+mxfp4")
    rows += bench_gap(deepseek, "deepseek_v3 bf16", n_prompts, gap_tokens, dtype=torch.bfloat16)
    print(f"threads={torch.get_num_threads()}")
    report(rows, args.json)


if __name__ == "__main__":
    main()
