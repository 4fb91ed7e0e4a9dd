"""Trainer log-prob forward+backward: padded vs packed / token-budget micro-batches, and
peak memory of log-prob+entropy with and without vocabulary chunking.

    python benchmarks/packing.py [--quick] [--json PATH]

Throughput: a small random-init Qwen2, prompt+response lengths uniform in [16, 512],
loss = sum of response log-probs + entropies, forward+backward. Baseline ("padded"):
fixed-count micro-batches in arrival order, padded to their longest row, HF's own mask.
Ours: ``compute_logprobs_entropy(options=ForwardOptions(packed=True))`` per attention backend.

Memory: N response tokens × V vocab, hidden 256, peak RSS above the start (Linux
VmHWM, reset via /proc/self/clear_refs) for chunked vs full-logits log-prob+entropy
(forward and backward).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from pathlib import Path
import re

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_interleaved, report  # noqa: E402
import transformers

from hybridrl.attention.packing import make_microbatches, padding_fraction
from hybridrl.trainer.forward import ForwardOptions, chunked_logprobs_entropy, compute_logprobs_entropy


def _rows(batch, seed=0, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 513, (batch,), generator=g)
    seq = int(lengths.max())
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    response = mask.float() * (torch.arange(seq)[None] >= (lengths[:, None] // 3)).float()
    return ids, mask, response, lengths


def _step(model, ids, mask, resp, **kw):
    lp, ent = compute_logprobs_entropy(model, ids, mask, resp, options=ForwardOptions(**kw))
    (lp.sum() + ent.sum()).backward()


def throughput(batch, repeats, budget):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    ids, mask, resp, lengths = _rows(batch)
    tokens = int(lengths.sum())
    per_mb = max(1, budget // ids.shape[1])  # baseline: same nominal budget, fixed count

    def padded():
        for s in range(0, batch, per_mb):
            sl = slice(s, s + per_mb)
            width = int(lengths[sl].max())  # padded to the micro-batch's longest row
            _step(model, ids[sl, :width], mask[sl, :width], resp[sl, :width], packed=False)

    mbs = make_microbatches(lengths, budget)
    print(f"padding fraction: fixed-count {padding_fraction(lengths, [list(range(s, min(s + per_mb, batch))) for s in range(0, batch, per_mb)]):.2f}, "
          f"token-budget {padding_fraction(lengths, mbs):.2f}")
    backends = ("bucketed", "varlen", "block_diagonal")
    fns = {"padded": padded}
    for backend in backends:
        fns[backend] = functools.partial(
            _step, model, ids, mask, resp, packed=True, attn_backend=backend, max_tokens_per_microbatch=budget
        )
    best = dict(zip(fns, best_interleaved(list(fns.values()), repeats)))
    rows = [
        dict(case=f"B={batch} {backend}", metric="fwd+bwd tokens/s", ours=tokens / best[backend],
             baseline=tokens / best["padded"], baseline_name="padded fixed-count", higher_is_better=True)
        for backend in backends
    ]
    return rows


def _peak_rss_kb(fn):
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: big blocks go back to the OS when freed
    status = lambda key: int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1))
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to current RSS
    start = status("VmRSS")
    fn()
    return status("VmHWM") - start


def memory(n_tokens, vocab, hidden=256):
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(n_tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (n_tokens,))

    def full():
        logq = torch.log_softmax(head(h).float(), dim=-1)
        lp = logq.gather(1, targets[:, None]).squeeze(1)
        ent = -(logq.exp() * logq).sum(-1)
        (lp.sum() + ent.sum()).backward()

    def chunked():
        lp, ent = chunked_logprobs_entropy(h, head, targets, chunk_tokens=1024)
        (lp.sum() + ent.sum()).backward()

    full()
    chunked()  # warm-up: allocate grads once
    base, ours = _peak_rss_kb(full), _peak_rss_kb(chunked)
    return [dict(case=f"{n_tokens} tok x {vocab} vocab", metric="peak extra MiB (fwd+bwd)", ours=ours / 1024,
                 baseline=base / 1024, baseline_name="full float32 logits", higher_is_better=False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = throughput(batch=32, repeats=1 if args.quick else 3, budget=4096)
    rows += memory(n_tokens=2048 if args.quick else 8192, vocab=32768)
    report(rows, args.json)  # table with speedups (> 1 = ours better) and the JSON rows


if __name__ == "__main__":
    main()
