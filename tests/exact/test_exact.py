"""rollout.exact on the job's own models: the built-in engine's log-probs equal the trainer's
recomputation bit for bit (the dense/MoE/MLA/LoRA families drawn per run:
``test_engine_exact*.py``), the batch-invariant ops against float64, the job-level payoff
(no recompute pass, identical metrics with the check on), and the one-line refusals.

Each round trip draws 64 sequences of mixed prompt lengths and mixed response budgets, samples
them through 24 engine rows (rows join and finish at every step), then scores them with the
trainer's own forward (packed, micro-batched) under the same numerics and requires ``==`` on
every response token.
"""

from __future__ import annotations

import json
import random

import _seeds
import pytest
import torch

from _engine_round_trip import assert_bitwise, draw_requests, exact_engine
from hybridrl.config import ModelConfig
from hybridrl.config.base import ConfigError
from hybridrl.exact.ops import exact_logsumexp, padded_linear, pieced_unary
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
from hybridrl.trainer.logprobs import logprobs_in_microbatches

TOK = builtin_tokenizer()
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _exact_round_trip(model, vocab: int, seed: int, *, temperature=1.0, top_p=1.0, max_tokens=(3, 24),
                      device="cpu"):
    prompts, params = draw_requests(random.Random(seed), 64, vocab, temperature=temperature, top_p=top_p,
                                    max_tokens=max_tokens)
    ro = exact_engine(model, max_batch_size=24, max_seq_len=64, device=device).generate(prompts, params)
    assert_bitwise(model, ro, temperature, f"seed {seed}", min_tokens=300)
    return ro


@pytest.mark.parametrize("arch,dtype", [("qwen2", "float32"), ("qwen2", "bfloat16"), ("deepseek_v3", "float32"),
                                        ("deepseek_v3", "bfloat16")])
def test_builtin_models_are_bitwise_on_policy(arch, dtype):
    model = builtin_model(TOK, ModelConfig(arch=arch, dtype=dtype, **SMALL), seed=3)
    _exact_round_trip(model, len(TOK), seed=_seeds.fresh_seed() % 1000)


def test_the_default_job_model_with_top_p_and_temperature():
    model = builtin_model(TOK, ModelConfig(), seed=1)  # model.* defaults: the `make run` job's model
    _exact_round_trip(model, len(TOK), seed=7, temperature=0.7, top_p=0.9)


def test_small_moe_with_shared_expert_is_bitwise():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                         intermediate_size=128, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(5)
    _exact_round_trip(Qwen2MoeForCausalLM(cfg).eval(), 96, seed=11)


