"""Shared pieces of the benchmark scripts: ``--quick`` / ``--json PATH`` arguments,
timing, the JSON row format and the side-by-side table; the models several scripts build
(random init from a config: nothing is downloaded); the optional vLLM baseline.

A row is one measured quantity, ours next to a baseline measured in the same run (never
a stored number)::

    {"case": "32x8", "metric": "step s", "ours": 1.2, "baseline": 3.4,
     "baseline_name": "TRL 1.16.0 GRPOTrainer, ...", "higher_is_better": false}

The printed ``speedup`` is how many times better ours is: ``baseline / ours`` when lower
is better, ``ours / baseline`` when higher is better (> 1 means ours wins either way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from contextlib import contextmanager
from typing import Iterator

ROW_KEYS = ("case", "metric", "ours", "baseline", "baseline_name", "higher_is_better")


def parse_args(doc: str | None = None, extra=None) -> argparse.Namespace:
    """``--quick`` and ``--json PATH``; ``extra(parser)`` may add script-specific options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, under a minute on 2 CPU cores")
    ap.add_argument("--json", metavar="PATH", help='write {"rows": [...]} to PATH')
    if extra is not None:
        extra(ap)
    return ap.parse_args()


@contextmanager
def timed(into: list[float]) -> Iterator[None]:
    """Append the wall-clock seconds of the ``with`` body to ``into``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into.append(time.perf_counter() - t0)


def best_interleaved(fns: list, repeats: int) -> list[float]:
    """Best wall time of each callable over ``repeats`` rounds, after one warm-up call each.

    The callables run interleaved within every round, so the load drifts of a shared
    machine hit ours and the baselines alike; the minimum is the least noisy estimate.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def median(xs: list[float]) -> float:
    if not xs:
        raise ValueError("median of no measurements: run more steps than the warm-up ones")
    return float(statistics.median(xs))


def row(*, case: str, metric: str, ours: float, baseline: float, baseline_name: str,
        higher_is_better: bool) -> dict:
    """One JSON row (the keys in :data:`ROW_KEYS`)."""
    return dict(case=case, metric=metric, ours=float(ours), baseline=float(baseline), baseline_name=baseline_name,
                higher_is_better=bool(higher_is_better))


def speedup(r: dict) -> float:
    """> 1 means ours is better, whichever direction the metric points."""
    num, den = (r["ours"], r["baseline"]) if r["higher_is_better"] else (r["baseline"], r["ours"])
    return num / den if den else float("inf")


def format_table(rows: list[dict]) -> str:
    w_case = max([len("case")] + [len(r["case"]) for r in rows]) + 2
    w_metric = max([len("metric")] + [len(r["metric"]) for r in rows]) + 2
    lines = [f"{'case':<{w_case}}{'metric':<{w_metric}}{'ours':>10}{'baseline':>10}{'speedup':>9}  baseline"]
    for r in rows:
        ratio = speedup(r)
        ratio_text = f"{ratio:>8.2f}x" if math.isfinite(ratio) else f"{'(0)':>9}"  # ours is 0, lower is better
        lines.append(f"{r['case']:<{w_case}}{r['metric']:<{w_metric}}{r['ours']:>10.4g}{r['baseline']:>10.4g}"
                     f"{ratio_text}  {r['baseline_name']}")
    return "\n".join(lines)


def write_json(path: str, rows: list[dict], error: str | None = None) -> None:
    """``{"machine": {...}, "load": {"before", "after"}, "rows": [...]}`` (plus ``"error"``
    when given) to ``path``, atomically (a reader never sees half a file). ``machine`` and
    ``load`` are measured in this process (``_machine.py``); ``rows`` keep the row format."""
    import os
    import sys
    from pathlib import Path

    for r in rows:
        missing = set(ROW_KEYS) - set(r)
        assert not missing, f"benchmark row {r} lacks {sorted(missing)}"
    try:
        import _machine
    except ModuleNotFoundError:  # imported from outside benchmarks/ (the tests)
        here = str(Path(__file__).resolve().parent)
        sys.path.insert(0, here)
        try:
            import _machine
        finally:
            sys.path.remove(here)
    try:
        machine = _machine.stamp()
    except Exception as e:  # noqa: BLE001 - the rows matter more than the stamp
        machine = {"stamp_error": f"{type(e).__name__}: {e}"}
    data = {"machine": machine, "load": _machine.load(), "rows": rows}
    if error is not None:
        data["error"] = error
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def report(rows: list[dict], json_path: str | None) -> None:
    """Print the table and, when asked, write the JSON file (with the machine stamp and load)."""
    print(format_table(rows))
    if json_path:
        write_json(json_path, rows)
        print(f"wrote {json_path}")


