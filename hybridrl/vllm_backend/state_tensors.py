"""Tensors a vLLM model holds outside its parameters and buffers (for refit's address check).

vLLM's reload copies into every parameter and buffer in place
(``_copy_and_restore_kernel_tensors``, model_loader/reload/layerwise.py). A quantization method
or GEMM kernel may also keep tensors as plain attributes — of the layer, of its
``quant_method``, or of the kernel object the method holds (e.g. ``fp8_linear``) — which that
copy does not cover: a reload that re-created one would leave a captured CUDA graph reading
freed memory. They are listed here so the address check sees them move.

Host (CPU) tensors are left out unless asked for: a CUDA graph does not read host memory, and
vLLM re-creates some on every reload by design (an attention layer's ``_k_scale_cpu`` /
``_v_scale_cpu``, host copies of its KV-cache scales, in ``Attention.process_weights_after_loading``).
On a CPU engine the list is therefore empty (it runs eager: nothing captured an address).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from hybridrl.vllm_backend.isolation import preserve_torch_state

MAX_DEPTH = 2  # layer -> quant_method -> kernel


def derived_tensor_attributes(model: nn.Module, *, include_host: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every device tensor held as an attribute of a module (not a
    parameter or buffer) or of an object it holds (its quantization method, that method's
    kernel); host tensors too with ``include_host``."""
    modules = dict(model.named_modules())
    seen = {id(m) for m in modules.values()} | {id(t) for t in (*model.parameters(), *model.buffers())}
    for module_name, module in modules.items():
        for name, t in _attributes(module, module_name, seen, depth=0):
            if include_host or t.device.type != "cpu":
                yield name, t


def _walk(obj, prefix: str, seen: set[int], depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    """An object held by a layer: its tensor attributes (and, for a module outside the model's
    tree, e.g. a kernel's quantization op, its parameters and buffers)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        for key, t in (*obj.named_parameters(), *obj.named_buffers()):
            if id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                yield f"attr:{prefix}.{key}", t
    yield from _attributes(obj, prefix, seen, depth)


def _attributes(obj, prefix: str, seen: set[int], depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in list(getattr(obj, "__dict__", {}).items()):
        if key in ("_parameters", "_buffers", "_modules"):
            continue
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, torch.Tensor):
            if id(value) not in seen and value.device.type != "meta":
                seen.add(id(value))
                yield f"attr:{name}", value
        elif depth < MAX_DEPTH and _is_holder(value):
            yield from _walk(value, name, seen, depth + 1)


def _is_holder(value) -> bool:
    """An object that may hold derived tensors: a vLLM method / kernel object (modules of the
    model are already in ``seen``), not a config, a type, or a container."""
    if isinstance(value, (type, str, bytes, int, float, bool, dict, list, tuple, set)):
        return False
    return hasattr(value, "__dict__") and type(value).__module__.startswith("vllm.")


def named_state_tensors(llm, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's parameters, buffers, tensors its layers and quantization methods hold as plain
    attributes, and KV-cache tensors (what refit's address check snapshots). vLLM's reload
    copies into the parameters and buffers in place (FP8 included); an attribute tensor a
    reload re-created would be caught here. The packed GEMM handles behind CPU linear layers
    (closures, not tensors) are rebuilt by every reload, but no captured graph reads them
    (CPU is eager)."""
    yield from model.named_parameters()
    yield from model.named_buffers()
    yield from derived_tensor_attributes(model)
    with preserve_torch_state():
        caches = llm.collective_rpc(lambda worker: list(worker.model_runner.kv_caches))[0]
    for i, t in enumerate(caches):
        yield f"kv_cache.{i}", t
