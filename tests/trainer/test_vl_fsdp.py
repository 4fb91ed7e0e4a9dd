"""A VL policy under FSDP2 (2 gloo ranks): the vision tower and the language model shard,
and the packed forward with images gives the single-process log-probs and vision gradients."""

import random
import socket

import torch
import torch.multiprocessing as mp

from hybridrl.trainer.forward import compute_logprobs_entropy
from hybridrl.trainer.vision_model import vision_parameters
from tests._seeds import fresh_seed
from tests.trainer import _vl_fsdp_worker
from tests.trainer._vl import draw_model, draw_rows, pad_rows


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_two_ranks_equal_one_process(tmp_path):
    seed = fresh_seed()
    arch = random.Random(seed).choice(["qwen2_5_vl", "qwen3_vl"])  # one spawn per run (~12 s)
    out = tmp_path / "rank0.pt"
    mp.spawn(_vl_fsdp_worker.sharded_logprobs_and_grads, args=(2, _port(), arch, seed, str(out)), nprocs=2,
             join=True)
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=4)
    lp, _ = compute_logprobs_entropy(model, *pad_rows(rows, "left"), images=images)
    lp.sum().backward()
    sharded = torch.load(out)
    torch.testing.assert_close(sharded["logprobs"], lp.detach(), rtol=1e-5, atol=1e-5, msg=f"seed {seed} {arch}")
    for name, p in vision_parameters(model):  # same rows on both ranks: the averaged gradient is this one
        torch.testing.assert_close(sharded["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=f"seed {seed} {name}")
