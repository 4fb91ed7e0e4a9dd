"""vLLM tensor-parallel workers (``torch.multiprocessing.spawn``, 2 ranks, gloo): vLLM's
``external_launcher`` over the trainer's world, one shard per rank; LoRA adapter mode and
merged partial reloads on those shards."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import transformers


def vllm_tp_refit_and_generate(rank: int, world: int, port: int, out: str) -> None:
    """One engine in LoRA adapter mode (rank 4 on every projection), four verified refits:
    (a), (b) whole models with B = 0 adapters: greedy == transformers' a, b; (c) the adapter
    only, B drawn: greedy == the peft model; (d) merged mode's partial reload of W + s·B·A
    with a zero adapter: greedy == the peft model again."""
    from _vllm_helpers import assert_greedy_matches, perturbed

    from hybridrl.lora import apply_lora
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import EngineSpec, SamplingParams
    from hybridrl.rollout.layers.lora_adapter import AdapterSpec
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel
    from hybridrl.trainer.logprobs import logprobs_in_microbatches
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
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_a, lora_b = (apply_lora(copy.deepcopy(m), rank=4, alpha=8.0, dropout=0.0, target_modules=targets)
                      for m in (a, b))
    spec = EngineSpec(max_batch_size=8, max_seq_len=48, lora=AdapterSpec(4, 2.0, tuple(lora_a.targets)))
    engine = VllmEngine(cfg, spec, tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 2], [40, 41, 42, 43]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    result = {}

    def refit_and_compare(name, named, model, partial):
        stats = refit_from_model(engine, named, verify=True, partial=partial)  # reload check + verifier, this shard
        tokens = engine.generate(prompts, greedy).response_token_ids
        for p, t in zip(prompts, tokens):
            assert_greedy_matches(model, p, t)
        result[name] = dict(tokens=tokens, version=stats.version, lora_id=engine.lora_request.lora_int_id)

    try:
        result["held"] = {r.hf_name: tuple(r.held_shape) for r in engine.weight_routes}
        refit_and_compare("a", lora_a.refit_tensors("adapter", full=True), a, partial=False)
        refit_and_compare("b", lora_b.refit_tensors("adapter", full=True), b, partial=False)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for layer in lora_b.layers.values():
                w = layer.lora_B["default"].weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        refit_and_compare("c", lora_b.refit_tensors("adapter", full=False), lora_b.model, partial=True)
        ro = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=11))  # the same on every rank
        trainer, _ = logprobs_in_microbatches(lora_b.model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                              temperature=1.0, max_tokens=4096)
        result["c"]["logprob_gap"] = float(((trainer - ro.logprobs).abs() * ro.response_mask).max())
        zero = [(n, torch.zeros_like(t)) for n, t in lora_b.adapter_tensors()]
        refit_and_compare("d", lora_b.merged_tensors() + zero, lora_b.model, partial=True)
    finally:
        engine.close()
    torch.save(result, f"{out}.{rank}")
    os._exit(0)  # vLLM's shutdown destroyed the group; no C++ teardown of gloo's threads either
