"""Static memory: the KV cache never moves or grows; compaction keeps results exact."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from tests.rollout.conftest import make_config, make_hf_model


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def measure_many_calls() -> dict:
    """250 generate calls of varying shapes; the last 200's growth of live tensors and of
    resident memory, and whether any state tensor moved."""
    torch.set_num_threads(1)
    cfg = make_config("llama")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32))
    engine.load_weights(make_hf_model(cfg).named_parameters())
    addresses = {name: t.data_ptr() for name, t in engine.named_state_tensors()}
    g = torch.Generator().manual_seed(0)

    def call(i):
        n = 1 + i % 4
        prompts = [torch.randint(0, 100, (1 + (i + b) % 7,), generator=g).tolist() for b in range(n)]
        engine.generate(prompts, SamplingParams(max_tokens=1 + i % 9, stop_token_ids=(7,), seed=i))

    for i in range(50):  # warm up allocator caches
        call(i)
    gc.collect()
    rss, tensors = _rss_bytes(), _live_tensors()
    for i in range(200):
        call(i)
    gc.collect()
    return {"moved": {name: t.data_ptr() for name, t in engine.named_state_tensors()} != addresses,
            "tensor_growth": _live_tensors() - tensors, "rss_growth": _rss_bytes() - rss}


def test_cache_static_and_memory_stable_over_many_calls():
    """Measured in a fresh process: resident memory is the whole process's, and threads
    other tests leave behind in a shared pytest process (an in-process vLLM engine's) move
    it by tens of MiB on their own."""
    code = "import json; from tests.rollout.test_memory import measure_many_calls; print(json.dumps(measure_many_calls()))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert not m["moved"]
    assert m["tensor_growth"] <= 0
    assert m["rss_growth"] < 8 * 2**20, f"resident memory grew by {m['rss_growth']} bytes over 200 generate calls"


def test_compaction_keeps_rows_exact():
    """Rows finishing early (short max_tokens) get compacted out; the long rows must
    produce exactly what they produce alone (greedy and seeded sampling)."""
    cfg = make_config("qwen2")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=48))
    engine.load_weights(make_hf_model(cfg).named_parameters())
    prompts = [[1 + b, 2 * b + 3, 40 - b][: 1 + b % 3] for b in range(8)]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=b, max_tokens=2 if b % 4 else 20)
                  for b in range(8)]
        batch = engine.generate(prompts, params)
        for b in (0, 4):
            alone = engine.generate([prompts[b]], params[b])
            assert batch.response_token_ids[b] == alone.response_token_ids[0]
            torch.testing.assert_close(batch.logprobs[b, :len(prompts[b]) + 20],
                                       alone.logprobs[0, :len(prompts[b]) + 20], rtol=1e-5, atol=1e-5)


def test_padded_logits_mask_is_built_at_the_memory_floor(monkeypatch):
    """A left-padded `logits()` call builds its [B, 1, S, S] mask with `attention.masks.sdpa_mask`
    (output + O(B*S)), not S x S temporaries; right padding builds no mask at all."""
    import hybridrl.rollout.model_runner as model_runner

    calls = []
    real = model_runner.sdpa_mask
    monkeypatch.setattr(model_runner, "sdpa_mask", lambda m: calls.append(tuple(m.shape)) or real(m))
    cfg = make_config("qwen2")
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=32))
    engine.load_weights(make_hf_model(cfg).named_parameters())
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    right = torch.ones_like(ids)
    right[1, 6:] = 0
    engine.logits(ids, right)
    assert calls == []
    left = torch.ones_like(ids)
    left[0, :3] = 0
    engine.logits(ids, left)
    assert calls == [(2, 9)]
