"""vLLM tensor-parallel workers (``torch.multiprocessing.spawn``, 2 ranks, gloo): vLLM's
``external_launcher`` over the trainer's world, one shard per rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers


def vllm_tp_refit_and_generate(rank: int, world: int, port: int, out: str) -> None:
    from _vllm_helpers import assert_greedy_matches, perturbed

    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import EngineSpec, SamplingParams
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel
    from hybridrl.vllm_backend import VllmEngine

    # what the launcher sets for a trainer rank; vLLM's external_launcher reads it too
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the trainer's group, before vLLM
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    a = perturbed(transformers.Qwen2ForCausalLM(cfg), seed=1)
    b = perturbed(a, seed=2)
    engine = VllmEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=48),
                        tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 2], [40, 41, 42, 43]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    result = {}
    try:
        held = {r.hf_name: tuple(r.held_shape) for r in engine.weight_routes}
        for name, model in (("a", a), ("b", b)):
            stats = refit_from_model(engine, model, verify=True)  # reload check + verifier on this rank's shard
            tokens = engine.generate(prompts, greedy).response_token_ids
            for p, t in zip(prompts, tokens):
                assert_greedy_matches(model, p, t)
            result[name] = dict(tokens=tokens, version=stats.version)
        result["held"] = held
    finally:
        engine.close()
    torch.save(result, f"{out}.{rank}")
    os._exit(0)  # vLLM's shutdown destroyed the group; no C++ teardown of gloo's threads either
