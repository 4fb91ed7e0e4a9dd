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
