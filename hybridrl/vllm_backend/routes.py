"""The vLLM engine's route table: every Hugging Face weight name -> where vLLM holds it.

It has the interface ``hybridrl.refit`` uses on the built-in engine's ``weight_routes``
(``expected``, ``ignored``, ``[name].shape``, ``[name].expected_held(t)``,
``[name].held()``), so ``Refit`` validates and verifies a vLLM refit unchanged.

- **Names and shapes** come from the Hugging Face model class for the config, built on the
  meta device (no memory): exactly the ``named_parameters()`` a trainer of that config
  sends. With tied embeddings ``lm_head.weight`` is ignored (accepted and skipped).
- **Where vLLM holds each name**: vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
  ``gate_up_proj`` (its ``packed_modules_mapping``); a shard is a row range of the fused
  layer (``output_sizes``). The vocabulary may be padded (rows ``[:vocab_size]``).
- **What it holds** (``held()``): on CPU, vLLM keeps a linear layer's weights only inside a
  packed GEMM handle (oneDNN / sgl kernels) and leaves ``layer.weight`` empty. The value is
  read back through the layer's own matmul with an identity input, ``apply(I_K)ᵀ``: each
  output is one weight times 1 plus zeros, so the read-back is exact (tested), and it reads
  the buffer the rollouts are computed with. Cost: a K-token forward per layer, paid only
  by ``verify=True``. Other weights (embedding, norms, biases) are read from their
  parameters.
- **Tensor parallel** (vLLM's ``external_launcher``, one shard per rank): vLLM's loaders
  take the whole HF tensor and keep their partition; a route records that partition as a
  :class:`TPSlice` (``tp``: q heads and their KV head, replicated when fewer than ranks, as
  ``num_kv_head_replicas`` says; column / row shares; the vocabulary range of
  ``shard_indices``) and ``rows`` as the local rows, so ``held()`` is this rank's part and
  ``expected_held(t)`` slices the sent tensor the same way. ``held_shape``: that part's shape.
- **FP8 layers** (``quantization="fp8"``, fp8.py): ``held()`` is the float32 dequantization of
  the live e4m3 weight and its per-row scales, ``expected_held(t)`` vLLM's quantization of
  ``t`` dequantized the same way: exact, like the built-in engine's FP8 routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from hybridrl.rollout.layers.tensor_parallel import TPSlice, take_local
from hybridrl.vllm_backend.fp8 import expected_dequantized, held_dequantized, is_fp8_linear

TIED_HEAD = "lm_head.weight"
READBACK_ROWS = 1024  # identity rows per matmul when reading a packed weight back


@dataclass(frozen=True)
class VllmWeightRoute:
    hf_name: str
    shape: torch.Size
    """HF shape (before fusion): what the trainer sends."""
    dtype: torch.dtype
    """engine dtype."""
    module_name: str
    """vLLM module holding it."""
    leaf: str
    """"weight" or "bias"."""
    rows: slice
    """rows of the vLLM tensor (fused shard / unpadded vocabulary)."""
    packed: bool
    """True when the value lives in the layer's packed GEMM (read back through ``apply``)."""
    fp8: torch.dtype | None = None
    """the e4m3 dtype when vLLM quantized this weight online to FP8 (per output row)."""
    table: Any = None
    tp: TPSlice | None = None
    """the part of the HF tensor this rank's vLLM shard holds (tensor parallel); None: all."""

    @property
    def held_shape(self) -> torch.Size:
        """The shape of what this rank holds (== ``shape`` without tensor parallelism)."""
        return self.shape if self.tp is None else self.tp.local_shape(self.shape)

    def expected_held(self, tensor: torch.Tensor) -> torch.Tensor:
        """What ``held()`` returns once this tensor was loaded: the cast to the engine dtype,
        or (FP8) its per-row quantization, dequantized to float32 (this rank's part)."""
        tensor = take_local(tensor, self.shape, self.tp)
        if self.fp8 is not None:
            return expected_dequantized(tensor, self.dtype, self.fp8)
        return tensor.detach().to(self.dtype)

    def held(self) -> torch.Tensor:
        """What vLLM holds for this name now (read back from the tensor its kernels use)."""
        return self.table.held(self)


