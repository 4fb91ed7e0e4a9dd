"""Cross-process refit on one host through a shared-memory bucket (CUDA IPC on GPU).

The engine process owns one flat ``uint8`` bucket allocated in shared memory
(``share_memory_()`` on CPU; on CUDA, torch.multiprocessing passes the tensor by CUDA
IPC handle) and a ``Pipe``. Both travel to the trainer process as a picklable
``ShmChannel``. Handshake, one bucket in flight:

    trainer                                   engine
    ("begin", names)                    ──►   Refit.begin(names)          ──► "ok" | error
    pack bucket into shared buffer
    ("bucket", metas)                   ──►   unpack views, Refit.load    ──► "ok" | error
    ... (the buffer is refilled only after the ack)
    ("finish",)                         ──►   Refit.finish()              ──► stats | error

A tensor bigger than the bucket is sent as a ``("tensor", name)`` message holding a
shared-memory copy of it (the "goes alone" rule). Errors on the engine side are sent
back as ``("error", message)`` and re-raised in the trainer as ``RefitError``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.refit.bucket import DEFAULT_BUCKET_BYTES, BucketPacker, unpack
from hybridrl.refit.errors import RefitError
from hybridrl.refit.session import Refit, RefitStats


@dataclass
class ShmChannel:
    """Picklable end a trainer process uses: the shared bucket and its pipe end."""

    buffer: torch.Tensor  # (bucket_bytes,) uint8 in shared memory / CUDA
    conn: object  # multiprocessing.connection.Connection


def make_channel(bucket_bytes: int = DEFAULT_BUCKET_BYTES, device="cpu", ctx=None):
    """Returns ``(engine_side, trainer_side)`` channels sharing one bucket."""
    import torch.multiprocessing as mp
    ctx = ctx or mp.get_context("spawn")
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    if buffer.device.type == "cpu":
        buffer.share_memory_()
    engine_conn, trainer_conn = ctx.Pipe()
    return ShmChannel(buffer, engine_conn), ShmChannel(buffer, trainer_conn)


def _call(conn, msg):
    conn.send(msg)
    kind, payload = conn.recv()
    if kind == "error":
        raise RefitError(f"engine process rejected the refit: {payload}")
    return payload


def send_refit(channel: ShmChannel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> RefitStats:
    """Trainer side: announce, stream buckets through the shared buffer, finish."""
    named = list(named_tensors)
    _call(channel.conn, ("begin", [n for n, _ in named]))
    packer = BucketPacker(channel.buffer.numel(), buffer=channel.buffer)
    for payload, metas in packer.pack_meta(named):
        if payload is packer.buffer:
            _call(channel.conn, ("bucket", metas))
        else:  # larger than the bucket: its own shared tensor, alone
            t = payload.clone().share_memory_() if payload.device.type == "cpu" else payload
            _call(channel.conn, ("tensor", metas[0], t))
    return _call(channel.conn, ("finish",))


def serve_refit(engine, channel: ShmChannel, *, verify: bool = False) -> RefitStats:
    """Engine side: serve one refit sent by ``send_refit``; returns its stats."""
    refit = Refit(engine, verify=verify)
    while True:
        msg = channel.conn.recv()
        try:
            if msg[0] == "begin":
                refit.begin(msg[1])
                reply = None
            elif msg[0] == "bucket":
                refit.load(unpack(channel.buffer, msg[1]))
                reply = None
            elif msg[0] == "tensor":
                meta, t = msg[1], msg[2]
                refit.load([(meta.name, t.view(meta.dtype).view(meta.shape))])
                reply = None
            elif msg[0] == "finish":
                stats = refit.finish()
                channel.conn.send(("ok", stats))
                return stats
            else:
                raise RefitError(f"unknown refit message {msg[0]!r}")
        except Exception as e:  # report to the trainer, then fail here too
            refit.abort()
            channel.conn.send(("error", str(e)))
            raise
        channel.conn.send(("ok", reply))
