"""Routing replay: the engine records its per-token expert choices during generate (through
continuous batching: shared-prompt prefill, requests joining and rows moving as others
finish); transformers replays them."""

import pytest
import torch

from hybridrl.refit import refit_from_model
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.core import running_batch
from hybridrl.rollout.routing import enable_routing_record, hf_routers, replay_routing, routing_of_sequences
from tests.rollout.test_moe import make_moe_config, make_moe_hf_model, moe_engine


def _recording_engine(family="qwen3_moe", max_batch_size=3, **kw):
    cfg = make_moe_config(family)
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, max_batch_size=max_batch_size, **kw)
    recorder = enable_routing_record(engine)  # before the first weight update, as on CUDA
    engine.load_weights(hf.named_parameters())
    return cfg, hf, engine, recorder


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_recorded_routing_is_the_engines_routing_of_every_fed_token(family, monkeypatch):
    cfg, hf, engine, recorder = _recording_engine(family)
    moves = []
    remove = running_batch.RunningBatch.remove
    monkeypatch.setattr(running_batch.RunningBatch, "remove",
                        lambda b, rows, *a: (moves.append(rows) if any(r < b.n - len(rows) for r in rows) else None,
                                             remove(b, rows, *a))[1])
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6], [9], [5, 6, 7]]  # 4 requests x n=2 > max_batch_size: they queue
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11, n=2)
    first = engine.generate(prompts, params)
    recorder.take(first)
    stop = first.response_token_ids[0][1]  # the same seeds again: row 0 stops at its 2nd token
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, seed=11, n=2, stop_token_ids=(stop,)))
    routed = recorder.take(out)
    assert moves, "a finished row should have been refilled by moving the last one (the row -> request map changes)"
    B, L = out.input_ids.shape
    assert routed.shape == (B, L, len(engine.config.moe_layers), engine.config.num_experts_per_tok)
    _, full = routing_of_sequences(engine, out.input_ids, out.attention_mask)
    fed = out.attention_mask.bool().clone()
    fed[torch.arange(B), out.attention_mask.sum(1) - 1] = False  # the last token is never fed
    assert (routed[fed] >= 0).all() and (routed[~fed] == -1).all()
    assert torch.equal(routed[fed], full[fed])
    assert any(r == "stop" for r in out.finish_reasons)


def test_replay_in_transformers_uses_the_recorded_experts_with_the_trainers_weights():
    cfg, hf, engine, recorder = _recording_engine()
    out = engine.generate([[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(temperature=1.0, max_tokens=8, seed=3))
    routed = recorder.take(out)
    ids, mask = out.input_ids, out.attention_mask
    with torch.no_grad():
        plain = hf(input_ids=ids, attention_mask=mask).logits
        with replay_routing(hf, routed):
            replayed = hf(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(plain, replayed)  # fp32 engine == trainer: same choices, same function

    # replay really forces the choices: a shifted routing is what the routers return, and
    # changes the logits; -1 rows (unrecorded) keep the trainer's own top-k
    shifted = torch.where(routed >= 0, (routed + 1) % cfg.num_experts, routed)
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in hf_routers(hf)]
    try:
        with replay_routing(hf, shifted):
            logits = hf(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    flat = shifted.reshape(-1, shifted.shape[2], shifted.shape[3])
    for layer, got in enumerate(seen):
        rows = (flat[:, layer] >= 0).all(-1)
        assert torch.equal(got[rows], flat[rows, layer].long())
    assert not torch.allclose(logits, plain)
    logits[mask.bool()].sum().backward()  # the router still learns under replay
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in hf_routers(hf))
    assert all(r.forward.__qualname__.startswith("Qwen3MoeTopKRouter") for r in hf_routers(hf))  # restored


def test_replay_packed_tokens_and_shape_errors():
    cfg, hf, engine, recorder = _recording_engine()
    out = engine.generate([[3, 1, 4], [9, 2, 6, 5]], SamplingParams(temperature=0, max_tokens=5))
    routed = recorder.take(out)
    with pytest.raises(ValueError, match="recorded tokens"):
        with replay_routing(hf, routed[:1]), torch.no_grad():
            hf(input_ids=out.input_ids, attention_mask=out.attention_mask)
    with pytest.raises(ValueError, match="recorded MoE layers"):
        with replay_routing(hf, routed[:, :, :1]):
            pass
    # one row at a time, as a packed (padding-free) forward would see its tokens
    n = int(out.attention_mask[0].sum())
    with torch.no_grad(), replay_routing(hf, routed[0, :n]):
        one = hf(input_ids=out.input_ids[:1, :n]).logits
        full = hf(input_ids=out.input_ids[:1, :n]).logits
    assert torch.equal(one, full)


def test_routing_buffers_are_static_state_kept_by_refit():
    cfg, hf, engine, recorder = _recording_engine()
    names = {n for n, _ in engine.named_state_tensors()}
    assert {f"model.layers.{i}.mlp.routing_buffer" for i in engine.config.moe_layers} <= names
    ptrs = {n: t.data_ptr() for n, t in engine.named_state_tensors()}
    recorder.take(engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4)))
    refit_from_model(engine, hf, verify=True)  # the verifier's address check covers the buffers
    assert {n: t.data_ptr() for n, t in engine.named_state_tensors()} == ptrs
    assert enable_routing_record(engine) is recorder


def test_enabling_after_graph_capture_is_refused():
    cfg = make_moe_config("qwen3_moe")
    engine = moe_engine(cfg, make_moe_hf_model(cfg))
    engine.runner.graphs = object()  # as if CUDA graphs had been captured without the copies
    with pytest.raises(ValueError, match="already captured"):
        enable_routing_record(engine)


def test_a_continued_conversation_inherits_its_parents_routing_record():
    """The child's record of the retained prefix is the parent's; the whole record equals the
    routing of one full-sequence forward, as for a request prefilled from scratch."""
    cfg, hf, engine, recorder = _recording_engine(max_batch_size=2)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=g).tolist()
    p = SamplingParams(temperature=0.0, max_tokens=6)
    engine.add_request("a", prompt, p, retain=True)
    a = engine.run_until_finished(["a"])["a"]
    child = prompt + a.token_ids + torch.randint(0, cfg.vocab_size, (4,), generator=g).tolist()
    engine.add_request("b", child, p, parent="a")
    b = engine.run_until_finished(["b"])["b"]
    assert b.cached_tokens == len(prompt) + len(a.token_ids) - 1
    ids = torch.tensor([child + b.token_ids])
    _, full = routing_of_sequences(engine, ids, torch.ones_like(ids))
    fed = ids.shape[1] - 1
    assert torch.equal(b.routed_experts[:fed], full[0, :fed]) and (b.routed_experts[fed:] == -1).all()
    assert torch.equal(b.routed_experts[:b.cached_tokens], a.routed_experts[:b.cached_tokens])
