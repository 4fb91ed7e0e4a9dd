"""Refit across two real processes through a shared-memory bucket (CUDA IPC variants marked).

No test here can hang: the parent closes its copy of the child's pipe end right after
starting the child (so a dead child is end-of-file, not a silent pipe), every wait has a
timeout, and a child still alive at the end is killed.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from hybridrl.refit.errors import RefitError
from hybridrl.refit.shm import make_channel, send_refit, serve_refit
from tests.refit.helpers import assert_fp32_close, engine, hf_model, inputs, perturb, qwen2_config, ref_logits

BUCKET = 96 << 10  # smaller than the embedding (256 KiB in fp64): it goes alone
TIMEOUT_S = 120


def _trainer(channel, seed, device, delay_cycles=0, version=None):
    hf = hf_model(qwen2_config(), seed=0)
    perturb(hf, seed=seed)
    named = [(n, p.detach().to(device)) for n, p in hf.named_parameters()]
    if delay_cycles:  # a long kernel ahead of the packing copies: they finish late
        torch.cuda.synchronize()
        torch.cuda._sleep(delay_cycles)
    send_refit(channel, named, timeout_s=TIMEOUT_S, version=version)


def _dies_at_once(channel):
    os._exit(3)


def _serve_one(target, args, eng, **kw):
    """Start ``target(trainer_side, *args)`` in a spawned process and serve its refit."""
    ctx = mp.get_context("spawn")
    eng_side, trainer_side = make_channel(BUCKET, device=kw.pop("device", "cpu"), ctx=ctx)
    proc = ctx.Process(target=target, args=(trainer_side, *args))
    proc.start()
    trainer_side.conn.close()  # only the child holds the trainer's end now
    try:
        return serve_refit(eng, eng_side, timeout_s=TIMEOUT_S, **kw), proc
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def _run(device, quantization=None, trainer_delay=0, engine_delay=0):
    if device == "cpu":
        eng = engine(qwen2_config(), quantization)
    else:
        from hybridrl.rollout import EngineSpec, RolloutEngine
        eng = RolloutEngine(qwen2_config(), EngineSpec(max_batch_size=2, max_seq_len=32, device=device,
                                                       quantization=quantization))
    if engine_delay:  # a long kernel ahead of every load: the engine's reads of the bucket finish late
        real = eng.load_weights

        def slow_load(pairs):
            torch.cuda._sleep(engine_delay)
            return real(pairs)

        eng.load_weights = slow_load
    stats, proc = _serve_one(_trainer, (1, device, trainer_delay), eng, verify=True, device=device)
    assert proc.exitcode == 0 and stats.version == 1
    hf = hf_model(qwen2_config(), seed=0)
    perturb(hf, seed=1)
    return eng, hf


def _assert_matches(eng, hf, device="cpu"):
    ids, mask = inputs(3)
    got = eng.logits(ids.to(device), mask.to(device)).double().cpu()
    ref = ref_logits(hf, ids, mask)
    if device == "cpu":
        assert_fp32_close(got, ref)
    else:  # CUDA's TF32-free fp32 GEMMs reorder more: a looser fixed bound, unchanged
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_shared_memory_two_processes():
    eng, hf = _run("cpu")
    _assert_matches(eng, hf)


def test_the_engine_records_the_version_the_trainer_sends():
    eng = engine(qwen2_config())
    stats, proc = _serve_one(_trainer, (1, "cpu", 0, 7), eng)
    assert proc.exitcode == 0 and stats.version == eng.weight_version == 7
    with pytest.raises(ValueError, match="version=0 must be an int >= 1"):  # refused before anything is sent
        send_refit(make_channel(BUCKET)[1], [], version=0)


def test_dead_trainer_process_is_reported_not_waited_for():
    eng = engine(qwen2_config())
    with pytest.raises(RefitError, match="closed the refit channel"):
        _serve_one(_dies_at_once, (), eng)
    assert eng.weight_version == 0 and not eng.weight_update_in_progress


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
def test_cuda_ipc_two_processes():
    eng, hf = _run("cuda")  # verify=True checks contents and addresses on the engine side
    _assert_matches(eng, hf, "cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("side", ["trainer", "engine"])
def test_cuda_ipc_with_late_kernels_is_race_free(side):
    """A long kernel delays the trainer's packing copies (without its sync the engine reads
    the bucket before the bytes land: verify fails) or the engine's loads (without its sync
    the trainer refills the bucket under them: wrong weights, the logits check fails)."""
    cycles = 200_000_000  # ~0.1 s at ~2 GHz
    if side == "trainer":
        eng, hf = _run("cuda", trainer_delay=cycles)
    else:
        eng, hf = _run("cuda", engine_delay=cycles // 4)
    _assert_matches(eng, hf, "cuda")
