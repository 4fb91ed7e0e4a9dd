"""The cross-process transport's synchronization and liveness, exercised on CPU.

The CUDA race: the trainer's ``copy_`` into the shared bucket and the engine's reads of it
are asynchronous kernels; the pipe messages are not. So the trainer must drain its
device before each "bucket" / "tensor" message and the engine before each reply. Here the
two sides run in two threads of one process over a real Pipe, with ``device_sync``
replaced by a recorder: the log of syncs and messages must show a sync between every
packing and its message, and between every load and its acknowledgement.
Liveness: a silent or dead peer raises ``RefitError`` within the timeout instead of
blocking ``recv()`` forever.
"""
from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from hybridrl.refit import shm
from hybridrl.refit.errors import RefitError
from hybridrl.refit.shm import ShmChannel, send_refit, serve_refit
from tests.refit.helpers import engine, hf_model, perturb, qwen2_config

BUCKET = 96 << 10  # smaller than the embedding: one "tensor" message besides the buckets


class Recorder:
    def __init__(self):
        self.log: list[tuple] = []
        self.lock = threading.Lock()

    def add(self, *event):
        with self.lock:
            self.log.append((threading.current_thread().name, *event))


class RecordingConn:
    def __init__(self, conn, rec: Recorder):
        self.conn, self.rec = conn, rec

    def send(self, msg):
        self.rec.add("send", msg[0])
        self.conn.send(msg)

    def recv(self):
        msg = self.conn.recv()
        self.rec.add("recv", msg[0])
        return msg

    def poll(self, timeout=None):
        return self.conn.poll(timeout)


def test_syncs_precede_every_bucket_message_and_every_ack(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(shm, "device_sync", lambda *devices: rec.add("sync", *devices))
    real_load = shm.Refit.load

    def load(self, pairs):
        rec.add("load")
        return real_load(self, pairs)

    monkeypatch.setattr(shm.Refit, "load", load)
    cfg = qwen2_config()
    eng = engine(cfg)
    hf = hf_model(cfg)
    perturb(hf, seed=1)
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    buffer = torch.empty(BUCKET, dtype=torch.uint8)
    a, b = multiprocessing.Pipe()
    result = {}

    def serve():
        result["stats"] = serve_refit(eng, ShmChannel(buffer, RecordingConn(a, rec)), verify=True, timeout_s=60)

    server = threading.Thread(target=serve, name="engine")
    server.start()
    threading.current_thread().name = "trainer"
    try:
        send_refit(ShmChannel(buffer, RecordingConn(b, rec)), named, timeout_s=60)
    finally:
        threading.current_thread().name = "MainThread"
    server.join(timeout=60)
    assert result["stats"].version == 1

    trainer = [e[1:] for e in rec.log if e[0] == "trainer"]
    engine_side = [e[1:] for e in rec.log if e[0] == "engine"]
    kinds = [e[1] for e in trainer if e[0] == "send"]
    assert kinds[0] == "begin" and kinds[-1] == "finish" and "bucket" in kinds and "tensor" in kinds
    # trainer: every bucket/tensor message comes right after a sync of the bucket's device
    for i, e in enumerate(trainer):
        if e[:2] in (("send", "bucket"), ("send", "tensor")):
            assert trainer[i - 1][0] == "sync" and torch.device("cpu") in trainer[i - 1][1:], trainer[i - 1]
    # engine: every load is followed by a sync before the next reply
    pending_load = False
    for e in engine_side:
        if e[0] == "load":
            pending_load = True
        elif e[0] == "sync":
            pending_load = False
        elif e[0] == "send":
            assert not pending_load, "acknowledged before the loads' device work was drained"
    assert sum(e[0] == "load" for e in engine_side) == kinds.count("bucket") + kinds.count("tensor")
    assert engine_side[-2][0] == "sync" and engine_side[-1] == ("send", "ok")


def test_device_sync_synchronizes_each_cuda_device_once(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    shm.device_sync(torch.device("cuda", 1), "cpu", None, torch.device("cuda", 1), torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 0)]
    calls.clear()
    shm.device_sync(torch.device("cpu"))
    assert calls == []


def test_silent_trainer_times_out():
    a, b = multiprocessing.Pipe()
    eng = engine(qwen2_config())
    with pytest.raises(RefitError, match="no message from the trainer process within 0.2 s"):
        serve_refit(eng, ShmChannel(torch.empty(64, dtype=torch.uint8), a), timeout_s=0.2)
    assert not eng.weight_update_in_progress


def test_dead_peer_is_end_of_file_not_a_hang():
    a, b = multiprocessing.Pipe()
    b.close()  # the only other copy of the trainer's end: as if its process died
    with pytest.raises(RefitError, match="closed the refit channel"):
        serve_refit(engine(qwen2_config()), ShmChannel(torch.empty(64, dtype=torch.uint8), a), timeout_s=30)
    c, d = multiprocessing.Pipe()
    c.close()
    with pytest.raises(RefitError, match="engine process closed"):
        send_refit(ShmChannel(torch.empty(64, dtype=torch.uint8), d), [], timeout_s=30)


def test_engine_failure_mid_refit_reaches_the_trainer():
    """The engine rejects a bucket; the trainer gets RefitError, the engine aborts cleanly."""
    cfg = qwen2_config()
    eng = engine(cfg)
    named = [(n, p.detach()) for n, p in hf_model(cfg).named_parameters()]
    named[2] = (named[2][0], named[2][1][:1])  # wrong shape
    buffer = torch.empty(BUCKET, dtype=torch.uint8)
    a, b = multiprocessing.Pipe()
    errors = []

    def serve():
        try:
            serve_refit(eng, ShmChannel(buffer, a), timeout_s=30)
        except RefitError as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(RefitError, match="engine process rejected the refit"):
        send_refit(ShmChannel(buffer, b), named, timeout_s=30)
    t.join(timeout=30)
    assert errors and eng.weight_version == 0 and not eng.weight_update_in_progress
