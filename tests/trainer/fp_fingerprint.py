"""A fingerprint of this machine's floating-point environment, for the golden runs.

Bitwise golden runs hold only where every kernel rounds the same way as on the machine
that recorded them. Which kernels a run gets is not named by one value: torch's CPU
capability (``AVX2``, ``AVX512``) picks ATen's vectorized kernels, but the BLAS and
oneDNN libraries dispatch on their own (by ISA and by vendor), and two machines that
both report ``AVX512`` were seen to produce different golden runs from step 2 on.

So the fingerprint *computes*: a tiny Qwen2 from ``transformers`` with weights drawn
from Python's own RNG (identical everywhere), forward and backward on fixed ids, one
fused AdamW step, SDPA, softmax / log-softmax / cumsum, in float32 on one thread, and
hashes every output bit. It uses only torch and transformers, never hybridrl, so a
change to hybridrl cannot change it: two machines with the same fingerprint run the
same kernels on these ops, and a golden mismatch there is the change's doing.
"""

from __future__ import annotations

import hashlib
import random

import torch


def _fill_(module: torch.nn.Module, seed: int) -> None:
    rng = random.Random(seed)
    with torch.no_grad():
        for p in module.parameters():
            values = [rng.gauss(0.0, 0.05) for _ in range(p.numel())]
            p.copy_(torch.tensor(values, dtype=torch.float64).view_as(p).to(p.dtype))


def fingerprint() -> str:
    """16 hex digits; the same on machines whose kernels round these ops alike."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = Qwen2Config(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64,
                             tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
        model.config._attn_implementation = "sdpa"
        _fill_(model, seed=1234)
        rng = random.Random(99)
        ids = torch.tensor([[rng.randrange(40) for _ in range(24)] for _ in range(6)])
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # a padded row: the masked SDPA path
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        opt.step()
        logits = out.logits.detach()
        probs = torch.softmax(logits.double(), -1)
        pieces = [out.loss.detach(), logits, torch.log_softmax(logits, -1), probs.cumsum(-1),
                  torch.logsumexp(logits, -1), *grads, *(p.detach() for p in model.parameters())]
        digest = hashlib.sha256()
        for t in pieces:
            digest.update(t.contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    print(torch.backends.cpu.get_cpu_capability(), fingerprint())
