"""Refit across two real processes through a shared-memory bucket (CUDA IPC variant marked)."""
import pytest
import torch
import torch.multiprocessing as mp

from hybridrl.refit.shm import make_channel, send_refit, serve_refit
from tests.refit.helpers import engine, hf_model, inputs, perturb, qwen2_config, ref_logits

BUCKET = 96 << 10  # smaller than the embedding (256 KiB in fp64): it goes alone


def _trainer(channel, seed, device):
    hf = hf_model(qwen2_config(), seed=0)
    perturb(hf, seed=seed)
    send_refit(channel, [(n, p.detach().to(device)) for n, p in hf.named_parameters()])


def _run(device, quantization=None):
    ctx = mp.get_context("spawn")
    eng_side, trainer_side = make_channel(BUCKET, device=device, ctx=ctx)
    eng = engine(qwen2_config(), quantization)
    for seed in (1,):  # one spawn per test: each child imports torch + transformers
        proc = ctx.Process(target=_trainer, args=(trainer_side, seed, device))
        proc.start()
        stats = serve_refit(eng, eng_side, verify=True)
        proc.join(timeout=60)
        assert proc.exitcode == 0 and stats.version == seed
    hf = hf_model(qwen2_config(), seed=0)
    perturb(hf, seed=1)
    return eng, hf


def test_shared_memory_two_processes():
    eng, hf = _run("cpu")
    ids, mask = inputs(3)
    torch.testing.assert_close(eng.logits(ids, mask).double(), ref_logits(hf, ids, mask), atol=1e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_two_processes():
    _run("cuda")  # verify=True checks contents and addresses on the engine side