class VllmWeightRoutes:
    """HF name -> :class:`VllmWeightRoute` for every weight a complete update writes once."""

    def __init__(self, hf_config, vllm_model: nn.Module, dtype: torch.dtype):
        self.model, self.dtype = vllm_model, dtype
        hf_shapes = hf_parameter_shapes(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and TIED_HEAD not in hf_shapes
        self.ignored: frozenset[str] = frozenset({TIED_HEAD} if tied else ())
        self.tied = tied
        packed = getattr(vllm_model, "packed_modules_mapping", None) or {}
        part_to_fused = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
        self._routes: dict[str, VllmWeightRoute] = {}
        for name, shape in hf_shapes.items():
            self._routes[name] = self._resolve(name, torch.Size(shape), part_to_fused)
        self.expected: frozenset[str] = frozenset(self._routes)
        self._readback: dict[str, torch.Tensor] = {}
        self.hf_shapes, self.part_to_fused = hf_shapes, part_to_fused

    def add(self, routes) -> None:
        """More routes (LoRA adapter mode: ``X.lora_A.weight`` / ``X.lora_B.weight``, lora.py)."""
        for route in routes:
            self._routes[route.hf_name] = route
        self.expected = frozenset(self._routes)

    def _resolve(self, name: str, shape: torch.Size, part_to_fused) -> VllmWeightRoute:
        module_path, leaf = name.rsplit(".", 1)
        parent, _, last = module_path.rpartition(".")
        rows, index = slice(0, shape[0]), None
        if last in part_to_fused:
            fused, index = part_to_fused[last]
            module_path = f"{parent}.{fused}" if parent else fused
            module = self._module(module_path, name)
            sizes = list(getattr(module, "output_sizes", ()))
            if len(sizes) <= index:
                raise ValueError(f"VllmEngine: vLLM's {module_path} has no shard {index} for {name!r} "
                                 f"(output_sizes {sizes}); this model family is not supported by the vLLM backend")
            start = sum(sizes[:index])
            rows = slice(start, start + sizes[index])
        else:
            module = self._module(module_path, name)
        if hasattr(module, "lora_a_stacked"):  # enable_lora: vLLM wraps the layer; its weights are the base's
            module_path, module = f"{module_path}.base_layer", module.base_layer
        tp = None
        if getattr(module, "tp_size", 1) > 1:
            rows, tp = _partition(module, leaf, shape, index)
        held = shape if tp is None else tp.local_shape(shape)
        if rows.stop - rows.start != held[0]:
            raise ValueError(f"VllmEngine: {name!r} has {held[0]} rows in the HF model (this rank's part) but "
                             f"{rows.stop - rows.start} in vLLM's {module_path}; the configs disagree")
        packed = leaf == "weight" and is_packed_gemm(module)
        fp8 = module.weight.dtype if packed and is_fp8_linear(module) else None
        return VllmWeightRoute(name, shape, self.dtype, module_path, leaf, rows, packed=packed, fp8=fp8, table=self,
                               tp=tp)

    def _module(self, path: str, name: str) -> nn.Module:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"VllmEngine: HF weight {name!r} has no module {path!r} in vLLM's "
                             f"{type(self.model).__name__}; this model family is not supported by the "
                             "vLLM backend") from None

    # -- the table interface used by hybridrl.refit ------------------------------------
    def __getitem__(self, hf_name: str) -> VllmWeightRoute:
        route = self._routes.get(hf_name)
        if route is None:
            raise ValueError(f"weight {hf_name!r} has no slot in the vLLM rollout model; check that the "
                             "checkpoint's architecture matches the engine config")
        return route

    def __contains__(self, hf_name: object) -> bool:
        return hf_name in self._routes

    def __iter__(self) -> Iterator[VllmWeightRoute]:
        return iter(self._routes.values())

    def __len__(self) -> int:
        return len(self._routes)

    # -- reading back ------------------------------------------------------------------
    def held(self, route: VllmWeightRoute) -> torch.Tensor:
        module = self.model.get_submodule(route.module_name)
        if route.packed:
            if route.module_name not in self._readback:
                self._readback[route.module_name] = (
                    held_dequantized(module, module.output_size_per_partition, route.held_shape[1])
                    if route.fp8 is not None else read_packed_weight(module, route.held_shape[1], self.dtype))
            full = self._readback[route.module_name]
        else:
            full = getattr(module, route.leaf).data
        return full[route.rows] if route.fp8 is not None else full[route.rows].to(self.dtype)

    def clear_readback(self) -> None:
        """Forget read-back weights (called at every update boundary)."""
        self._readback.clear()

    def packed_modules(self) -> dict[str, list[VllmWeightRoute]]:
        """vLLM module name -> its packed weight routes, in row order."""
        groups: dict[str, list[VllmWeightRoute]] = {}
        for r in self._routes.values():
            if r.packed:
                groups.setdefault(r.module_name, []).append(r)
        return {m: sorted(rs, key=lambda r: r.rows.start) for m, rs in groups.items()}


