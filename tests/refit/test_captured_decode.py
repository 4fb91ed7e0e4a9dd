"""The CPU half of "CUDA-graph replay after an in-place refit" (the GPU half:
``test_cuda_graph_refit.py``, ``tests/rollout/test_cuda_graph.py``), for every refit path.

The engine's decode step is captured once after the first load (``captured_decode.py``:
aliases of every tensor the engine holds, by storage) and replayed after each of two
refits. After each, against a fresh engine loaded with the same weights:

(a) no tensor of the engine moved (the verifier's address records);
(b) the engine's eager decode equals the fresh engine's, bitwise (same kernels, same shapes,
    same values: a refit writes exactly what a first load writes);
(c) the replay over the captured tensors equals it too, bitwise, and read nothing else —
    a refit that rebinds any tensor (a parameter, ``param.data``, a derived cache, the KV
    cache) leaves the replay on stale storage, as it would leave a CUDA graph.

The last tests plant such refits and show that (a) and (c) catch them while (b) — what an
eager-only test sees — does not.
"""
from __future__ import annotations

import random

import _seeds
import pytest
import torch
from torch import nn

import hybridrl.rollout.layers.fp8_linear as fp8_linear
from hybridrl.refit import refit_from_model
from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import EngineSpec, RolloutEngine
from tests.refit import helpers
from tests.refit.captured_decode import CapturedDecode

REFITS = 2
BATCH, PROMPT = 2, 6


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster and avoids OpenMP barrier stalls on a busy
    machine (as in ``tests/rollout/conftest.py``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Trainer:
    """The trainer side of one refit path: an HF model (or LoRA policy) that takes
    optimizer-like steps, what a full load sends and what each later refit sends."""

    partial = False

    def __init__(self, model: nn.Module, seed: int):
        self.model, self.seed = model, seed

    def step(self) -> None:
        self.seed += 1
        helpers.perturb(self.model, self.seed, scale=0.02)

    def full(self) -> list[tuple[str, torch.Tensor]]:
        return named_trainer_tensors(self.model)

    def update(self) -> list[tuple[str, torch.Tensor]]:
        return self.full()


class LoRATrainer(Trainer):
    """Adapters train, the base stays: a refit sends only the adapters or merged targets."""

    partial = True

    def __init__(self, lora, mode: str, seed: int):
        super().__init__(lora.model, seed)
        self.lora, self.mode = lora, mode

    def step(self) -> None:
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for layer in self.lora.layers.values():
                for part in (layer.lora_A, layer.lora_B):
                    w = part["default"].weight
                    w.add_(torch.randn(w.shape, generator=g) * 0.1)

    def full(self):
        return self.lora.refit_tensors(self.mode, full=True)

    def update(self):
        return self.lora.refit_tensors(self.mode, full=False)


def _dense(seed: int, quantization=None):
    cfg = helpers.qwen2_config()  # shard sizes multiples of 128: fp8_block applies
    return Trainer(helpers.hf_model(cfg, seed).float(), seed), lambda: helpers.engine(cfg, quantization)


def _deepseek_v3(seed: int, quantization=None):
    from tests.rollout import _deepseek as ds

    cfg = ds.draw_config(random.Random(seed))
    spec = EngineSpec(max_batch_size=BATCH, max_seq_len=32, dtype=torch.float32, quantization=quantization)
    return Trainer(ds.hf_model(cfg, seed), seed), lambda: RolloutEngine(cfg, spec)


def _deepseek_v4(seed: int, quantization=None):
    from tests.rollout import _deepseek_v4 as v4

    cfg = v4.draw_config(random.Random(seed), num_hidden_layers=3, layer_types=v4.TYPES)
    spec = EngineSpec(max_batch_size=BATCH, max_seq_len=32, dtype=torch.float32, quantization=quantization)
    return Trainer(v4.hf_model(cfg, seed), seed), lambda: RolloutEngine(cfg, spec)


def _lora(seed: int, mode: str, quantization=None):
    from hybridrl.config import LoRAConfig, ModelConfig
    from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
    from hybridrl.lora import apply_lora
    from hybridrl.rollout.layers.lora_adapter import AdapterSpec

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128)
    model = builtin_model(builtin_tokenizer(), ModelConfig(arch="qwen2", **sizes), seed=seed)
    lora = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=LoRAConfig().target_modules)
    trainer = LoRATrainer(lora, mode, seed)
    trainer.step()  # B = 0 at init: move it, so that the adapters change the outputs from the start
    adapter = AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)) if mode == "adapter" else None
    spec = EngineSpec(max_batch_size=BATCH, max_seq_len=32, lora=adapter, quantization=quantization)
    return trainer, lambda: RolloutEngine(lora.model.config, spec)


PATHS = {
    "plain": lambda s: _dense(s),
    "fp8": lambda s: _dense(s, "fp8"),  # fnuz forced below: begin/finish rewrite every scale in place
    "fp8_block": lambda s: _dense(s, "fp8_block"),
    "mla": lambda s: _deepseek_v3(s),  # absorbed w_uk / w_uv: derived caches of kv_b_proj
    "mla_fp8": lambda s: _deepseek_v3(s, "fp8"),  # ... of its FP8 dequantization; MoE expert caches
    "lora_merged_fp8": lambda s: _lora(s, "merged", "fp8"),
    "lora_adapter": lambda s: _lora(s, "adapter"),
    "v4_fp8": lambda s: _deepseek_v4(s, "fp8"),  # the grouped o_a_proj's dequantized cache
}


def _decode(engine, ids, lengths, tokens):
    """Prefill ``ids`` into cache rows [0, B), then one eager decode step: logits [B, V]."""
    engine.runner.prefill(ids, lengths)
    with torch.inference_mode():
        return engine.runner.decode_eager(tokens, lengths, int(lengths.max()) + 1)


