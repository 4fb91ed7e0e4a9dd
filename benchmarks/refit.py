"""Refit throughput vs the memcpy ceiling and vs the naive load_state_dict, same run.

For each config and engine precision: GB/s of trainer weights moved by
``refit_from_model`` (in process, bucketed, verify off) against (a) the memcpy ceiling:
a plain ``copy_`` of the same tensors into preallocated storage of the same dtype, and
(b) the naive approach: ``load_state_dict`` into an unfused transformers model. Also the
peak extra memory of the refit against its bound (one bucket + the largest tensor), and
for the FP8 engines the bytes their linear layers hold against a bf16 engine's: where
``_scaled_mm`` cannot serve a layer (always for ``fp8_block``, CUDA included; on CPU also
per-channel ``fp8``) the layer keeps a bf16 dequantized cache next to its fp8 weight, 1.5x
the bf16 bytes.

    python benchmarks/refit.py --quick --json bench_out/refit.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_interleaved, report  # noqa: E402

from hybridrl.refit import refit_from_model
from hybridrl.refit.memory import peak_extra_bytes
from hybridrl.rollout import RolloutEngine
from hybridrl.rollout.layers.linear import LinearBase

CONFIGS = {
    "small": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=1408, tie_word_embeddings=False),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
}
CASES = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("fp8", torch.bfloat16, "fp8"),
         ("fp8_block", torch.bfloat16, "fp8_block")]
BUCKET = 64 << 20


def run_case(cfg_name: str, hf, precision: str, dtype, quant, repeats: int) -> list[dict]:
    named = [(n, p.detach().to(dtype)) for n, p in hf.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    largest = max(t.numel() * t.element_size() for _, t in named)
    eng = RolloutEngine(hf.config, max_batch_size=1, max_seq_len=16, dtype=dtype, quantization=quant)
    refit_from_model(eng, named)
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for d, (_, t) in zip(dst, named):
            d.copy_(t)

    ref_model = Qwen2ForCausalLM(hf.config).to(dtype).eval()  # separate storage from `named`
    sd = {n: t for n, t in named}

    def naive():
        ref_model.load_state_dict(sd, strict=False)

    t_refit, t_copy, t_naive = best_interleaved(
        [lambda: refit_from_model(eng, named, bucket_bytes=BUCKET), memcpy, naive], repeats)
    peak, _ = peak_extra_bytes(lambda: refit_from_model(eng, named, bucket_bytes=BUCKET))
    case = f"{cfg_name}/{precision}"
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    rows = []
    if quant is not None:
        bf16 = RolloutEngine(hf.config, max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16)
        rows.append(dict(case=case, metric="linear weight MiB", ours=linear_bytes(eng) / 2**20,
                         baseline=linear_bytes(bf16) / 2**20, higher_is_better=False,
                         baseline_name="bf16 engine (with a bf16 dequant cache fp8 holds 1.5x)"))
    return rows + [
        dict(case=case, metric="refit GB/s", ours=gbps(t_refit), baseline=gbps(t_copy),
             baseline_name="memcpy copy_", higher_is_better=True),
        dict(case=case, metric="refit GB/s", ours=gbps(t_refit), baseline=gbps(t_naive),
             baseline_name="HF load_state_dict (unfused)", higher_is_better=True),
        dict(case=case, metric="peak extra MiB", ours=peak / 2**20, baseline=(BUCKET + largest) / 2**20,
             baseline_name="bound: bucket + largest tensor", higher_is_better=False),
    ]


def linear_bytes(engine: RolloutEngine) -> int:
    """Bytes every linear layer of ``engine`` holds: weight, scales, dequantized cache, bias."""
    total = 0
    for module in engine.model.modules():
        if isinstance(module, LinearBase):
            tensors = {t.data_ptr(): t for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small config only, fewer repeats (< 1 min)")
    ap.add_argument("--json", help="write the rows to this path")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for cfg_name, kw in CONFIGS.items():
        if args.quick and cfg_name != "small":
            continue
        hf = Qwen2ForCausalLM(Qwen2Config(**kw, max_position_embeddings=64)).eval()
        for precision, dtype, quant in CASES:
            rows += run_case(cfg_name, hf, precision, dtype, quant, 3 if args.quick else 7)
    report(rows, args.json)  # table with ratios (> 1 = ours better) and the JSON rows

if __name__ == "__main__":
    main()
