"""Tensor-parallel rollout on 2 ranks (gloo, CPU): engine memory per rank and the refit.

Two real ranks shard one Qwen2-shaped trainer model with FSDP2 and each hold two engines of
it: a whole one (TP=1, the baseline: what every rank held before) and its TP=2 shard. Measured
in the same run, on rank 0 (the larger share):

- engine weight bytes per rank, TP=2 vs TP=1 (goal <= 0.55x);
- refit from FSDP(2): into the TP shards by the shard-to-shard exchange (one all_to_all per
  bucket, ``distributed/tp_refit.py``) vs into the whole engine by gathering every bucket
  (``distributed/refit.py``): seconds (best of a few, interleaved) and the peak extra
  resident memory of one refit (the kernel's high-water mark; least of three refits), next
  to the bound "one bucket + this rank's TP slice of the largest parameter";
- from ``hybridrl plan`` (the real layers on the meta device): the largest Qwen2.5-7B-shaped
  model (in layers) whose *engine* fits a per-rank budget, and the largest whose whole job
  (trainer shard + optimizer + engine + KV + refit) fits it, at TP=1 and TP=2.

On gloo the exchange runs pairwise over TCP: the time ratio is recorded as it comes out; the
memory is the point on CPU. On NCCL an ``all_to_all`` of ``1/T`` of the bytes costs about ``1/T``
of the all-gather's receive volume per rank (bandwidth-bound), so FSDP(N) -> TP(T) should
take no longer than the gathered refit and move ``T`` times less into each rank.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _common import goal_line, parse_args, report, row  # noqa: E402

GIB = 1 << 30


def _model(quick: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, vocab = (512, 4, 8192) if quick else (1024, 8, 32768)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def _rank(rank: int, world: int, port: int, quick: bool, repeats: int, bucket: int, out: str) -> None:
    import torch.distributed as dist

    from hybridrl.distributed.fsdp import shard_model
    from hybridrl.distributed.plan import weight_bytes
    from hybridrl.distributed.refit import refit_sharded
    from hybridrl.distributed.tp_refit import refit_sharded_tp
    from hybridrl.refit.memory import peak_rss_delta
    from hybridrl.rollout import EngineSpec, RolloutEngine
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(quick)
    spec = EngineSpec(max_batch_size=2, max_seq_len=16)
    whole = RolloutEngine(model.config, spec, enforce_eager=True)
    shard = RolloutEngine(model.config, spec, enforce_eager=True,
                          tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    shard_model(model)
    gathered = lambda: refit_sharded(whole, model, bucket_bytes=bucket)  # noqa: E731
    exchanged = lambda: refit_sharded_tp(shard, model, bucket_bytes=bucket)  # noqa: E731
    refit_sharded(whole, model, bucket_bytes=bucket, verify=True)  # first loads, verified
    refit_sharded_tp(shard, model, bucket_bytes=bucket, verify=True)
    times = {"tp": float("inf"), "full": float("inf")}
    for _ in range(repeats):  # interleaved: load drifts hit both
        for key, fn in (("full", gathered), ("tp", exchanged)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[key] = min(times[key], time.perf_counter() - t0)
    peaks = {key: min(peak_rss_delta(fn) for _ in range(3)) for key, fn in (("full", gathered), ("tp", exchanged))}

    if rank == 0:
        torch.save(dict(times=times, peaks=peaks, bytes_whole=weight_bytes(whole.model),
                        bytes_tp=weight_bytes(shard.model),
                        largest=largest), out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no C++ teardown of gloo's threads (see tests/distributed/_workers.finish)


def _largest_layers(budget: int, tp: int, engine_only: bool) -> int:
    """Most layers of a Qwen2.5-7B-shaped model whose plan fits ``budget`` bytes per rank (2 ranks, bf16)."""
    from hybridrl.distributed.plan import QWEN25_SHAPES, EngineLoad, plan_memory
    from transformers import Qwen2Config

    def fits(layers: int) -> bool:
        cfg = Qwen2Config(max_position_embeddings=4096, **{**QWEN25_SHAPES["qwen2.5-7b"], "num_hidden_layers": layers})
        p = plan_memory(cfg, world_size=2, trainer_dtype=torch.bfloat16, bucket_bytes=64 << 20,
                        engine=EngineLoad(dtype=torch.bfloat16, batch=64, seq_len=1024, tensor_parallel_size=tp))
        return (p.engine_weights if engine_only else p.total) <= budget

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    args = parse_args(__doc__)
    repeats, bucket = (3, 8 << 20) if args.quick else (5, 32 << 20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "tp.pt")
    # large blocks straight from mmap, returned at free: the resident high-water mark then
    # shows a refit's own buffers instead of malloc reusing an earlier refit's freed arena
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    mp.spawn(_rank, args=(2, port, args.quick, repeats, bucket, out), nprocs=2, join=True)
    r = torch.load(out)
    case = "qwen2-shaped " + ("512x4" if args.quick else "1024x8") + " fp32, FSDP(2)"
    bound = (bucket + -(-r["largest"] // 2)) / 2**20
    rows = [
        row(case=case, metric="engine weight MiB per rank", ours=r["bytes_tp"] / 2**20, baseline=r["bytes_whole"] / 2**20,
            baseline_name="TP=1 (whole engine per rank)", higher_is_better=False),
        row(case=case, metric="refit s", ours=r["times"]["tp"], baseline=r["times"]["full"],
            baseline_name="FSDP -> full copy (gather per bucket, gloo)", higher_is_better=False),
        row(case=case, metric="refit peak extra MiB", ours=r["peaks"]["tp"] / 2**20, baseline=r["peaks"]["full"] / 2**20,
            baseline_name="FSDP -> full copy (gather per bucket)", higher_is_better=False),
        row(case=case, metric="refit peak extra MiB vs bound", ours=r["peaks"]["tp"] / 2**20, baseline=bound,
            baseline_name="bound: one bucket + TP slice of the largest param", higher_is_better=False),
    ]
    budget_gib = 40
    for engine_only, what in ((True, "engine"), (False, "whole job")):
        one, two = _largest_layers(budget_gib * GIB, 1, engine_only), _largest_layers(budget_gib * GIB, 2, engine_only)
        rows.append(row(case=f"qwen2.5-7b shape, 2 ranks bf16, {budget_gib} GiB per rank (hybridrl plan)",
                        metric=f"largest layers whose {what} fits", ours=two, baseline=one,
                        baseline_name="TP=1", higher_is_better=True))
    report(rows, args.json)
    print(goal_line("engine weights per rank TP=2 vs TP=1 (<= 0.55x)", r["bytes_whole"] / r["bytes_tp"], 1 / 0.55))
    print(f"refit peak {r['peaks']['tp'] / 2**20:.1f} MiB vs bound {bound:.1f} MiB: "
          f"{'within' if r['peaks']['tp'] <= bound * 2**20 else 'OVER'}")


if __name__ == "__main__":
    main()