def test_qwen2_5_0_5b_shapes_are_bitwise():
    """Qwen2.5-0.5B-Instruct's widths (hidden 896, 14/2 heads of 64, MLP 4864, vocabulary
    151936, tied head, bias on q/k/v) at 2 of its 24 layers: the GEMM, attention and
    vocabulary-reduction shapes of the real model (no checkpoint can be downloaded here)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=2, num_attention_heads=14,
                      num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                      max_position_embeddings=128, rope_theta=1000000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    ro = _exact_round_trip(model, 151936, seed=2, max_tokens=(3, 10))
    # the test can fail: the trainer's own default numerics do not reproduce these bits
    plain, _ = logprobs_in_microbatches(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                        temperature=1.0, max_tokens=700)
    mask = ro.response_mask.bool()
    assert (plain[mask] != ro.logprobs[mask]).any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_on_cuda(dtype):
    """The same ops on CUDA: cuBLAS picks kernels (split-K) by shape, so row padding may not
    be enough there; this test (scripts/gpu_check.sh) says whether it holds on the device.
    A device whose GEMMs are not row-invariant is refused at engine build (one line)."""
    model = builtin_model(TOK, ModelConfig(dtype=dtype, **SMALL), seed=3).cuda()
    _exact_round_trip(model, len(TOK), seed=5, device="cuda")


def test_batch_invariant_ops_against_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 40, generator=g), torch.randn(24, 40, generator=g)
    torch.testing.assert_close(padded_linear(x, w), (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    z = torch.randn(3, 5000, generator=g) * 4
    torch.testing.assert_close(exact_logsumexp(z), torch.logsumexp(z.double(), -1).float(), rtol=1e-6, atol=1e-6)
    v = torch.randn(40001, generator=g)
    torch.testing.assert_close(pieced_unary(torch.nn.functional.silu, v), torch.nn.functional.silu(v.double()).float())
    # a value's bits do not depend on where in the buffer it sits
    assert torch.equal(pieced_unary(torch.sigmoid, v[7:8]), pieced_unary(torch.sigmoid, v)[7:8])


def test_train_step_metrics_identical_with_and_without_the_recompute_pass(tmp_path):
    from hybridrl.cli import main

    base = ["rollout.exact=true", "warm_start.steps=30", "trainer.total_steps=2", "trainer.eval_every=2",
            "rollout.n=4", "batch.prompts_per_step=4", "data.eval_size=8", "eval.k=0", "logging.progress=false",
            "logging.plot=false", "logging.tensorboard=false", "algo.correction.tis_cap=2.0", "algo.kl.coef=0.02",
            f"trainer.output_dir={tmp_path}"]
    assert main(["train", *base, "trainer.run_name=skip"]) == 0
    assert main(["train", *base, "rollout.exact_recompute=true", "trainer.run_name=check"]) == 0
    rows = {}
    for name in ("skip", "check"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))
                       and "tok/s" not in k and k != "actor/exact_mismatched_tokens"} for line in lines]
    assert rows["skip"] == rows["check"]
    step = [r for r in rows["skip"] if "actor/tis_ratio_mean" in r]
    assert step and all(r["actor/tis_ratio_mean"] == 1.0 and r["actor/tis_capped_frac"] == 0.0 for r in step)


@pytest.mark.parametrize("bad,key", [(["rollout.backend=vllm"], "rollout.backend=vllm"),
                                     (["rollout.quantization=fp8"], "rollout.quantization=fp8"),
                                     (["trainer.mode=async"], "trainer.mode=async"),
                                     (["rollout.tensor_parallel_size=2", "launcher.nproc_per_node=2"],
                                      "rollout.tensor_parallel_size=2"),
                                     (["model.arch=deepseek_v4"], "model.arch=deepseek_v4")])
def test_unsupported_combinations_are_one_line_errors(bad, key):
    from hybridrl.config.io import load_config
    from hybridrl.pipeline.build import check_composable
    from hybridrl.pipeline.engines import check_engine_choice

    with pytest.raises(ConfigError, match=key) as e:  # what build_run checks before building anything
        cfg = load_config(None, ["rollout.exact=true", *bad])
        check_engine_choice(cfg)
        check_composable(cfg)
    assert "\n" not in str(e.value) and "rollout.exact=false" in str(e.value)
    with pytest.raises(ConfigError, match="rollout.exact=true"):
        load_config(None, ["rollout.exact_recompute=true"])


@pytest.mark.parametrize("heads,kv_heads,length", [(4, 2, 40), (4, 2, 24), (4, 4, 16), (2, 1, 70)])
def test_exact_attention_backward_matches_float64(heads, kv_heads, length):
    """The trainer's update differentiates through the exact attention: its gradients equal a
    float64 causal softmax attention's (rows G * length a multiple of 16 or not: the stacked
    query rows fill their tiles exactly or are padded)."""
    from hybridrl.exact.attention import sequence_attention

    g = torch.Generator().manual_seed(_seeds.fresh_seed())
    q = torch.randn(1, heads, length, 16, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, length, 16, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, length, 16, generator=g, requires_grad=True)
    w = torch.randn(1, heads, length, 16, generator=g)
    zero = torch.zeros(1, dtype=torch.long)
    (sequence_attention(q, k, v, scale=0.25, q_offset=zero, k_len=zero + length) * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = heads // kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1), is_causal=True, scale=0.25)
    (out * w.double()).sum().backward()
    for a, b in zip(got, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
