"""Peak extra memory and time of the npu_fusion_attention B1SS mask: ours vs the naive
builder (float32 ``ones`` -> tril -> bool -> & -> ~) and the same with ``dtype=bool``.

    python benchmarks/masks.py [--quick] [--json PATH]

Memory is measured, not computed: Linux peak RSS (VmHWM) reset via /proc/self/clear_refs
before each build, with big blocks mmap'd so frees return to the OS. Printed as
peak / output bytes (goal <= 1.05 at S >= 4096).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from hybridrl.attention.masks import npu_fusion_attention_mask


def naive(pm, dtype=None):
    s = pm.shape[1]
    kw = {} if dtype is None else {"dtype": dtype}
    causal = torch.tril(torch.ones(s, s, device=pm.device, **kw)).to(torch.bool)
    attn = pm.bool().unsqueeze(-1) & pm.bool().unsqueeze(-2)
    return (~(attn & causal)).unsqueeze(1).contiguous()


def naive_bool(pm):
    return naive(pm, torch.bool)


def _status(key):
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def measure(build, pm):
    """(peak extra bytes / output bytes, best seconds of 2)."""
    open("/proc/self/clear_refs", "w").write("5")
    start = _status("VmRSS")
    out = build(pm)
    ratio = (_status("VmHWM") - start) / (out.numel() * out.element_size())
    del out
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        build(pm)
        best = min(best, time.perf_counter() - t0)
    return ratio, best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    sizes = [(1, 2048), (4, 4096)] if args.quick else [(b, s) for s in (2048, 4096, 8192, 16384) for b in (1, 4, 8)]
    warm = torch.ones(2, 512, dtype=torch.long)
    npu_fusion_attention_mask(warm), naive(warm), naive_bool(warm)  # page in kernels before measuring
    rows = []
    for batch, seq in sizes:
        if batch * seq * seq > 8 * 8192 * 8192:  # naive float32 would need > 2 GiB extra here: skip
            continue
        pm = torch.ones(batch, seq, dtype=torch.long)
        pm[:, : seq // 8] = 0  # left padding
        ours = measure(npu_fusion_attention_mask, pm)
        for name, fn in (("naive float32 ones", naive), ("naive bool ones", naive_bool)):
            base = measure(fn, pm)
            case = f"B={batch} S={seq}"
            rows.append(dict(case=case, metric="peak/output", ours=ours[0], baseline=base[0], baseline_name=name, higher_is_better=False))
            rows.append(dict(case=case, metric="seconds", ours=ours[1], baseline=base[1], baseline_name=name, higher_is_better=False))
    report(rows, args.json)  # table with speedups (> 1 = ours better) and the JSON rows


if __name__ == "__main__":
    main()
