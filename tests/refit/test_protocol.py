"""Protocol order, name-layout rejection with the engine unchanged, planted stale caches."""
import pytest
import torch
from torch import nn

import hybridrl.rollout.layers.fp8_linear as fp8_linear
from hybridrl.refit import Refit, RefitError, refit_from_model, refit_session
from hybridrl.rollout.derived import DerivedCacheError, named_derived_caches
from tests.refit.helpers import (assert_state_equal, clone_state, engine, hf_model, perturb,
                                 qwen2_config)


@pytest.fixture
def fp8_engine(monkeypatch):
    """FP8 engine with the fnuz inference layout forced (begin() really changes the scales)."""
    monkeypatch.setattr(fp8_linear, "FNUZ_DEFAULT", True)
    cfg = qwen2_config()
    hf, eng = hf_model(cfg), engine(cfg, "fp8")
    refit_from_model(eng, hf)
    perturb(hf, seed=1)
    return hf, eng


def _named(hf):
    return [(n, p.detach()) for n, p in hf.named_parameters()]


def test_steps_out_of_order_raise(fp8_engine):
    hf, eng = fp8_engine
    with pytest.raises(RefitError, match="state 'new'"):
        Refit(eng).load(_named(hf))
    with pytest.raises(RefitError, match="state 'new'"):
        Refit(eng).finish()
    s = Refit(eng).begin()
    with pytest.raises(RefitError, match="in progress"):
        Refit(eng).begin()
    with pytest.raises(RefitError, match="state 'loading'"):
        s.begin()
    s.load(_named(hf))
    s.finish()
    with pytest.raises(RefitError, match="state 'done'"):
        s.finish()


def test_refresh_before_restore_is_impossible(fp8_engine):
    hf, eng = fp8_engine
    s = Refit(eng).begin()
    caches = list(named_derived_caches(eng.model))
    with pytest.raises(DerivedCacheError, match="not in inference layout"):
        caches[0][1].refresh()  # mid-refit: its layer is in loading layout
    s.load(_named(hf))
    s.finish()
    caches[0][1].refresh()  # fine once finish() restored inference layouts


@pytest.mark.parametrize("case", ["partial", "unknown", "duplicate", "shape", "dtype"])
def test_bad_name_layouts_rejected_engine_unchanged(fp8_engine, case):
    hf, eng = fp8_engine
    named = _named(hf)
    before, version = clone_state(eng), eng.weight_version
    if case == "partial":  # the classic bug: a fused shard skipped by name matching
        named = [(n, t) for n, t in named if n != "model.layers.1.mlp.gate_proj.weight"]
        match = "missing .*gate_proj"
    elif case == "unknown":
        named.append(("model.layers.0.mlp.experts.0.w1.weight", named[0][1]))
        match = "unknown .*experts"
    elif case == "duplicate":
        named.append(named[3])
        match = "duplicate"
    elif case == "shape":
        named[4] = (named[4][0], named[4][1][:-1])
        match = "mismatched .*shape"
    else:
        named[4] = (named[4][0], named[4][1].to(torch.int64))
        match = "mismatched .*dtype"
    with pytest.raises(RefitError, match=match):
        refit_from_model(eng, named, verify=True)
    assert_state_equal(eng, before)
    assert eng.weight_version == version


def test_bad_bucket_in_unannounced_session_leaves_engine_unchanged(fp8_engine):
    hf, eng = fp8_engine
    before = clone_state(eng)
    s = refit_session(eng)
    with pytest.raises(RefitError, match="engine unchanged"):
        s.load(_named(hf)[:3] + [("nope.weight", torch.zeros(1))])
    assert_state_equal(eng, before)
    assert s.state.value == "failed"


def test_short_stream_detected_at_finish(fp8_engine):
    hf, eng = fp8_engine
    version = eng.weight_version
    s = refit_session(eng)
    s.load(_named(hf)[:-1])
    with pytest.raises(RefitError, match="incomplete"):
        s.finish()
    assert eng.weight_version == version


def test_planted_stale_cache_is_caught(fp8_engine):
    hf, eng = fp8_engine
    _, cache = next(iter(named_derived_caches(eng.model)))
    cache.compute = lambda out: None  # a cache whose refresh silently does nothing
    with pytest.raises(RefitError, match="stale derived caches"):
        refit_from_model(eng, hf, verify=True)


def test_rebuilt_cache_is_caught(fp8_engine):
    hf, eng = fp8_engine
    layer = eng.model.model.layers[0].mlp.down_proj
    s = Refit(eng, verify=True).begin()
    s.load(_named(hf))
    layer.weight_dequant = layer.weight_dequant.clone()  # "delete and lazily rebuild"
    with pytest.raises(DerivedCacheError, match="rebound"):
        s.finish()


def test_rebound_parameter_is_caught(fp8_engine):
    hf, eng = fp8_engine
    layer2 = eng.model.model.layers[1].mlp.down_proj
    s = Refit(eng, verify=True).begin()
    s.load(_named(hf))
    layer2.weight_scale = nn.Parameter(layer2.weight_scale.detach().clone(), requires_grad=False)
    with pytest.raises(RefitError, match="moved/reshaped: .*layers.1.mlp.down_proj.weight_scale"):
        s.finish()


def test_wrong_slot_write_is_caught_by_checksums(fp8_engine):
    hf, eng = fp8_engine
    layer = eng.model.model.layers[0].self_attn.qkv_proj
    real = layer.weight.weight_loader
    # a loader that swaps the k and v shards (same shapes: only a checksum can tell)
    swap = {"k": "v", "v": "k"}
    layer.weight.weight_loader = lambda p, w, shard_id=None: real(p, w, swap.get(shard_id, shard_id))
    with pytest.raises(RefitError, match="differ from what the trainer sent: .*layers.0.self_attn"):
        refit_from_model(eng, hf, verify=True)
