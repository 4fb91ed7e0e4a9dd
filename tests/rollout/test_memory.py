"""Static memory: the KV cache never moves or grows; compaction keeps results exact."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from tests.rollout.conftest import make_config, make_hf_model


def _live_tensors() -> tuple[int, int]:
    """(count, bytes of their distinct storages) of the tensors Python holds."""
    storages = {}
    count = 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            count += 1
            try:
                st = o.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # meta / sparse tensors
                pass
    return count, sum(storages.values())


def measure_many_calls() -> dict:
    """250 generate calls of varying shapes; over the last 200: whether a state tensor moved,
    the growth of live tensors (count, bytes) and of the objects Python's collector tracks
    (every container: a list or dict left behind per call shows as one each)."""
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

    for i in range(50):  # warm up caches (prefix cache, sampler tables)
        call(i)
    gc.collect()
    objects, (tensors, tensor_bytes) = len(gc.get_objects()), _live_tensors()
    for i in range(200):
        call(i)
    gc.collect()
    count, nbytes = _live_tensors()
    return {"moved": {name: t.data_ptr() for name, t in engine.named_state_tensors()} != addresses,
            "tensor_growth": count - tensors, "tensor_byte_growth": nbytes - tensor_bytes,
            "object_growth": len(gc.get_objects()) - objects}


def test_cache_static_and_memory_stable_over_many_calls():
    """Counted, not read off resident memory (which the allocator and other tests' threads
    move by MiBs on their own); in a fresh process, where nothing else (pytest's log capture)
    keeps objects per call."""
    code = "import json; from tests.rollout.test_memory import measure_many_calls; print(json.dumps(measure_many_calls()))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert not m["moved"]
    assert m["tensor_growth"] <= 0 and m["tensor_byte_growth"] <= 0, m
    # measured 0 (native, avx2); one container left behind per call is +200 (checked)
    assert m["object_growth"] < 50, m


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
    import hybridrl.rollout.core.model_runner as model_runner

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


# ---- the build-time check (rollout/core/memory.py): too big is one line, before allocating ----------------

def _allocated(engine) -> tuple[int, int, int]:
    """(weights, KV cache, per-slot row buffers + routing record) bytes the engine really holds."""
    from hybridrl.rollout.core.memory import weight_bytes

    kv = sum(t.numel() * t.element_size() for _, t in engine.runner.kv_cache.named_tensors())
    b = engine.scheduler.batch
    rows = [b.uniforms, b.out_tokens, b.out_logprobs]
    if engine.routing_recorder is not None:
        rows.append(engine.routing_recorder.record)
    return weight_bytes(engine.model), kv, sum(t.numel() * t.element_size() for t in rows)


def _deepseek_v4_config():
    import random

    from tests.rollout._deepseek_v4 import draw_config

    return draw_config(random.Random(0))


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3", "deepseek_v4"])
def test_counted_footprint_is_what_the_engine_allocates(family):
    """The check counts from shapes and a meta-device model what the build then allocates."""
    from tests.rollout._deepseek import config as deepseek_v3_config

    cfg = {"deepseek_v3": deepseek_v3_config, "deepseek_v4": _deepseek_v4_config}.get(
        family, lambda: make_config(family))()
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=3, max_seq_len=40), record_routing=family == "deepseek_v3")
    m = engine.memory
    assert _allocated(engine) == (m.weights, 3 * m.cache_row(40), 3 * m.buffers_row(40))
    assert m.total(3, 40) == sum(_allocated(engine))


def test_an_engine_that_cannot_fit_refuses_in_one_line_before_allocating(monkeypatch):
    import hybridrl.rollout.engine as engine_module
    import hybridrl.rollout.core.memory as memory
    import hybridrl.rollout.core.model_runner as model_runner
    from hybridrl.rollout.core.memory import EngineMemoryError

    built = []
    real_build = engine_module.build_model
    monkeypatch.setattr(engine_module, "build_model", lambda *a, **k: built.append(a[4]) or real_build(*a, **k))
    monkeypatch.setattr(model_runner, "KVCache", lambda *a, **k: pytest.fail("the KV cache was allocated"))
    monkeypatch.setattr(memory, "available_bytes", lambda device: (64 << 20, "test's figure"))
    with pytest.raises(EngineMemoryError) as e:
        RolloutEngine(make_config("qwen2"), EngineSpec(max_batch_size=64, max_seq_len=8192))
    assert built == [torch.device("meta")]  # only the meta-device count: no weights, no cache
    msg = str(e.value)
    # 64 rows x 8192 slots x (2 layers x k, v x 2 heads x 16 x 4 bytes KV + 20 bytes of row buffers)
    assert msg.startswith("RolloutEngine: max_batch_size=64 x max_seq_len=8192 needs 266.3 MiB (KV cache 256.0 MiB, "
                          "row buffers 10.0 MiB, weights 0.3 MiB) "), msg
    assert msg.endswith("but 64.0 MiB is available (test's figure); lower max_seq_len to at most 1962 or "
                        "max_batch_size to at most 15") and "\n" not in msg
    assert e.value.rows_fit == 15 and e.value.seq_len_fit == 1962
    m = e.value.memory  # the suggestions are the largest that fit
    assert m.total(15, 8192) <= 64 << 20 < m.total(16, 8192)
    assert m.total(64, 1962) <= 64 << 20 < m.total(64, 1963)


def test_a_size_beyond_any_machine_refuses_on_the_real_figure():
    """No patched figure: a cache of ~10^8 GiB cannot fit anywhere, and nothing of it is allocated
    (not even the O(max_seq_len) rope tables, tens of TB here: they come after the check)."""
    from hybridrl.rollout.core.memory import EngineMemoryError

    with pytest.raises(EngineMemoryError, match=r"max_seq_len=1000000000000 needs [\d.]+ GiB .* is available \("):
        RolloutEngine(make_config("llama"), EngineSpec(max_batch_size=256, max_seq_len=10**12))


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    from hybridrl.rollout.core.memory import available_bytes, cgroup_headroom, meminfo_available

    (tmp_path / "meminfo").write_text("MemTotal:  1000 kB\nMemAvailable:     512 kB\n")
    assert meminfo_available(str(tmp_path / "meminfo")) == 512 * 1024
    assert meminfo_available(str(tmp_path / "missing")) is None
    # cgroup v2: the least headroom over the group and its ancestors; inactive file cache is reclaimable
    v2, proc = tmp_path / "v2", tmp_path / "cgroup"
    (v2 / "a" / "b").mkdir(parents=True)
    for d, limit, current, inactive in ((v2 / "a", 1 << 30, 600 << 20, 100 << 20), (v2 / "a" / "b", "max", 5, 0)):
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\n")
    proc.write_text("0::/a/b\n")
    assert cgroup_headroom(str(proc), str(v2)) == (1 << 30) - (500 << 20)
    # cgroup v1 (hybrid hosts): the memory controller's hierarchical limit
    v1 = tmp_path / "v1" / "memory" / "x"
    v1.mkdir(parents=True)
    (v1 / "memory.usage_in_bytes").write_text(str(300 << 20))
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 62))
    (v1 / "memory.stat").write_text(f"hierarchical_memory_limit {256 << 20}\ntotal_inactive_file {100 << 20}\n")
    proc.write_text("4:memory:/x\n0::/\n")
    assert cgroup_headroom(str(proc), str(tmp_path / "v1")) == 56 << 20
    (v1 / "memory.stat").write_text(f"hierarchical_memory_limit {(1 << 63) - 4096}\n")
    assert cgroup_headroom(str(proc), str(tmp_path / "v1")) is None  # no limit
    assert cgroup_headroom(str(tmp_path / "missing")) is None
    n, source = available_bytes(torch.device("cpu"))
    assert n > 0 and source
    assert available_bytes(torch.device("meta")) is None