def goal_line(what: str, ratio: float, target: float) -> str:
    """One printed line: a speedup (as :func:`speedup`) against the issue's target."""
    return f"goal {what}: {ratio:.2f}x (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})"


# ---- models several benchmarks build ------------------------------------------------------
# The default `hybridrl train` model (untied Qwen2, the arithmetic task's 19-token vocabulary).
RL_JOB = dict(vocab_size=19, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=512, tie_word_embeddings=False, max_position_embeddings=128, pad_token_id=0,
              eos_token_id=1)
# The 56M "small" Qwen2 of the rollout, refit and vLLM benchmarks.
SMALL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, tie_word_embeddings=False)
# The small Qwen3-MoE of issue #16: 8 experts, top-2, hidden 256, 4 layers.
MOE = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
           norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False)


def rl_job(dtype=None, n: int = 8, max_tokens: int = 8):
    """The default `hybridrl train` rollout: ``(hf_model, prompts, params)`` with 32 prompts of
    5-9 tokens, ``n`` samples each, <= ``max_tokens`` new tokens, temperature 1, stop on eos."""
    import torch
    import transformers

    from hybridrl.rollout import SamplingParams

    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**RL_JOB)).to(dtype or torch.float32).eval()
    prompts = [torch.randint(2, 19, (int(torch.randint(5, 10, (1,))),)).tolist() for _ in range(32)]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=(RL_JOB["eos_token_id"],), n=n,
                            seed=0)
    return hf, prompts, params


