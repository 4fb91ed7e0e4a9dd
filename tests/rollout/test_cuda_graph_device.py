"""CUDA graphs are captured and replayed on the *engine's* device (finding: on cuda:N, N != 0,
a capture on the current device's stream records an empty graph and replays stale logits).

CPU: the real ``CudaGraphRunner`` over a real (CPU) model runner whose device claims to be
``cuda:1``, with ``torch.cuda``'s device guard, streams, graph capture, replay and
synchronize replaced by recording fakes that track the "current device": every call must
name cuda:1 or run while cuda:1 is current, in the right order.
GPU: the same on real devices (a second GPU where there is one), and one engine per
device in two processes.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from hybridrl.rollout import EngineSpec, RolloutEngine
from hybridrl.rollout.core.cuda_graph import CudaGraphRunner
from hybridrl.rollout.engine import resolve_device
from tests.rollout.conftest import make_config, make_hf_model

ENGINE_DEVICE = torch.device("cuda", 1)


class FakeCuda:
    """Records torch.cuda calls with the device that is current when they happen."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        self.current = [torch.device("cuda", 0)]  # the process's current device
        self.capturing = False
        fake = self

        @contextlib.contextmanager
        def device(d):
            fake.current.append(torch.device(d))
            fake.log.append(("device_enter", torch.device(d)))
            try:
                yield
            finally:
                fake.current.pop()
                fake.log.append(("device_exit", torch.device(d)))

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = torch.device(device) if device is not None else fake.current[-1]
                fake.log.append(("stream_new", self.device, fake.current[-1]))

            def wait_stream(self, other):
                fake.log.append(("wait_stream", self.device, other))

        @contextlib.contextmanager
        def stream(s):
            fake.log.append(("stream_enter", s.device, fake.current[-1]))
            yield

        class CUDAGraph:
            def pool(self):
                return "pool"

            def replay(self):
                fake.log.append(("replay", fake.current[-1]))

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            fake.log.append(("capture_begin", stream.device if stream is not None else None, fake.current[-1]))
            fake.capturing = True
            yield
            fake.capturing = False
            fake.log.append(("capture_end",))

        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current_stream", device))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "synchronize",
                            lambda device=None: fake.log.append(("synchronize", device, fake.current[-1])))


def _cpu_runner():
    cfg = make_config("qwen2")
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=16))
    eng.load_weights(make_hf_model(cfg).named_parameters())
    return eng.runner


def test_capture_and_replay_run_on_the_engine_device(monkeypatch):
    runner = _cpu_runner()
    fake = FakeCuda(monkeypatch)
    steps = []
    real_step = runner.decode_eager

    def spy(tokens, positions, kv_len, aligned=False):
        steps.append((tokens.shape[0], fake.current[-1], fake.capturing))
        return real_step(tokens, positions, kv_len, aligned)

    monkeypatch.setattr(runner, "decode_eager", spy)
    monkeypatch.setattr(runner, "device", ENGINE_DEVICE)
    runner.capture_cuda_graphs([1, 2, 4])
    graphs = runner.graphs
    log = fake.log

    # Capture: inside the engine's device guard, on a stream created on that device.
    assert log[0] == ("device_enter", ENGINE_DEVICE) and log[-1] == ("device_exit", ENGINE_DEVICE)
    assert log[1] == ("stream_new", ENGINE_DEVICE, ENGINE_DEVICE)
    assert graphs.stream.device == ENGINE_DEVICE
    begins = [e for e in log if e[0] == "capture_begin"]
    assert begins == [("capture_begin", ENGINE_DEVICE, ENGINE_DEVICE)] * 3
    syncs = [e for e in log if e[0] == "synchronize"]
    assert syncs and all(s == ("synchronize", ENGINE_DEVICE, ENGINE_DEVICE) for s in syncs)
    # Per size, largest first: warm-up on the capture stream, drain, then the captured step.
    assert [(b, capturing) for b, _, capturing in steps] == [(4, False), (4, True), (2, False), (2, True),
                                                            (1, False), (1, True)]
    assert all(dev == ENGINE_DEVICE for _, dev, _ in steps)
    kinds = [e[0] for e in log]
    first_capture = kinds.index("capture_begin")
    assert kinds[first_capture - 2:first_capture] == ["stream_enter", "synchronize"]

    # Replay: launched while the engine's device is current.
    fake.log.clear()
    out = graphs.replay(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2]))
    assert out.shape == (3, runner.model.config.vocab_size)
    assert fake.log == [("device_enter", ENGINE_DEVICE), ("replay", ENGINE_DEVICE), ("device_exit", ENGINE_DEVICE)]
    assert graphs.replays == 1
    assert graphs.positions[3] == 0  # padding row of the size-4 graph


def test_graph_runner_refuses_a_device_without_index(monkeypatch):
    runner = _cpu_runner()
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    with pytest.raises(ValueError, match="with an index"):
        CudaGraphRunner(runner, [1])


def test_engine_resolves_cuda_to_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


# ---- GPU -----------------------------------------------------------------------------------

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="needs two CUDA devices")


def _graph_engine(device):
    cfg = make_config("qwen2")
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32, device=device))
    eng.load_weights(make_hf_model(cfg).named_parameters())
    return cfg, eng


def _check_replay(eng, device):
    runner = eng.runner
    assert runner.graphs is not None and runner.graphs.stream.device == device
    tokens = torch.tensor([5, 7, 11, 13], device=device)
    positions = torch.zeros(4, dtype=torch.long, device=device)
    replay = runner.graphs.replay(tokens, positions).clone()
    with torch.inference_mode():
        eager = runner.decode_eager(tokens, positions, runner.max_seq_len)
    torch.testing.assert_close(replay, eager, atol=0, rtol=0)  # same size (4): bitwise
    assert replay.abs().sum() > 0, "an empty graph leaves the zero-initialized logits"


@cuda
@needs_cuda
def test_engine_cuda_resolves_index_and_captures_on_it():
    cfg, eng = _graph_engine("cuda")
    assert eng.device == torch.device("cuda", torch.cuda.current_device())
    _check_replay(eng, eng.device)


@cuda
@needs_two
def test_engine_on_second_device_while_first_is_current():
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    with torch.cuda.device(0):
        cfg, eng = _graph_engine(dev)
        _check_replay(eng, dev)


def _one_engine_per_device(rank: int, errors) -> None:
    try:
        torch.cuda.set_device(rank)
        _, eng = _graph_engine("cuda")
        assert eng.device == torch.device("cuda", rank)
        _check_replay(eng, eng.device)
    except BaseException as e:  # noqa: BLE001
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")


@cuda
@needs_two
def test_one_engine_per_device_in_two_processes():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_one_engine_per_device, args=(rank, errors)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs)