def _inputs(engine, seed: int):
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    return (torch.randint(0, vocab, (BATCH, PROMPT), generator=g), torch.randint(2, PROMPT + 1, (BATCH,), generator=g),
            torch.randint(0, vocab, (BATCH,), generator=g))


def _start(path: str, monkeypatch):
    """(seed, trainer, make_engine, the engine after its first load, its captured decode)."""
    monkeypatch.setattr(fp8_linear, "FNUZ_DEFAULT", True)
    seed = _seeds.fresh_seed()
    trainer, make_engine = PATHS[path](seed)
    engine = make_engine()
    refit_from_model(engine, trainer.full(), verify=True)
    return seed, trainer, make_engine, engine, CapturedDecode(engine)


def _refit_and_compare(trainer, make_engine, engine, graph, seed, *, verify=True):
    """One refit; (the fresh engine's logits, the refitted engine's, the replay's, moved, foreign)."""
    trainer.step()
    refit_from_model(engine, trainer.update(), verify=verify, partial=trainer.partial)
    fresh = make_engine()
    refit_from_model(fresh, trainer.full())
    ids, lengths, tokens = _inputs(engine, seed)
    want = _decode(fresh, ids, lengths, tokens)
    eager = _decode(engine, ids, lengths, tokens)
    replayed, foreign = graph.replay(tokens, lengths, int(lengths.max()) + 1)
    return want, eager, replayed, graph.moved(engine), foreign


@pytest.mark.parametrize("path", list(PATHS))
def test_captured_decode_replays_the_new_weights_after_each_refit(path, monkeypatch):
    seed, trainer, make_engine, engine, graph = _start(path, monkeypatch)
    ids, lengths, tokens = _inputs(engine, seed)
    before = _decode(engine, ids, lengths, tokens)
    for k in range(REFITS):
        want, eager, replayed, moved, foreign = _refit_and_compare(trainer, make_engine, engine, graph, seed)
        where = f"{path}, refit {k + 1} (seed {seed})"
        assert not torch.equal(want, before), f"{where}: the step did not change the logits"
        assert not moved, f"{where}: refit moved {moved}"
        assert torch.equal(eager, want), f"{where}: eager decode differs from a fresh load of the same weights"
        assert not foreign, f"{where}: the decode step reads tensors the engine does not hold: {foreign[:3]}"
        assert torch.equal(replayed, want), (f"{where}: replay over the captured tensors differs from a fresh load "
                                             f"by {float((replayed - want).abs().max()):.3g}: a tensor was rebound")
        before = want


# ---- planted rebinding refits: the stand-in catches them, eager decode does not ------------------

def _rebind_parameter_data(engine, monkeypatch):
    """A loader that writes the right values into *new* storage (``param.data = ...``)."""
    name = "model.layers.0.self_attn.o_proj.weight"
    param = engine.weight_routes[name].param
    real = param.weight_loader

    def loader(p, w, shard_id=None):
        p.data = torch.empty_like(p.data)
        real(p, w, shard_id)

    monkeypatch.setattr(param, "weight_loader", loader)
    return engine.weight_routes[name].param_name


def _rebuild_derived_cache(engine, monkeypatch):
    """A derived cache dropped and lazily rebuilt from the new weights instead of refreshed in place."""
    name, cache = next((n, c) for n, c in engine.named_derived_caches() if "down_proj" in n)
    monkeypatch.setattr(cache, "refresh", lambda: setattr(cache.module, cache.attr, cache.expected()))
    return name


@pytest.mark.parametrize("path,plant", [("plain", _rebind_parameter_data), ("fp8", _rebuild_derived_cache),
                                        ("mla", _rebind_parameter_data)])
def test_a_refit_that_rebinds_fails_the_captured_decode(path, plant, monkeypatch):
    """Unverified refits (the verifier's own address check is the other guard, tested in
    ``test_protocol.py``): the stand-in alone must see the rebinding."""
    seed, trainer, make_engine, engine, graph = _start(path, monkeypatch)
    name = plant(engine, monkeypatch)
    want, eager, replayed, moved, foreign = _refit_and_compare(trainer, make_engine, engine, graph, seed,
                                                               verify=False)
    where = f"{path} (seed {seed})"
    assert torch.equal(eager, want), f"{where}: the planted refit should still be right eagerly"
    assert name in moved, f"{where}: {name} rebound but not reported moved: {moved}"
    assert not torch.equal(replayed, want), f"{where}: the replay did not read the stale storage of {name}"


def test_a_lazily_rebuilt_unregistered_copy_is_reported_as_a_foreign_read(monkeypatch):
    """A weight copy the forward keeps in a plain attribute and rebuilds on first use after a
    refit: eager decode is right, no registered tensor moved and the replay (which runs the
    same Python) reads the rebuilt copy — but a graph would hold the copy of capture time.
    Only the record of what the step reads sees it."""
    seed, trainer, make_engine, engine, graph = _start("plain", monkeypatch)
    norm = engine.model.model.norm
    lazy = {"version": None, "copy": None}

    def forward(x):
        if lazy["version"] != engine.weight_version:
            lazy["version"], lazy["copy"] = engine.weight_version, norm.weight.detach().clone()
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), lazy["copy"], norm.eps)

    monkeypatch.setattr(norm, "forward", forward)
    want, eager, replayed, moved, foreign = _refit_and_compare(trainer, make_engine, engine, graph, seed)
    where = f"seed {seed}"
    assert torch.equal(eager, want) and torch.equal(replayed, want) and not moved, where
    hidden = engine.config.hidden_size
    assert any(f"[{hidden}] tensor" in f for f in foreign), f"{where}: not reported: {foreign}"
