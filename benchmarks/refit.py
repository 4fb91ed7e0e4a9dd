"""Refit throughput vs the memcpy ceiling, the naive load_state_dict and vLLM's reload, same run.

For each config and engine precision: GB/s of trainer weights moved by
``refit_from_model`` (in process, bucketed, verify off) against (a) the memcpy ceiling:
a plain ``copy_`` of the same tensors into preallocated storage of the same dtype, and
(b) the naive approach: ``load_state_dict`` into a transformers model. Also the peak extra
memory of the refit against its bound (one bucket + the largest tensor sent), and for the
FP8 engines the bytes their linear layers hold against a bf16 engine's: where
``_scaled_mm`` cannot serve a layer (always for ``fp8_block``, CUDA included; on CPU also
per-channel ``fp8``) the layer keeps a bf16 dequantized cache next to its fp8 weight, 1.5x
the bf16 bytes.

Configs: the small (56M) Qwen2 and, without ``--quick``, a Qwen2-0.5B-shaped one, as fp32 /
bf16 / fp8 / fp8_block engines; a small Qwen3-MoE (8 experts, top-2, hidden 256, 4 layers;
issue #16; without ``--quick`` also a 100M-expert one) as fp32 / bf16 / fp8 / mxfp4 /
fp8+mxfp4 engines (``rollout.quantization``; quantized engines hold bf16), whose peak
memory is measured three ways: in process, through the bucket packer that cross-process
transports use, and packed with per-expert names (an expert stack counts as one tensor
only where it is sent as one: the bound then has one expert's matrix as the largest).

vLLM (issue #14, optional: skipped with one line if ``import vllm`` fails): our fp32 refit
against (a) vLLM's reload as a vLLM user runs it, ``llm.collective_rpc("reload_weights",
kwargs={"weights_iterator": ...})`` with the trainer's named tensors on the in-process
engine and nothing else (goal: >= 5x faster); (b) that reload plus our tied-head repack,
timed apart and added (what ``VllmEngine``'s reload adds: on CPU vLLM's reload leaves a tied
LM head's packed GEMM stale; a no-op for untied models); (c) a whole ``VllmEngine`` refit
(staging, reload, repack, its post-reload check). Every side gets one untimed warm-up call;
the timed repeats exclude it (best of them).

LoRA (issue #27, ``_lora_refit.py``): on a Qwen2.5-0.5B-shaped bf16 model with rank-16
adapters on q/k/v/o/gate/up/down, the adapter-mode and merged-mode refits against the full
refit (built-in engine), and vLLM's adapter-mode refit (a new LoRARequest id) against its
full reload. Goals: adapter payload <= 2% and time <= 0.1x of the full refit.

    python benchmarks/refit.py [--quick] [--json PATH] [--threads N]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lora_refit import lora_refit_rows  # noqa: E402
from _common import (SMALL, best_interleaved, format_table, goal_line, interleaved_times, moe_model,  # noqa: E402
                     parse_args, report, row, speedup, start_vllm, vllm_unavailable, vllm_version)

from hybridrl.refit import BucketPacker, Refit, refit_from_model  # noqa: E402
from hybridrl.refit.memory import peak_extra_bytes  # noqa: E402
from hybridrl.rollout import EngineSpec, RolloutEngine  # noqa: E402
from hybridrl.rollout.layers.linear import LinearBase  # noqa: E402

CONFIGS = {
    "small": SMALL,
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
}
MOE_CONFIGS = {
    "moe": {},  # _common.MOE as is
    "moe-large": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      moe_intermediate_size=512, vocab_size=8192),
}
CASES = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("fp8", torch.bfloat16, "fp8"),
         ("fp8_block", torch.bfloat16, "fp8_block")]
MOE_CASES = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("fp8", torch.bfloat16, "fp8"),
             ("mxfp4", torch.bfloat16, "mxfp4"), ("fp8+mxfp4", torch.bfloat16, "fp8+mxfp4")]
BUCKET = 64 << 20
MOE_BUCKET = 4 << 20  # well under the MoE models (30 / 480 MB fp32), so the bound means something
BOUND = "bound: bucket + largest tensor"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def run_case(cfg_name: str, hf, precision: str, dtype, quant, repeats: int, bucket: int = BUCKET) -> list[dict]:
    named = [(n, p.detach().to(dtype)) for n, p in hf.named_parameters()]
    nbytes = sum(_nbytes(t) for _, t in named)
    eng = RolloutEngine(hf.config, EngineSpec(max_batch_size=1, max_seq_len=16, dtype=dtype, quantization=quant))
    refit_from_model(eng, named)
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for d, (_, t) in zip(dst, named):
            d.copy_(t)

    ref_model = type(hf)(hf.config).to(dtype).eval()  # separate storage from `named`
    sd = {n: t for n, t in named}

    def naive():
        ref_model.load_state_dict(sd, strict=False)

    t_refit, t_copy, t_naive = best_interleaved(
        [lambda: refit_from_model(eng, named, bucket_bytes=bucket), memcpy, naive], repeats)
    case = f"{cfg_name}/{precision}"
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    rows = []
    if quant is not None and "fp8" in quant and not hasattr(hf.config, "num_experts"):
        bf16 = RolloutEngine(hf.config, EngineSpec(max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16))
        rows.append(row(case=case, metric="linear weight MiB", ours=linear_bytes(eng) / 2**20,
                        baseline=linear_bytes(bf16) / 2**20, higher_is_better=False,
                        baseline_name="bf16 engine (with a bf16 dequant cache fp8 holds 1.5x)"))
    fused = "unfused" if not hasattr(hf.config, "num_experts") else "experts fused as ours"
    rows += [
        row(case=case, metric="refit GB/s", ours=gbps(t_refit), baseline=gbps(t_copy),
            baseline_name="memcpy copy_", higher_is_better=True),
        row(case=case, metric="refit GB/s", ours=gbps(t_refit), baseline=gbps(t_naive),
            baseline_name=f"HF load_state_dict ({fused})", higher_is_better=True),
        _peak_row(case, eng, named, bucket, packed=False),
    ]
    if hasattr(hf.config, "num_experts"):
        rows += [_peak_row(f"{case} packed", eng, named, bucket, packed=True),
                 _peak_row(f"{case} packed per-expert", eng, per_expert_names(named), bucket, packed=True)]
    return rows


def _peak_row(case: str, eng, named, bucket: int, *, packed: bool) -> dict:
    """Peak extra memory of one refit vs one bucket + the largest tensor sent. ``packed``:
    through ``BucketPacker`` (the copy into one reusable bucket that cross-process transports
    make), else in process (the trainer's own tensors, no copy)."""
    def refit():
        if not packed:
            return refit_from_model(eng, named, bucket_bytes=bucket)
        session = Refit(eng).begin([n for n, _ in named])
        for group in BucketPacker(bucket).pack(named):
            session.load(group)
        return session.finish()

    peak, _ = peak_extra_bytes(refit)
    largest = max(_nbytes(t) for _, t in named)
    return row(case=case, metric="peak extra MiB", ours=peak / 2**20, baseline=(bucket + largest) / 2**20,
               baseline_name=BOUND, higher_is_better=False)


def per_expert_names(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Fused expert stacks split into the per-expert names a safetensors checkpoint holds
    (views, no copy): ``experts.gate_up_proj [E, 2I, H]`` -> ``experts.{e}.gate_proj.weight``
    (rows [0, I)) and ``up_proj`` (rows [I, 2I)); ``experts.down_proj [E, H, I]`` -> ``{e}.down_proj``."""
    out = []
    for name, t in named:
        prefix, _, proj = name.rpartition(".")
        if not prefix.endswith(".experts"):
            out.append((name, t))
        elif proj == "gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{prefix}.{e}.gate_proj.weight", t[e, :inter]),
                        (f"{prefix}.{e}.up_proj.weight", t[e, inter:])]
        else:
            assert proj == "down_proj", name
            out += [(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return out


def linear_bytes(engine: RolloutEngine) -> int:
    """Bytes every linear layer of ``engine`` holds: weight, scales, dequantized cache, bias."""
    total = 0
    for module in engine.model.modules():
        if isinstance(module, LinearBase):
            tensors = {t.data_ptr(): t for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
            total += sum(_nbytes(t) for t in tensors.values())
    return total


def vllm_reload_name() -> str:
    return f"vllm reload_weights (vLLM {vllm_version()}, llm.collective_rpc, in-process)"


def vllm_rows(cfg_name: str, hf, repeats: int) -> list[dict]:
    """fp32 refit GB/s, ours vs vLLM's bare ``reload_weights`` (as a vLLM user calls it), vs
    that plus our tied-head repack, and vs a whole ``VllmEngine`` refit; same weights,
    interleaved, one untimed warm-up call each, best of ``repeats``."""
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    nbytes = sum(_nbytes(t) for _, t in named)
    ours = RolloutEngine(hf.config, EngineSpec(max_batch_size=1, max_seq_len=16))
    refit_from_model(ours, named)
    theirs = start_vllm(hf, max_batch_size=1, max_seq_len=16)
    llm = theirs.llm  # the engine's vllm.LLM: the bare reload goes to it directly, as a user's would

    def vllm_reload():
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})

    def tied_head_repack():  # our backend's work after vLLM's reload (vllm_backend/reload_check.refresh_tied_head)
        from hybridrl.vllm_backend.reload_check import refresh_tied_head

        with torch.no_grad():
            refresh_tied_head(theirs.model, theirs.weight_routes)

    try:
        t_ours, t_reload, t_repack, t_engine = (min(t) for t in interleaved_times(
            [lambda: refit_from_model(ours, named, bucket_bytes=BUCKET), vllm_reload, tied_head_repack,
             lambda: refit_from_model(theirs, named, bucket_bytes=BUCKET)], repeats))
    finally:
        theirs.close()
    case, gbps = f"{cfg_name}/fp32", lambda t: nbytes / t / 1e9  # noqa: E731
    return [row(case=case, metric="refit GB/s", ours=gbps(t_ours), baseline=gbps(t_reload),
                baseline_name=vllm_reload_name(), higher_is_better=True),
            row(case=case, metric="refit GB/s", ours=gbps(t_ours), baseline=gbps(t_reload + t_repack),
                baseline_name="vllm reload_weights + our tied-head repack (VllmEngine's reload)",
                higher_is_better=True),
            row(case=case, metric="refit GB/s", ours=gbps(t_ours), baseline=gbps(t_engine),
                baseline_name="vllm refit: stage + reload_weights + repack + its check", higher_is_better=True)]


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda ap: ap.add_argument(
        "--threads", type=int, default=0, help="intra-op threads for every side (0 = torch default)"))
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    no_vllm = vllm_unavailable()
    if no_vllm:
        print(f"refit.py: vLLM rows skipped: {no_vllm}")
    repeats = 3 if args.quick else 7
    rows = []
    for cfg_name, kw in CONFIGS.items():
        if args.quick and cfg_name != "small":
            continue
        torch.manual_seed(0)
        hf = Qwen2ForCausalLM(Qwen2Config(**kw, max_position_embeddings=64)).eval()
        for precision, dtype, quant in CASES:
            rows += run_case(cfg_name, hf, precision, dtype, quant, repeats)
        if not no_vllm:
            rows += vllm_rows(cfg_name, hf, repeats)
        print(format_table(rows), flush=True)
    for cfg_name, kw in MOE_CONFIGS.items():
        if args.quick and cfg_name != "moe":
            continue
        hf = moe_model(**kw)
        for precision, dtype, quant in MOE_CASES:
            rows += run_case(cfg_name, hf, precision, dtype, quant, repeats, bucket=MOE_BUCKET)
    rows += lora_refit_rows(repeats, vllm=not no_vllm)  # issue #27 (_lora_refit.py)
    print(f"\nthreads={torch.get_num_threads()}, {time.perf_counter() - t0:.0f} s")
    report(rows, args.json)  # table with ratios (> 1 = ours better) and the JSON rows
    print_goals(rows)


def print_goals(rows: list[dict]) -> None:
    for r in rows:
        if "collective_rpc" in r["baseline_name"]:  # the bare reload (vllm_reload_name)
            print(goal_line(f"refit vs vLLM reload_weights, {r['case']} (issue #14)", speedup(r), 5))
        if "adapter" in r["case"] and r["metric"] in ("refit payload MiB", "refit s"):
            what = "payload" if "payload" in r["metric"] else "time"
            goal = 50 if what == "payload" else 10
            print(goal_line(f"LoRA adapter refit {what} / full refit <= {1 / goal:g}, {r['case']} (issue #27)",
                            speedup(r), goal))
    peaks = [r for r in rows if r["metric"] == "peak extra MiB"]
    over = [r["case"] for r in peaks if r["ours"] > r["baseline"]]
    print(f"goal peak extra memory <= {BOUND}: {len(peaks) - len(over)} of {len(peaks)} cases met"
          + (f"; NOT met: {', '.join(over)}" if over else ""))


if __name__ == "__main__":
    main()
