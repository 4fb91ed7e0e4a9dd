"""Bucketing: pack ``(name, tensor)`` pairs into one fixed-size flat byte buffer.

The producer (trainer side) copies tensors back to back into a preallocated ``uint8``
buffer of ``bucket_bytes`` and hands over the buffer plus a list of ``TensorMeta``; the
consumer (engine side) unpacks **views** into that buffer (no copy) and loads them.
The buffer is reused for the next bucket only after the consumer is done with it
(generators resume only when the caller asks for the next bucket; the shared-memory
transport waits for an ack). On CUDA "done" means the consumer's *kernels* ran, not just
that its Python returned: in one process the next bucket's ``copy_`` is queued on the
same stream after the consumer's reads, so stream order suffices; across processes there
is no common stream and ``shm.py`` synchronizes the device on both sides of every
message. So the peak extra memory of a refit is one bucket, plus
at most one tensor the producer had to materialize (e.g. a dtype cast). A tensor larger
than the bucket is not split: it goes alone, as itself, without a copy.

Offsets are aligned to ``ALIGN`` bytes so every view has a valid, aligned dtype view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

ALIGN = 64  # bytes; >= every dtype's itemsize and a cache line
DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket: ``buffer[offset : offset + nbytes]``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def unpack(buffer: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buffer`` (flat uint8) for each meta; no copies."""
    out = []
    for m in metas:
        raw = buffer[m.offset:m.offset + m.nbytes]
        out.append((m.name, raw.view(m.dtype).view(m.shape)))
    return out


class BucketPacker:
    """Packs a stream of named tensors into one reusable ``uint8`` buffer.

    ``pack`` yields ``list[(name, tensor)]`` groups. A group of ordinary tensors is a set
    of views into ``self.buffer`` (valid until the next group is requested); a tensor
    bigger than the buffer is yielded alone, as itself. ``pack_meta`` yields the
    ``(buffer_or_tensor, metas)`` form a cross-process transport sends.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, device="cpu",
                 buffer: torch.Tensor | None = None):
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} is too small; use at least {ALIGN}")
        if buffer is None:
            buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.numel() >= bucket_bytes
        self.buffer = buffer[:bucket_bytes]
        self.bucket_bytes = bucket_bytes

    def pack_meta(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[torch.Tensor, list[TensorMeta]]]:
        metas: list[TensorMeta] = []
        used = 0
        for name, t in named_tensors:
            t = t.detach()
            size = nbytes(t)
            if size > self.bucket_bytes:  # goes alone, no copy
                if metas:
                    yield self.buffer, metas
                    metas, used = [], 0
                flat = t.contiguous().view(-1).view(torch.uint8)
                yield flat, [TensorMeta(name, tuple(t.shape), t.dtype, 0, size)]
                continue
            if used + size > self.bucket_bytes:
                yield self.buffer, metas
                metas, used = [], 0
            dst = self.buffer[used:used + size].view(t.dtype).view(t.shape)
            dst.copy_(t)
            metas.append(TensorMeta(name, tuple(t.shape), t.dtype, used, size))
            used = _align(used + size)
        if metas:
            yield self.buffer, metas

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for buffer, metas in self.pack_meta(named_tensors):
            yield unpack(buffer, metas)


def group_by_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """In-process buckets without packing: groups of at most ``bucket_bytes`` (a larger
    tensor alone). No copy; the tensors are the producer's own."""
    group, used = [], 0
    for name, t in named_tensors:
        size = nbytes(t)
        if group and used + size > bucket_bytes:
            yield group
            group, used = [], 0
        group.append((name, t))
        used += size
    if group:
        yield group
