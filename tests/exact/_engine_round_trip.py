"""The built-in engine under exact numerics vs the trainer's recomputation: shared by the
per-family tests (``test_engine_exact*.py``).

``round_trip`` samples requests of mixed prompt lengths and budgets through a
``RolloutEngine(EngineSpec(exact=True))`` loaded from ``model`` (a transformers causal LM, the
trainer's policy), then scores every sampled sequence with the trainer's own packed forward
under ``hybridrl.exact.batch_invariant`` and requires ``==`` on every response token. The
reference shares no code path with the engine's model: transformers' modules, one packed
whole-sequence forward per micro-batch, vs the engine's fused layers, slot cache, continuous
batching, decode steps and (small ``max_prefill_tokens``) chunked prefill.
"""

from __future__ import annotations

import random

import torch

from hybridrl.exact import batch_invariant
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.trainer.logprobs import logprobs_in_microbatches


def exact_engine(model, *, max_batch_size: int = 24, max_seq_len: int = 64, max_prefill_tokens: int = 2048,
                 **spec) -> RolloutEngine:
    """A built-in engine with exact numerics holding ``model``'s weights (one refit)."""
    dtype = next(model.parameters()).dtype
    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                                    dtype=dtype, exact=True, **spec),
                           max_prefill_tokens=max_prefill_tokens)
    engine.begin_weight_update()
    engine.load_weights(model.state_dict().items())
    engine.finish_weight_update()
    return engine


def draw_requests(rng: random.Random, n: int, vocab: int, *, temperature: float = 1.0, top_p: float = 1.0,
                  prompt_len: tuple[int, int] = (2, 20), max_tokens: tuple[int, int] = (3, 24)):
    """``n`` random prompts (ids in [1, vocab)) and their sampling params (seed = index)."""
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=rng.randint(*max_tokens), seed=s)
              for s in range(n)]
    return prompts, params


def trainer_logprobs(model, ro, temperature: float) -> torch.Tensor:
    """The trainer's old-log-prob pass over ``ro`` under exact numerics, ``[B, L]`` float32."""
    dev = next(model.parameters()).device
    with torch.no_grad(), batch_invariant():
        old, _ = logprobs_in_microbatches(model, ro.input_ids.to(dev), ro.attention_mask.to(dev),
                                          ro.response_mask.to(dev), temperature=temperature, max_tokens=700)
    return old.cpu()


def assert_bitwise(model, ro, temperature: float, what: str = "", min_tokens: int = 100) -> None:
    """Every response token's rollout log-prob == the trainer's, bit for bit."""
    old, mask = trainer_logprobs(model, ro, temperature), ro.response_mask.bool()
    assert int(mask.sum()) >= min_tokens, f"{what}: only {int(mask.sum())} response tokens"
    assert ro.logprobs[mask].abs().sum() > 0, f"{what}: the rollout log-probs are all zero"
    differ = old[mask] != ro.logprobs[mask]
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {int(mask.sum())} tokens differ from the trainer's, "
                              f"max {float((old - ro.logprobs)[mask].abs().max()):.3g}")


def round_trip(model, seed: int, *, n: int = 64, temperature: float = 1.0, top_p: float = 1.0, what: str = "",
               **engine_kwargs):
    """Sample ``n`` requests through an exact engine and check them against the trainer; the rollouts."""
    rng = random.Random(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts, params = draw_requests(rng, n, vocab, temperature=temperature, top_p=top_p)
    ro = exact_engine(model, **engine_kwargs).generate(prompts, params)
    assert_bitwise(model, ro, temperature, what)
    return ro


def chunked_round_trip(model, seed: int, what: str = "") -> None:
    """24 requests through 8 rows, prompts up to 7x a prefill budget of 8 tokens: prefilled
    in chunks between other rows' decode steps; bitwise == the trainer."""
    prompts, params = draw_requests(random.Random(seed), 24, model.get_output_embeddings().weight.shape[0],
                                    prompt_len=(4, 56), max_tokens=(3, 16))
    engine = exact_engine(model, max_batch_size=8, max_seq_len=80, max_prefill_tokens=8)
    assert engine.chunked_prefill
    assert_bitwise(model, engine.generate(prompts, params), 1.0, what)


def continuation_round_trip(model, seed: int, what: str = "", *, max_batch_size: int = 8) -> None:
    """6 conversations: turn 1 retained, turn 2 = turn 1 + new tokens extends its cached KV (no
    re-prefill); turn 2's log-probs == the trainer scoring the whole conversation."""
    from hybridrl.rollout.rollouts import rollouts_from_outputs

    rng = random.Random(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    engine = exact_engine(model, max_batch_size=max_batch_size, max_seq_len=96)
    firsts = [f"t1-{i}" for i in range(6)]
    for i, rid in enumerate(firsts):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 20))]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(2, 10), seed=i), retain=True)
    turn1 = engine.run_until_finished(firsts)
    seconds = [f"t2-{i}" for i in range(6)]
    for i, (rid, nid) in enumerate(zip(firsts, seconds)):
        o = turn1[rid]
        follow = o.prompt_token_ids + o.token_ids + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 12))]
        engine.add_request(nid, follow, SamplingParams(max_tokens=rng.randint(3, 12), seed=100 + i), parent=rid)
    turn2 = engine.run_until_finished(seconds)
    assert all(turn2[r].cached_tokens > 0 for r in seconds), f"{what}: the continuations did not reuse the prefix"
    assert_bitwise(model, rollouts_from_outputs([turn2[r] for r in seconds]), 1.0, what, min_tokens=18)


def build_drawn(classes: tuple, family: str, fields: dict, seed: int, dtype: torch.dtype):
    """(model, description) of a drawn config: ``classes`` = (config class, model class),
    random init from ``seed``, cast as ``from_pretrained`` would leave it."""
    from hybridrl.job.model_factory import cast_as_loaded

    config_cls, model_cls = classes
    torch.manual_seed(seed)
    model = cast_as_loaded(model_cls(config_cls(**fields)), dtype).eval()
    return model, f"{family} {dtype} seed={seed} {fields}"
