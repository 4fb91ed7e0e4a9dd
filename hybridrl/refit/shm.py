"""Cross-process refit on one host through a shared-memory bucket (CUDA IPC on GPU).

The engine process owns one flat ``uint8`` bucket allocated in shared memory
(``share_memory_()`` on CPU; on CUDA, torch.multiprocessing passes the tensor by CUDA
IPC handle) and a ``Pipe``. Both travel to the trainer process as a picklable
``ShmChannel``. Handshake, one bucket in flight:

    trainer                                   engine
    ("begin", names, partial, version)  ──►   Refit(version=version)      ──► "ok" | error
                                              .begin(names)
    pack bucket into shared buffer
    drain its copies (device sync)
    ("bucket", metas)                   ──►   unpack views, Refit.load
                                              drain its reads (device sync) ──► "ok" | error
    ... (the buffer is refilled only after the ack)
    ("finish",)                         ──►   Refit.finish(): the engine  ──► stats | error
                                              records ``version``

**Synchronization (CUDA).** The pipe is host-side; the bucket is device memory read and
written by kernels that run *asynchronously* on each process's own stream. Two races
follow unless both sides drain their device work at the hand-over:

- trainer: the ``copy_`` of each tensor into the bucket is only *queued* when ``pack``
  returns, so the "bucket ready" message can reach the engine before the bytes do. The
  trainer therefore synchronizes the bucket's device (and the devices of its own tensors)
  before every ``("bucket", ...)`` / ``("tensor", ...)`` message;
- engine: ``Refit.load`` only *queues* the kernels that read the bucket (the copies /
  FP8 quantization into the engine, and the verifier's checksums of the bucket views).
  Acknowledging before they ran lets the trainer overwrite the bucket under them — and
  ``verify`` would checksum a view that is still changing. The engine synchronizes its
  devices before every reply.

A host sync per bucket (64-256 MiB) costs nothing next to the bucket's transfer. Both
calls go through :func:`device_sync` (a no-op for CPU devices; the tests replace it with
a recorder to check the order of syncs and messages).

A tensor bigger than the bucket is sent as a ``("tensor", meta, t)`` message holding a
shared-memory copy of it (the "goes alone" rule). Errors on the engine side are sent
back as ``("error", message)`` and re-raised in the trainer as ``RefitError``.

**No hangs.** Every wait on the pipe is a ``poll`` with a timeout (``timeout_s``), and a
peer that died shows as end-of-file — provided nobody else holds its pipe end: after
starting the trainer process, the engine process closes its own copy of the trainer's
end (``trainer_side.conn.close()``), or a dead trainer would leave ``recv`` waiting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.refit.bucket import DEFAULT_BUCKET_BYTES, BucketPacker, unpack
from hybridrl.refit.errors import RefitError
from hybridrl.refit.session import Refit, RefitStats
from hybridrl.rollout.backend import check_weight_version

DEFAULT_TIMEOUT_S = 600.0  # one message round trip (one bucket loaded); None waits forever


@dataclass
class ShmChannel:
    """Picklable end a trainer process uses: the shared bucket and its pipe end."""

    buffer: torch.Tensor  # (bucket_bytes,) uint8 in shared memory / CUDA
    conn: object  # multiprocessing.connection.Connection


def make_channel(bucket_bytes: int = DEFAULT_BUCKET_BYTES, device="cpu", ctx=None):
    """Returns ``(engine_side, trainer_side)`` channels sharing one bucket.

    Hand ``trainer_side`` to the trainer process, then close it here
    (``trainer_side.conn.close()``) so that the trainer's death is seen as end-of-file.
    """
    import torch.multiprocessing as mp
    ctx = ctx or mp.get_context("spawn")
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    if buffer.device.type == "cpu":
        buffer.share_memory_()
    engine_conn, trainer_conn = ctx.Pipe()
    return ShmChannel(buffer, engine_conn), ShmChannel(buffer, trainer_conn)


def device_sync(*devices) -> None:
    """Block until all work queued on each distinct CUDA device among ``devices`` finished
    (``torch.cuda.synchronize(device)``); CPU devices (and None) need nothing."""
    seen = set()
    for d in devices:
        if d is None:
            continue
        d = torch.device(d)
        if d.type == "cuda" and d not in seen:
            seen.add(d)
            torch.cuda.synchronize(d)


def _recv(conn, timeout_s: float | None, peer: str):
    """The next message, or ``RefitError`` if none comes within ``timeout_s`` or the peer closed."""
    try:
        if timeout_s is not None and not conn.poll(timeout_s):
            raise RefitError(f"no message from the {peer} process within {timeout_s:g} s; is it alive? "
                             "(raise timeout_s for very large buckets)")
        return conn.recv()
    except (EOFError, ConnectionError, OSError) as e:
        raise RefitError(f"the {peer} process closed the refit channel ({type(e).__name__}); "
                         "it probably died — see its log") from None


def _send(conn, msg, peer: str) -> None:
    try:
        conn.send(msg)
    except (ConnectionError, OSError) as e:  # BrokenPipeError: the peer's end is closed
        raise RefitError(f"the {peer} process closed the refit channel ({type(e).__name__}); "
                         "it probably died — see its log") from None


def _call(conn, msg, timeout_s: float | None):
    _send(conn, msg, "engine")
    kind, payload = _recv(conn, timeout_s, "engine")
    if kind == "error":
        raise RefitError(f"engine process rejected the refit: {payload}")
    return payload


def send_refit(channel: ShmChannel, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
               timeout_s: float | None = DEFAULT_TIMEOUT_S, partial: bool = False,
               version: int | None = None) -> RefitStats:
    """Trainer side: announce, stream buckets through the shared buffer, finish.
    ``partial``: the names are a subset of the engine's (``Refit.begin(names, partial=True)``);
    ``version``: the weight version this refit publishes, announced with "begin" so that
    the engine side's ``Refit`` is built with it (None: the engine's + 1)."""
    if version is not None:
        check_weight_version(version)  # refused before anything is sent
    named = list(named_tensors)
    sources = {t.device for _, t in named}
    _call(channel.conn, ("begin", [n for n, _ in named], partial, version), timeout_s)
    packer = BucketPacker(channel.buffer.numel(), buffer=channel.buffer)
    for payload, metas in packer.pack_meta(named):
        # The copies into the bucket (or a large tensor's .contiguous()) are queued, not
        # done: drain them before telling the engine to read.
        device_sync(payload.device, *sources)
        if payload is packer.buffer:
            _call(channel.conn, ("bucket", metas), timeout_s)
        else:  # larger than the bucket: its own shared tensor, alone
            t = payload.clone().share_memory_() if payload.device.type == "cpu" else payload
            _call(channel.conn, ("tensor", metas[0], t), timeout_s)
    return _call(channel.conn, ("finish",), timeout_s)


def serve_refit(engine, channel: ShmChannel, *, verify: bool = False,
                timeout_s: float | None = DEFAULT_TIMEOUT_S) -> RefitStats:
    """Engine side: serve one refit sent by ``send_refit``; returns its stats.

    Raises ``RefitError`` if the trainer sends nothing for ``timeout_s`` or dies. The engine
    records the version the trainer announced with "begin".
    """
    refit = Refit(engine, verify=verify)  # until "begin" brings the version: refuses any other message
    devices = [channel.buffer.device, getattr(engine, "device", None)]
    while True:
        try:
            msg = _recv(channel.conn, timeout_s, "trainer")
        except RefitError:
            refit.abort()
            raise
        touched = ()  # devices of tensors that came with the message
        try:
            if msg[0] == "begin":
                names, partial, version = msg[1:]
                refit = Refit(engine, verify=verify, version=version).begin(names, partial=partial)
                reply = None
            elif msg[0] == "bucket":
                refit.load(unpack(channel.buffer, msg[1]))
                reply = None
            elif msg[0] == "tensor":
                meta, t = msg[1], msg[2]
                refit.load([(meta.name, t.view(meta.dtype).view(meta.shape))])
                touched = (t.device,)  # released (to the trainer) when `t` goes: read it first
                reply = None
            elif msg[0] == "finish":
                stats = refit.finish()
                device_sync(*devices)
                _send(channel.conn, ("ok", stats), "trainer")
                return stats
            else:
                raise RefitError(f"unknown refit message {msg[0]!r}")
        except Exception as e:  # report to the trainer, then fail here too
            refit.abort()
            device_sync(*devices)
            try:
                channel.conn.send(("error", str(e)))
            except (ConnectionError, OSError):
                pass  # the trainer is gone; the error below is the report
            raise
        # Loads are queued kernels reading the bucket: done before the trainer may refill it.
        device_sync(*devices, *touched)
        _send(channel.conn, ("ok", reply), "trainer")