def moe_model(seed: int = 0, dtype=None, **overrides):
    """A random Qwen3-MoE (``MOE`` with ``overrides``), weights scaled as in the tests so that
    routing and sampling are far from uniform."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**{**MOE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 2.0 / p.shape[-1] ** 0.5))
    return model.to(dtype or torch.float32).eval()


# ---- TRL (the `bench` extra): the baseline side of step.py and learning.py ----------------
def trl_side_inputs(cfg, run, script: str):
    """TRL's inputs for a comparison with ``run``: a fresh model of the run's built-in
    architecture (same seed, float32), the train prompts as a text ``Dataset`` (checked,
    through TRL's own prompt tokenization, to give exactly our prompt ids) and the
    exact-match reward in TRL's signature.

    TRL tokenizes text prompts with ``add_special_tokens=True``; the char tokenizer's
    post-processor prepends ``<bos>`` there, so the texts are the bare prompt texts (a
    ``<bos>`` in the text would give ``[bos, bos, ...]``). A tokenizer that adds no BOS of
    its own gets it in the text instead; whichever candidate matches every prompt is used."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import GRPOTrainer

    from hybridrl.rewards.registry import exact_match
    from hybridrl.job.model_factory import builtin_model

    def trl_prompt_ids(texts: list[str]) -> list[list[int]]:
        # GRPOTrainer's own _tokenize_prompts, unbound, on a stand-in holding the one
        # attribute it reads for text prompts
        ids = GRPOTrainer._tokenize_prompts(SimpleNamespace(processing_class=tok), list(texts))[0]
        return [list(x) for x in ids]

    m, tok, prompts = cfg.model, run.tokenizer, run.step.train_set
    model = builtin_model(tok, dataclasses.replace(m, dtype="float32"), seed=cfg.trainer.seed)
    ours = [list(p) for p in prompts.prompts]
    candidates = [list(prompts.prompt_texts)]
    if tok.bos_token is not None:
        candidates.append([tok.bos_token + p for p in prompts.prompt_texts])
    for texts in candidates:
        if trl_prompt_ids(texts) == ours:
            break
    else:
        got = trl_prompt_ids(candidates[0][:1])[0]
        raise RuntimeError(f"{script}: TRL's prompt tokenization differs from ours (first prompt "
                           f"{prompts.prompt_texts[0]!r}: TRL {got}, ours {ours[0]}); fix the prompt texts")
    data = Dataset.from_dict({"prompt": texts, "answer": list(prompts.answers)})

    def exact_match_reward(completions, answer, **_):
        return [exact_match(c, x) for c, x in zip(completions, answer)]

    return model, data, exact_match_reward


# ---- vLLM (optional): our VllmEngine, and plain vllm.LLM as its users run it ----------------
# The configuration our backend needs (vllm_backend/engine.py): eager on CPU, one seeded
# request per sample (reproducible samples; vLLM's CPU sampler then loops over rows), and a
# Python logits processor on every step (full-vocabulary log-probs before top-k / top-p).
VLLM = "VllmEngine (vLLM {v} CPU, eager, per-request seeds, log-prob processor)"
# vLLM as its users run it: default compilation, no per-request seeds, no logits processor.
VLLM_PLAIN = "vllm.LLM (vLLM {v} CPU, default compilation, no per-request seeds, logprobs=0)"


def vllm_version() -> str:
    """The installed vLLM's version, read at run time (after :func:`vllm_unavailable`)."""
    import vllm

    return vllm.__version__


def vllm_name(template: str) -> str:
    """``VLLM`` / ``VLLM_PLAIN`` with the installed version filled in."""
    return template.format(v=vllm_version())


def vllm_unavailable() -> str | None:
    """None when vLLM imports here; else one line saying why (the caller skips its vLLM rows).

    Imports it as the engine does (in-process mode, environment restored), so a broken
    install (e.g. a CUDA torchvision next to CPU torch) is caught here, not mid-benchmark."""
    from hybridrl.vllm_backend._import import import_vllm
    from hybridrl.vllm_backend.isolation import preserve_environ, preserve_torch_state

    try:
        with preserve_environ(), preserve_torch_state():
            import_vllm()
    except Exception as e:  # noqa: BLE001 - any failure to import means: no vLLM rows
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"
    return None


def start_vllm(hf, *, max_batch_size: int, max_seq_len: int, dtype=None):
    """An in-process ``VllmEngine`` holding ``hf``'s weights (through ``refit_from_model``).

    vLLM holds a torch.distributed group while it lives: one per process, ``close()`` it
    before starting the next. The engine restores torch's thread count around every call
    into vLLM (vLLM would drop it to 1), so both sides compute with the caller's threads."""
    import torch

    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    engine = VllmEngine(hf.config, EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                              dtype=dtype or torch.float32))
    try:
        refit_from_model(engine, hf)
    except BaseException:
        engine.close()
        raise
    return engine


