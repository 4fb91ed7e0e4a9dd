"""LoRA RL: engine log-probs with the adapter (both modes) vs the trainer's peft model,
B = 0 gives the base's tokens, the reference is the base, partial refits are verified,
export loads in peft, bad input is one line."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from hybridrl.config import LoRAConfig, ModelConfig
from hybridrl.config.base import ConfigError
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
from hybridrl.lora import apply_lora
from hybridrl.pipeline.engines import check_engine_choice
from hybridrl.refit import RefitError, refit_from_model
from tests.trainer._tiny import sampled_batch
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.layers.lora_adapter import AdapterSpec
from hybridrl.trainer.logprobs import logprobs_in_microbatches
from hybridrl.trainer.reference import Reference

TOK = builtin_tokenizer()
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _policy(arch: str, *, seed: int, random_b: bool = True, rank: int = 4):
    torch.manual_seed(seed)
    model = builtin_model(TOK, ModelConfig(arch=arch, **SIZES), seed=seed)
    base = copy.deepcopy(model)
    lora = apply_lora(model, rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=LoRAConfig().target_modules)
    if random_b:  # B = 0 at init: draw it so that the adapter changes the outputs
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in lora.layers.values():
                w = layer.lora_B["default"].weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    return base, lora


def _engine(lora, mode: str, quantization=None) -> RolloutEngine:
    spec = AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)) if mode == "adapter" else None
    engine = RolloutEngine(lora.model.config, EngineSpec(max_batch_size=16, max_seq_len=48, lora=spec,
                                                         quantization=quantization))
    refit_from_model(engine, lora.refit_tensors(mode, full=True), verify=True)
    return engine


def _adapter_step(lora, seed: int) -> None:
    """An optimizer-like step: every adapter matrix (A and B) moves, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.layers.values():
            for part in (layer.lora_A, layer.lora_B):
                w = part["default"].weight
                w.add_(torch.randn(w.shape, generator=g) * 0.1)


