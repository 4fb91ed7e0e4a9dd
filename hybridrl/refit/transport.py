"""In-process transport and the trainer-facing ``refit_from_model`` helper.

In process, the trainer's tensors are handed straight to the engine's loaders: the only
copy is the write into the engine (``copy_`` or quantize-into). Tensors are grouped into
logical buckets of ``bucket_bytes`` only to bound how much one validation covers; no
packing buffer is needed, so the extra memory is at most the float32 stripe a loader
uses while quantizing (see ``hybridrl.quant.fp8``).
"""
from __future__ import annotations


import torch

from hybridrl.refit.bucket import DEFAULT_BUCKET_BYTES, group_by_bytes
from hybridrl.refit.session import Refit, RefitStats


def named_persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (``state_dict`` minus parameters): weights that are not
    trained but define the model, e.g. DeepSeek-V3's ``mlp.gate.e_score_correction_bias``
    (rotary tables and other non-persistent buffers are not among them)."""
    out = []
    for module_name, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in skip:
                out.append((f"{module_name}.{name}" if module_name else name, b.detach()))
    return out


def named_trainer_tensors(model_or_named) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs from an HF model (its ``named_parameters``, tied ones
    once, then its persistent buffers) or from an iterable of pairs (returned as a list)."""
    if isinstance(model_or_named, torch.nn.Module):
        return ([(n, p.detach()) for n, p in model_or_named.named_parameters()]
                + named_persistent_buffers(model_or_named))
    return [(n, t) for n, t in model_or_named]


def refit_from_model(engine, model_or_named, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     verify: bool = False, partial: bool = False, version: int | None = None) -> RefitStats:
    """Refit ``engine`` in place from an HF model or ``(hf_name, tensor)`` pairs.

    Announces the full name set first (a partial or unknown layout is rejected with the
    engine unchanged), then loads bucket by bucket and finishes. Returns bytes moved,
    seconds and the new ``engine.weight_version``. ``partial``: the pairs are a subset of the
    engine's names (a LoRA refit, ``Refit.begin``); the others keep their values.
    ``version``: the weight version this refit publishes (None: the engine's + 1).
    """
    named = named_trainer_tensors(model_or_named)
    refit = Refit(engine, verify=verify, version=version).begin([n for n, _ in named], partial=partial)
    try:
        for group in group_by_bytes(named, bucket_bytes):
            refit.load(group)
    except BaseException:
        refit.abort()
        raise
    return refit.finish()
