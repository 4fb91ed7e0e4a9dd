"""Peak extra memory of a refit ≤ one bucket + the largest single tensor."""
import pytest

from hybridrl.refit import BucketPacker, Refit, refit_from_model
from hybridrl.refit.memory import peak_extra_bytes
from tests.refit.helpers import engine, hf_model, perturb, qwen2_config

BUCKET = 128 << 10


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_peak_extra_memory(quantization):
    cfg = qwen2_config()
    hf, eng = hf_model(cfg), engine(cfg, quantization)
    refit_from_model(eng, hf)
    perturb(hf, seed=3)
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    largest = max(t.numel() * t.element_size() for _, t in named)

    def in_process():
        return refit_from_model(eng, named, bucket_bytes=BUCKET)

    def packed():  # the cross-process path's packing, in one process
        s = Refit(eng).begin([n for n, _ in named])
        for group in BucketPacker(BUCKET).pack(named):
            s.load(group)
        return s.finish()

    for fn in (in_process, packed):
        peak, _ = peak_extra_bytes(fn)
        assert peak <= BUCKET + largest, (fn.__name__, peak, BUCKET + largest)


# ---- the profiler's field names ---------------------------------------------------------------

class _Event:
    def __init__(self, start, **fields):
        self.time_range = type("R", (), {"start": start})()
        self.__dict__.update(fields)


def test_device_field_follows_the_torch_version():
    from hybridrl.refit.memory import memory_field
    new = _Event(0, self_device_memory_usage=1, self_cpu_memory_usage=0)
    old = _Event(0, self_cuda_memory_usage=1, self_cpu_memory_usage=0)
    both = _Event(0, self_device_memory_usage=1, self_cuda_memory_usage=1)
    assert memory_field(new, "cuda") == "self_device_memory_usage"
    assert memory_field(both, "cuda:1") == "self_device_memory_usage"
    assert memory_field(old, "cuda") == "self_cuda_memory_usage"
    assert memory_field(new, "cpu") == "self_cpu_memory_usage"
    with pytest.raises(RuntimeError, match="cannot measure device memory"):
        memory_field(_Event(0, self_cpu_memory_usage=5), "cuda")  # neither name: never "0 bytes"


def test_replay_peak_in_start_order():
    from hybridrl.refit.memory import replay_peak
    events = [_Event(3, m=-100), _Event(1, m=100), _Event(2, m=50), _Event(4, m=0), _Event(5, m=30)]
    assert replay_peak(events, "m") == 150


def test_this_torch_has_a_device_field():
    from torch.autograd.profiler_util import FunctionEvent

    from hybridrl.refit.memory import memory_field
    assert memory_field(FunctionEvent(0, "x", 0, 0, 1), "cuda") == "self_device_memory_usage"


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_is_measured():
    import torch
    x = torch.randn(1 << 20, device="cuda")
    peak, _ = peak_extra_bytes(lambda: (x * 2).sum().item(), device="cuda")
    assert peak >= 1 << 20  # the 4 MiB x * 2 temporary, not a silent 0
