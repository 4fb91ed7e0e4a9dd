"""The built-in engine's static memory, counted before it allocates any: does it fit?

At build the engine reserves, for its whole life, its weights (with their derived caches)
and, for each of ``max_batch_size`` rows, ``max_seq_len`` slots of: the KV cache
(``kv_cache.py``; MLA's latent; DeepSeek-V4's state, ``v4_state.py``), the running batch's
per-slot outputs (``running_batch.py``) and, with routing replay, the MoE routing record
(``routing.py``). A long ``max_seq_len`` times a full batch used to end the process in the
kernel's OOM killer (exit 137, nothing on the console); ``check_fits`` compares the
footprint — from the shapes and a meta-device model, nothing allocated — with what the
process may still allocate, and refuses in one line (``EngineMemoryError``).

Available: on CUDA the device's free bytes plus what this process's caching allocator holds
unused; on CPU ``/proc/meminfo``'s MemAvailable, or the cgroup's headroom if smaller (its
limit minus its usage, reclaimable file cache counted free). Other devices are not checked.
Not counted: the positional tables (O(max_seq_len), not per row), the CUDA graphs' logits
buffer and memory pool, a step's activations, and the prefix cache (filled later, within
its own byte budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridrl.rollout.backend import EngineSpec
from hybridrl.rollout.derived import named_derived_caches
from hybridrl.rollout.core.kv_cache import cache_shapes, rank_kv_heads
from hybridrl.rollout.layers.tensor_parallel import TensorParallel
from hybridrl.rollout.model_config import ModelConfig
from hybridrl.rollout.routing import record_row_bytes
from hybridrl.rollout.core.running_batch import RunningBatch
from hybridrl.rollout.models.deepseek_v4.state import state_shapes

UNLIMITED = 1 << 60  # a cgroup v1 "no limit" reads as ~2**63 rounded to pages


def weight_bytes(engine_model: torch.nn.Module) -> int:
    """An engine model's weight bytes: its parameters (codes and scales of quantized layers;
    a tied head once; a vision-language model's vision tower, full precision) and its derived caches (dequantized FP8 / MXFP4 copies, MLA's absorbed
    matrices). Positional tables (rope) are not weights and not counted."""
    tensors = [*engine_model.parameters(), *(c.tensor for _, c in named_derived_caches(engine_model))]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class EngineMemory:
    """What an engine's static memory is made of, as a function of its capacity:
    ``weights + rows x (cache_row(seq_len) + buffers_row(seq_len))`` bytes."""

    config: ModelConfig
    dtype: torch.dtype
    weights: int
    kv_heads: int | None = None
    """the KV heads this rank's cache holds (None: all)."""
    routing_slot: int = 0
    """routing-record bytes per slot (0: no routing replay)."""

    @classmethod
    def of(cls, spec: EngineSpec, config: ModelConfig, meta_model: torch.nn.Module, *,
           tensor_parallel: TensorParallel, record_routing: bool = False) -> "EngineMemory":
        """``meta_model``: the engine's model built on the meta device (its weights, no memory)."""
        return cls(config=config, dtype=spec.dtype, weights=weight_bytes(meta_model),
                   kv_heads=rank_kv_heads(config, tensor_parallel),
                   routing_slot=record_row_bytes(meta_model, 1) if record_routing else 0)

    def cache_row(self, seq_len: int) -> int:
        """One row's KV cache (DeepSeek-V4: its state), every layer."""
        if self.config.v4 is not None:
            numel = sum(math.prod(s) for row in state_shapes(self.config.v4, seq_len) for s in row.values())
        else:
            numel = sum(math.prod(s) for s in cache_shapes(self.config, 1, seq_len, self.kv_heads))
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def buffers_row(self, seq_len: int) -> int:
        """One row's per-slot outputs and routing record."""
        return RunningBatch.row_bytes(seq_len) + seq_len * self.routing_slot

    def total(self, rows: int, seq_len: int) -> int:
        return self.weights + rows * (self.cache_row(seq_len) + self.buffers_row(seq_len))

    def rows_that_fit(self, budget: int, seq_len: int) -> int:
        """The most rows of ``seq_len`` whose total is within ``budget`` bytes (0: not one)."""
        return max(0, (budget - self.weights) // (self.cache_row(seq_len) + self.buffers_row(seq_len)))

    def seq_len_that_fits(self, budget: int, rows: int, upto: int) -> int:
        """The longest ``seq_len <= upto`` whose total for ``rows`` is within ``budget`` (0: none)."""
        lo, hi = 0, upto  # total(rows, lo) fits (or lo == 0); find the last that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.total(rows, mid) <= budget else (lo, mid - 1)
        return lo


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class EngineMemoryError(ValueError):
    """The engine's static memory is more than the process may allocate (raised before any of
    it is). ``rows_fit``: the most rows of this ``seq_len`` that fit; ``seq_len_fit``: the
    longest rows that fit at this batch (0: none)."""

    def __init__(self, memory: EngineMemory, rows: int, seq_len: int, available: tuple[int, str]):
        self.memory, self.rows, self.seq_len = memory, rows, seq_len
        self.available, self.source = available
        self.rows_fit = memory.rows_that_fit(self.available, seq_len)
        self.seq_len_fit = memory.seq_len_that_fits(self.available, rows, seq_len)
        fixes = [f"max_seq_len to at most {self.seq_len_fit}"] if self.seq_len_fit >= 2 else []
        fixes += [f"max_batch_size to at most {self.rows_fit}"] if self.rows_fit >= 1 else []
        super().__init__(f"RolloutEngine: max_batch_size={rows} x max_seq_len={seq_len} {self.needs()}; "
                         + (f"lower {' or '.join(fixes)}" if fixes else "not one row fits: free memory or use a "
                            "smaller model or quantized weights"))

    def needs(self) -> str:
        """'needs N GiB (KV cache, row buffers, weights) but M GiB is available (where)'."""
        m, rows, L = self.memory, self.rows, self.seq_len
        return (f"needs {gib(m.total(rows, L))} (KV cache {gib(rows * m.cache_row(L))}, row buffers "
                f"{gib(rows * m.buffers_row(L))}, weights {gib(m.weights)}) but {gib(self.available)} is "
                f"available ({self.source})")


def check_fits(memory: EngineMemory, rows: int, seq_len: int, device: torch.device) -> None:
    """Raise ``EngineMemoryError`` if ``rows x seq_len`` does not fit what ``device`` has left."""
    available = available_bytes(device)
    if available is not None and memory.total(rows, seq_len) > available[0]:
        raise EngineMemoryError(memory, rows, seq_len, available)


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """(bytes this process may still allocate on ``device``, where that figure comes from), or
    None where it is not known (a device other than CPU and CUDA)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + unused, f"free on {device}"
    if device.type != "cpu":
        return None
    found = [(n, source) for n, source in ((meminfo_available(), "MemAvailable on this host"),
                                           (cgroup_headroom(), "under this cgroup's memory limit"))
             if n is not None]
    return min(found) if found else None


def meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes (None where the file or the field is missing: not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup may still take before a memory limit (the least over it and
    its ancestors), or None without a limit. v2: ``memory.max - (memory.current - inactive_file)``;
    v1: ``hierarchical_memory_limit - (memory.usage_in_bytes - total_inactive_file)``."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
        heads = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                heads += _v2_headrooms(Path(root), path)
            elif "memory" in controllers.split(","):
                heads += _v1_headrooms(Path(root) / "memory", path)
    except (OSError, ValueError):
        return None
    return max(0, min(heads)) if heads else None


def _v2_headrooms(root: Path, path: str) -> list[int]:
    d = root / path.lstrip("/")
    if not d.is_dir():  # inside a cgroup namespace the path may name a group from outside it
        d = root
    heads = []
    while True:
        limit = d / "memory.max"
        if limit.exists() and limit.read_text().strip() != "max":
            used = int((d / "memory.current").read_text()) - _stat(d).get("inactive_file", 0)
            heads.append(int(limit.read_text()) - used)
        if d == root:
            return heads
        d = d.parent


def _v1_headrooms(base: Path, path: str) -> list[int]:
    d = base / path.lstrip("/")
    if not (d / "memory.usage_in_bytes").exists():
        d = base
    if not (d / "memory.usage_in_bytes").exists():
        return []
    stat = _stat(d)
    limit = stat.get("hierarchical_memory_limit") or int((d / "memory.limit_in_bytes").read_text())
    if limit >= UNLIMITED:
        return []
    return [limit - (int((d / "memory.usage_in_bytes").read_text()) - stat.get("total_inactive_file", 0))]


def _stat(d: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in (d / "memory.stat").read_text().splitlines())}
    except (OSError, ValueError):
        return {}