def _partition(module: nn.Module, leaf: str, shape: torch.Size, index: int | None) -> tuple[slice, TPSlice | None]:
    """(local rows, the HF tensor's part) that vLLM's tensor-parallel ``module`` keeps on this
    rank, read off the layer's own partition attributes (``index``: the fused shard)."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    r, T = module.tp_rank, module.tp_size
    if isinstance(module, VocabParallelEmbedding):  # ParallelLMHead too
        si = module.shard_indices
        n = si.org_vocab_end_index - si.org_vocab_start_index
        return slice(0, n), TPSlice(0, ((si.org_vocab_start_index, n),))
    if isinstance(module, RowParallelLinear):
        k = module.input_size_per_partition
        return slice(0, shape[0]), (TPSlice(1, ((r * k, k),)) if leaf == "weight" else None)
    if isinstance(module, QKVParallelLinear):
        D = module.head_size
        q, kv = module.num_heads * D, module.num_kv_heads * D
        local = [q, kv, kv]
        first = [r * q, (r // module.num_kv_head_replicas) * kv, (r // module.num_kv_head_replicas) * kv]
        start = sum(local[:index])
        return slice(start, start + local[index]), TPSlice(0, ((first[index], local[index]),))
    if isinstance(module, MergedColumnParallelLinear):
        local = [n // T for n in module.output_sizes]
        start = sum(local[:index])
        return slice(start, start + local[index]), TPSlice(0, ((r * local[index], local[index]),))
    if isinstance(module, ColumnParallelLinear):
        n = module.output_size_per_partition
        return slice(0, n), TPSlice(0, ((r * n, n),))
    return slice(0, shape[0]), None  # replicated (norms, routers)


def is_packed_gemm(module: nn.Module) -> bool:
    """A layer whose matmul goes through its ``quant_method.apply`` (vLLM linear layers and
    the LM head), i.e. whose weights may live only in a packed kernel buffer."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, (LinearBase, ParallelLMHead)) and hasattr(module, "quant_method")


@torch.inference_mode()
def read_packed_weight(module: nn.Module, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``[out, in]`` weight of a vLLM layer, read through its own matmul: ``apply(I)ᵀ``."""
    cols = []
    for s in range(0, in_features, READBACK_ROWS):
        n = min(READBACK_ROWS, in_features - s)
        eye = torch.zeros(n, in_features, dtype=dtype)
        eye[torch.arange(n), torch.arange(s, s + n)] = 1
        cols.append(module.quant_method.apply(module, eye, None))
    return torch.cat(cols).t().contiguous()


def hf_parameter_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """``named_parameters()`` and persistent buffers of the HF causal-LM class for
    ``hf_config``, built on the meta device: the names and shapes a trainer of that config
    sends (tied ones once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    from hybridrl.refit.transport import named_persistent_buffers

    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes.update((name, tuple(b.shape)) for name, b in named_persistent_buffers(model))  # refit sends them too
    return shapes
