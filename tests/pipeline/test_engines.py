"""The run's engine from its config (``hybridrl/pipeline/engines.py``): ``rollout.kv_cache_mb``
sizes the built-in engine's rows; a KV cache that cannot fit is refused in the config's keys."""

import pytest
import torch

from hybridrl.config.io import load_config
from hybridrl.pipeline.engines import build_engine
from hybridrl.rollout import SamplingParams
from tests.rollout.conftest import make_config, make_hf_model

LONGEST_PROMPT = 8


def _engine(overrides, hf_config):
    cfg = load_config(None, ["batch.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=24", *overrides])
    return build_engine(cfg, hf_config, device=torch.device("cpu"), ranks=1, longest_prompt=LONGEST_PROMPT)


def test_kv_cache_mb_sizes_the_engine_rows_and_the_rest_wait():
    hf = make_config("qwen2")  # KV: 2 layers x (k, v) x 2 heads x 16 x 4 bytes = 512 bytes a token
    full = _engine([], hf)
    assert full.max_batch_size == 16 and full.memory.cache_row(LONGEST_PROMPT + 24) == 16 << 10
    assert _engine(["rollout.kv_cache_mb=1"], hf).max_batch_size == 16  # 64 rows fit: more than a step needs
    long = ["rollout.max_tokens=504"]  # a row of 512 tokens is 256 KiB: 1 MiB holds 4 rows
    full, budget = _engine(long, hf), _engine([*long, "rollout.kv_cache_mb=1"], hf)
    kv = sum(t.numel() * t.element_size() for _, t in budget.runner.kv_cache.named_tensors())
    assert budget.max_batch_size == 4 and kv == 1 << 20
    weights = list(make_hf_model(hf).named_parameters())
    full.load_weights(weights)
    budget.load_weights(weights)
    prompts = [[1 + i, 2 + i, 3][: 1 + i % 3] for i in range(4)]
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3)  # 16 responses through 4 rows
    a, b = full.generate(prompts, params), budget.generate(prompts, params)
    assert a.response_token_ids == b.response_token_ids
    torch.testing.assert_close(a.logprobs, b.logprobs)


def test_kv_cache_mb_smaller_than_one_row_is_one_line():
    with pytest.raises(ValueError) as e:  # a row of 2056 tokens: 1028 KiB of KV cache
        _engine(["rollout.kv_cache_mb=1", "rollout.max_tokens=2048"], make_config("qwen2"))
    assert str(e.value) == ("rollout.kv_cache_mb=1 holds no engine row of 2056 tokens (one row's KV cache is "
                            "1.0 MiB); raise it to at least 2 or lower rollout.max_tokens=2048")


@pytest.mark.parametrize("overrides, says", [
    (["rollout.kv_cache_mb=-1"], "rollout.kv_cache_mb=-1"),
    (["rollout.kv_cache_mb=64", "rollout.backend=vllm"], "with rollout.backend=vllm leave it at 0"),
])
def test_kv_cache_mb_is_validated(overrides, says):
    with pytest.raises(ValueError, match=says):
        load_config(None, overrides)


def test_too_big_for_memory_names_the_keys(monkeypatch):
    import hybridrl.rollout.core.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: (16 << 20, "test's figure"))
    with pytest.raises(ValueError) as e:
        _engine(["rollout.max_tokens=4000"], make_config("qwen2"))
    msg = str(e.value)
    assert msg.startswith("rollout.max_tokens=4000: the built-in engine's 16 rows x 4008 tokens needs "), msg
    assert "but 16.0 MiB is available (test's figure); lower rollout.max_tokens to at most " in msg
    assert ", or set rollout.kv_cache_mb=" in msg and "rows at a time" in msg
    assert msg.endswith(", or sample fewer responses per step (batch.prompts_per_step, rollout.n)")
    # the suggested budget is one that fits
    mb = int(msg.split("rollout.kv_cache_mb=")[1].split()[0])
    assert _engine(["rollout.max_tokens=4000", f"rollout.kv_cache_mb={mb}"], make_config("qwen2")).max_batch_size >= 1


def test_plan_counts_only_the_rows_the_budget_holds(capsys):
    """``hybridrl plan`` sizes the KV cache as the engine does: the rows that fit the budget."""
    from hybridrl.cli import main
    from hybridrl.distributed.plan import GiB, kv_cache_bytes, shape_config

    args = ["plan", "--shape", "qwen2.5-0.5b", "rollout.max_tokens=1024"]
    seq_len = load_config(None, args[3:]).data.max_prompt_length + 1024
    row = kv_cache_bytes(shape_config("qwen2.5-0.5b"), batch=1, seq_len=seq_len, dtype=torch.float32)
    for extra, rows in (([], 256), (["rollout.kv_cache_mb=100"], (100 << 20) // row)):
        assert main(args + extra) == 0
        kv = next(line for line in capsys.readouterr().out.splitlines() if "KV cache" in line)
        assert kv.split()[-2] == f"{rows * row / GiB:.3f}", (extra, kv)