class PlainVllm:
    """``vllm.LLM`` as its users run it, holding ``hf``'s weights: the model saved as a
    checkpoint (safetensors) and loaded by vLLM's default loader; vLLM's defaults otherwise
    (CPU: its compiled path, ``DYNAMO_TRACE_ONCE`` + inductor, compiled and warmed up by vLLM
    at start; V1 model runner; prefix caching), no logits processor, no per-request seeds
    (vLLM samples from torch's global generator), ``n`` samples per prompt in one request,
    the sampled token's log-prob (``logprobs=0``), no detokenization (no tokenizer: prompts
    are token ids). Two settings are not vLLM's defaults, as for ``VllmEngine``: the engine
    core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the weights never cross
    a process boundary), and torch's thread count is put back after start (in-process vLLM
    drops it to 1 unless ``OMP_NUM_THREADS`` is set), so it computes with the caller's
    threads like every other side. KV cache: the same bytes as ``VllmEngine``'s.

    :meth:`generate` takes our ``SamplingParams`` (its seed is ignored); rows with no stop
    token run to ``max_tokens`` (``ignore_eos``), as on every other side. One vLLM engine
    per process at a time: ``close()`` it before starting another."""

    def __init__(self, hf, *, max_batch_size: int, max_seq_len: int, dtype=None):
        import shutil
        import tempfile

        import torch

        from hybridrl.rollout import EngineSpec
        from hybridrl.vllm_backend._import import import_vllm
        from hybridrl.vllm_backend.isolation import preserve_environ, preserve_torch_state
        from hybridrl.vllm_backend.launch import VLLM_DTYPES, kv_cache_bytes

        dtype = dtype or next(hf.parameters()).dtype
        t0 = time.perf_counter()
        with preserve_environ():
            vllm = import_vllm()
        self._vllm, self.max_seq_len = vllm, max_seq_len
        self._dir = tempfile.mkdtemp(prefix="hybridrl-bench-vllm-")
        try:
            hf.save_pretrained(self._dir)
            kv = kv_cache_bytes(hf.config, EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                                      dtype=dtype))
            with preserve_torch_state(), preserve_environ():
                self.llm = vllm.LLM(model=self._dir, skip_tokenizer_init=True, dtype=VLLM_DTYPES[dtype],
                                    max_model_len=max_seq_len, max_num_seqs=max_batch_size,
                                    kv_cache_memory_bytes=kv, disable_log_stats=True)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.compilation_mode = self.llm.llm_engine.vllm_config.compilation_config.mode.name
        print(f"vllm.LLM (vLLM {vllm.__version__}) started in {time.perf_counter() - t0:.0f} s (not timed): "
              f"compilation {self.compilation_mode}, {torch.get_num_threads()} threads", flush=True)

    def generate(self, prompt_token_ids: list[list[int]], params):
        """``params``: one ``SamplingParams`` or one per prompt."""
        sp = self._vllm.SamplingParams
        each = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        requests = [sp(n=q.n, temperature=q.temperature, top_k=q.top_k if q.top_k > 0 else 0,
                       top_p=q.top_p, max_tokens=min(q.max_tokens, self.max_seq_len - len(p)),
                       stop_token_ids=list(q.stop_token_ids), ignore_eos=not q.stop_token_ids,
                       logprobs=0, detokenize=False) for p, q in zip(prompt_token_ids, each)]
        return self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], requests,
                                 use_tqdm=False)

    def close(self) -> None:
        import shutil

        from hybridrl.vllm_backend.isolation import shutdown_llm

        shutdown_llm(self.__dict__.pop("llm", None))
        shutil.rmtree(self._dir, ignore_errors=True)


def warm(engine, prompts, params, calls: int) -> None:
    """Steady state, as in a training run: vLLM's CPU GEMMs build a kernel per batch shape on
    first use (the RL job's first generate 3.7 s, ~0.3 s after ~10 calls with varied seeds,
    i.e. varied decode batch sizes), so an engine first runs ``calls`` generates with other
    seeds (``PlainVllm`` ignores seeds: its global generator varies the lengths itself)."""
    import dataclasses

    for i in range(calls):
        engine.generate(prompts, dataclasses.replace(params, seed=1000 + i))


def interleaved_times(fns: list, repeats: int, warmup: int = 1) -> list[list[float]]:
    """Wall times of each callable over ``repeats`` interleaved rounds, after ``warmup``
    untimed calls of each (never among the times): report ``min`` (best) and ``median``."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def engine_vs_hf_generate(name: str, hf, dtype, batch: int, new_tokens: int, repeats: int, *, prompt_len: int,
                          baseline_name: str = "hf generate (dynamic cache)") -> list[dict]:
    """tokens/s of our engine vs transformers ``generate`` on ``hf``: ``batch`` prompts of
    ``prompt_len`` tokens, every row ``new_tokens`` (temperature 1, no stop), interleaved."""
    import torch

    from hybridrl.refit.transport import named_trainer_tensors
    from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams

    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=batch, max_seq_len=prompt_len + new_tokens,
                                                 dtype=dtype))
    engine.load_weights(named_trainer_tensors(hf))
    prompts = torch.randint(0, hf.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    with torch.inference_mode():
        ours, theirs = interleaved_times([
            lambda: engine.generate(prompts.tolist(), params),
            lambda: hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                eos_token_id=None, pad_token_id=0)], repeats)
    tokens = batch * new_tokens
    return [row(case=f"{name} b={batch} T={new_tokens}", metric="tokens/s", ours=tokens / min(ours),
                baseline=tokens / min(theirs), baseline_name=baseline_name, higher_is_better=True)]