def _held(engine, names) -> dict[str, torch.Tensor]:
    """What the engine holds for each HF name now (FP8: the dequantization), copied."""
    return {n: engine.weight_routes[n].held().clone() for n in names}


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Mixed lengths: arithmetic prompts of 1..4-digit operands."""
    out = []
    for _ in range(n):
        a, b = rng.randrange(10 ** rng.randint(1, 4)), rng.randrange(10 ** rng.randint(1, 4))
        out.append(TOK.encode(f"{a}+{b}="))
    return out


@pytest.mark.parametrize("mode", ["adapter", "merged"])
@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v3", "deepseek_v4"])
def test_engine_logprobs_with_the_adapter_match_the_peft_model(arch, mode):
    seed = random.randrange(1 << 16)
    _, lora = _policy(arch, seed=seed)
    engine = _engine(lora, mode)
    # a second, partial refit after an optimizer-like change of the adapters
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.lora_A["default"].weight.mul_(1.1)
    stats = refit_from_model(engine, lora.refit_tensors(mode, full=False), verify=True, partial=True)
    assert stats.num_tensors == len(lora.targets) * (2 if mode == "adapter" else 1)
    ro = engine.generate(_prompts(random.Random(seed), 6), SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=seed))
    trainer, _ = logprobs_in_microbatches(lora.model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                          temperature=1.0, max_tokens=4096)
    gap = ((trainer - ro.logprobs).abs() * ro.response_mask).max()
    assert gap <= 1e-5, f"{arch} {mode}: max |engine - trainer| log-prob {float(gap):.2e} (seed {seed})"


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_zero_b_init_samples_exactly_the_base_models_tokens(mode):
    seed = random.randrange(1 << 16)
    base, lora = _policy("qwen2", seed=seed, random_b=False)
    plain = RolloutEngine(base.config, EngineSpec(max_batch_size=16, max_seq_len=48))
    refit_from_model(plain, base)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=seed)
    prompts = _prompts(random.Random(seed), 5)
    a, b = plain.generate(prompts, params), _engine(lora, mode).generate(prompts, params)
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v3"])
def test_reference_under_disable_adapter_is_the_separately_loaded_base(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    seed = random.randrange(1 << 16)
    base, lora = _policy(arch, seed=seed)
    base.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    ro = _engine(lora, "adapter").generate(_prompts(random.Random(seed), 4),
                                           SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=seed))
    ref = Reference(lora.model, temperature=1.0, max_tokens_per_microbatch=4096, adapter_off=lora.adapter_disabled)
    expected, _ = logprobs_in_microbatches(loaded, ro.input_ids, ro.attention_mask, ro.response_mask,
                                           temperature=1.0, max_tokens=4096)
    got = ref.log_probs(ro.input_ids, ro.attention_mask, ro.response_mask)
    assert torch.equal(got, expected)
    policy, _ = logprobs_in_microbatches(lora.model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                         temperature=1.0, max_tokens=4096)
    assert ((policy - got).abs() * ro.response_mask).max() > 1e-3  # the adapter is on outside the context


def test_adapter_refit_sends_only_the_adapters_and_a_stale_adapter_fails_the_verifier(monkeypatch):
    seed = random.randrange(1 << 16)
    _, lora = _policy("qwen2", seed=seed)
    engine = _engine(lora, "adapter")
    full = sum(t.numel() * t.element_size() for _, t in lora.refit_tensors("adapter", full=True))
    before = _held(engine, [n for n, _ in lora.adapter_tensors()])
    _adapter_step(lora, seed + 2)  # new adapters: a refit that writes nothing cannot pass below
    sent = lora.adapter_tensors()
    stats = refit_from_model(engine, lora.refit_tensors("adapter", full=False), verify=True, partial=True)
    assert stats.bytes_moved == sum(t.numel() * t.element_size() for _, t in sent) < full / 5
    assert engine.weight_version == 2
    for name, t in sent:
        held = engine.weight_routes[name].held()
        assert torch.equal(held, t.to(held.dtype)), f"{name}: the engine holds not the sent adapter (seed {seed})"
        assert not torch.equal(held, before[name]), f"{name}: unchanged by the refit (seed {seed})"
    # an adapter left in place (its loader writes nothing) is caught: version unchanged
    adapter = engine.model.model.layers[0].self_attn.qkv_proj.adapter
    monkeypatch.setattr(adapter.lora_B, "weight_loader", lambda p, w, shard_id: None)
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.lora_B["default"].weight.add_(0.5)
    with pytest.raises(RefitError, match="checksum|differ|mismatch"):
        refit_from_model(engine, lora.refit_tensors("adapter", full=False), verify=True, partial=True)
    assert engine.weight_version == 2
    # a partial refit that leaves an adapter out is refused: nothing committed
    with pytest.raises(RefitError, match="never sent|incomplete"):
        from hybridrl.refit import Refit

        names = lora.adapter_tensors()
        refit = Refit(engine).begin([n for n, _ in names], partial=True)
        refit.load(names[:-1])
        refit.finish()
    assert engine.weight_version == 2


def test_merged_refit_requantizes_fp8_rollout_weights():
    """After a training step the merged refit must write W + scale·B·A *of the new adapters*,
    re-quantized: every targeted weight the engine holds is then exactly dequant(quant(new
    merged W)) — what ``expected_held`` computes from the sent tensor — and differs from what
    it held before; and the engine samples with exactly those weights."""
    seed = random.randrange(1 << 16)
    _, lora = _policy("qwen2", seed=seed)
    engine = _engine(lora, "merged", quantization="fp8")
    routes = engine.weight_routes
    before = _held(engine, [n for n, _ in lora.merged_tensors()])
    _adapter_step(lora, seed + 2)
    merged = lora.merged_tensors()
    want = {n: routes[n].expected_held(t) for n, t in merged}  # the new merged weight through FP8
    unchanged = [n for n, w in want.items() if torch.equal(w, before[n])]
    assert not unchanged, f"precondition: the step is lost in FP8 rounding for {unchanged} (seed {seed})"
    stats = refit_from_model(engine, lora.refit_tensors("merged", full=False), verify=True, partial=True)
    assert stats.num_tensors == len(lora.targets)
    for name in want:
        assert torch.equal(routes[name].held(), want[name]), \
            f"{name}: the engine holds not the new merged FP8 weight (seed {seed})"
    # it samples with them: log-probs equal the merged model whose linear weights are the
    # engine's FP8 dequantization (the exact path; the bound is fp32 rounding, as above)
    ro = engine.generate(_prompts(random.Random(seed), 4), SamplingParams(temperature=1.0, max_tokens=6, n=2,
                                                                          seed=seed))
    reference = lora.merged_copy()
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for route in routes:
            if route.layer is not None:  # an FP8 linear weight: held() is its dequantization
                params[route.hf_name].copy_(route.held())
    expected, _ = logprobs_in_microbatches(reference, ro.input_ids, ro.attention_mask, ro.response_mask,
                                           temperature=1.0, max_tokens=4096)
    gap = ((expected - ro.logprobs).abs() * ro.response_mask).max()
    assert gap <= 1e-5, f"max |engine - FP8-weight model| log-prob {float(gap):.2e} (seed {seed})"


def test_the_optimizer_holds_state_for_the_adapters_alone(tmp_path):
    """docs/lora.md: "Only the adapters require grad; AdamW holds state for them alone" (no
    ``modules_to_save``: nothing else trains). Built as the job builds it (``build_run`` with
    ``model.lora.rank > 0``, then its warm start, which trains the *base* with the adapters
    off), one actor update: the optimizer's groups and state are exactly the lora_A / lora_B
    weights, and the base is bitwise unchanged while the adapters moved."""
    from hybridrl.config.io import load_config
    from hybridrl.job.build import build_run
    from hybridrl.job.loop import warm_start
    from hybridrl.lora.policy import is_adapter
    from tests.trainer._tiny import TINY_MODEL

    seed = random.randrange(1 << 20)
    cfg = load_config(None, TINY_MODEL + [
        "model.lora.rank=4", f"trainer.seed={seed}", "warm_start.steps=2", "trainer.threads=1",
        "data.train_size=64", "data.eval_size=8", "logging.tensorboard=false", f"trainer.output_dir={tmp_path}",
        "checkpoint.save=false"])
    run = build_run(cfg, console=lambda s: None)
    try:
        warm_start(run, cfg)  # the base trains here (its own optimizer), then is frozen again
        actor, lora = run.step.actor, run.lora
        names = {id(p): n for n, p in actor.model.named_parameters()}
        adapters = {id(part["default"].weight) for layer in lora.layers.values()
                    for part in (layer.lora_A, layer.lora_B)}
        assert len(adapters) == 2 * len(lora.targets) and all(is_adapter(names[i]) for i in adapters)
        trainable = {names[id(p)] for p in actor.model.parameters() if p.requires_grad}
        assert trainable == {names[i] for i in adapters}, f"trainable besides the adapters (seed {seed})"
        grouped = [id(p) for g in actor.optimizer.param_groups for p in g["params"]]
        assert len(grouped) == len(set(grouped)) and set(grouped) == adapters, \
            (f"optimizer groups: {sorted(names[i] for i in set(grouped) - adapters)[:3]} beyond the adapters, "
             f"{sorted(names[i] for i in adapters - set(grouped))[:3]} missing (seed {seed})")
        base = {n: p.detach().clone() for n, p in actor.model.named_parameters() if id(p) not in adapters}
        before = {i: actor.model.get_parameter(names[i]).detach().clone() for i in adapters}
        step = run.step
        step.update(sampled_batch(step, seed, random_advantages=True))
        held = {id(p): s for p, s in actor.optimizer.state.items()}
        assert set(held) == adapters, (f"optimizer state for {sorted(names[i] for i in set(held) - adapters)[:3]}"
                                       f" beyond the adapters (seed {seed})")
        for i, state in held.items():
            p = actor.model.get_parameter(names[i])
            assert state["exp_avg"].shape == state["exp_avg_sq"].shape == p.shape, names[i]
        params = dict(actor.model.named_parameters())
        moved = [n for n, t in base.items() if not torch.equal(params[n], t)]
        assert not moved, f"base weights changed by the actor's step: {moved[:3]} (seed {seed})"
        assert any(not torch.equal(params[names[i]], before[i]) for i in adapters), f"no adapter moved (seed {seed})"
    finally:
        run.step.scorer.close()
        run.directory.close()


def test_bad_lora_settings_are_one_line_errors():
    from hybridrl.config.io import load_config

    model = builtin_model(TOK, ModelConfig(arch="deepseek_v3", **SIZES))
    with pytest.raises(ConfigError, match=r"match no module.*linear modules are .*kv_b_proj.*q_proj"):
        apply_lora(model, rank=4, alpha=8, dropout=0, target_modules=["qkv"])
    with pytest.raises(ConfigError, match="fused 3-D parameters"):
        apply_lora(copy.deepcopy(model), rank=4, alpha=8, dropout=0, target_modules=["experts"])
    with pytest.raises(ConfigError, match=r"model.lora.rank=999 exceeds .*q_proj"):
        apply_lora(copy.deepcopy(model), rank=999, alpha=8, dropout=0, target_modules=["q_proj"])
    lora = apply_lora(model, rank=4, alpha=8, dropout=0, target_modules=["kv_b_proj"])
    with pytest.raises(ValueError, match="cannot apply an adapter to .*kv_b_proj.*lora_mode=merged"):
        RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=16,
                                               lora=AdapterSpec(4, 2.0, tuple(lora.targets))))
    for bad, key in ((["rollout.backend=vllm", "rollout.kv_on_refit=keep"], "rollout.kv_on_refit=recompute"),
                     (["rollout.backend=vllm", "rollout.lora_mode=merged", "model.lora.target_modules=[q_proj]"],
                      "splits vLLM's fused"),
                     (["rollout.quantization=fp8"], "lora_mode=merged"),
                     (["model.lora.init=pissa"], "model.lora.init"),
                     (["rollout.lora_mode=both"], "rollout.lora_mode")):
        with pytest.raises(ConfigError, match=key) as e:  # at config load, or by the engine factory
            check_engine_choice(load_config(None, ["model.lora.rank=4", *bad]))
        assert "\n" not in str(e.value)


def test_export_writes_a_peft_adapter_folder_and_the_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridrl.cli import main

    run = ["model.lora.rank=4", "warm_start.steps=20", "trainer.total_steps=2", "trainer.eval_every=2",
           "rollout.n=4", "batch.prompts_per_step=4", "data.eval_size=8", "eval.k=0", "logging.progress=false",
           "logging.plot=false", "logging.tensorboard=false", "optim.lr=3e-2", f"trainer.output_dir={tmp_path}",
           "trainer.run_name=r"]
    assert main(["train", *run]) == 0
    checkpoint = tmp_path / "r" / "checkpoint"
    assert not (checkpoint / "model.safetensors").exists()  # the adapters only
    # two RL steps at this size barely move B: draw it, so that the merge is not the base
    from safetensors.torch import load_file, save_file

    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    adapter = {k: torch.randn_like(v) * 0.1 if "lora_B" in k else v for k, v in adapter.items()}
    save_file(adapter, str(checkpoint / "adapter_model.safetensors"))
    assert main(["export", str(checkpoint), str(tmp_path / "exp"), "--merged"]) == 0
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "exp" / "base", local_files_only=True)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "exp" / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exp" / "merged", local_files_only=True)
    x = torch.randint(1, len(TOK), (3, 11))
    with torch.no_grad():
        a, b = peft(input_ids=x).logits, merged(input_ids=x).logits
        with peft.disable_adapter():
            c = peft(input_ids=x).logits
    assert (a - b).abs().max() < 1e-4
    assert (a - c).abs().max() > 1e-3  # the adapter is applied
    assert main(["export", str(checkpoint), str(tmp_path / "exp")]) == 2  # exists: one line, no partial folder
    from hybridrl.trainer.pretrained import check_checkpoint

    with pytest.raises(ValueError, match="LoRA adapter checkpoint.*hybridrl export"):
        check_checkpoint(str(checkpoint))
