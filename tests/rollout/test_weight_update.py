"""The engine's weight-update bracket: order, the single weight_version writer, completeness,
the route table, and CUDA-graph capture at the first complete update (any path)."""

import pytest
import torch

from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine
from hybridrl.rollout.weight_update import WeightUpdateError
from tests.rollout.conftest import make_config, make_hf_model


def _engine(family="qwen2", quantization=None):
    cfg = make_config(family)
    return cfg, make_hf_model(cfg), RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16,
                                                                  quantization=quantization))


def test_bracket_order_is_enforced():
    _, hf, eng = _engine()
    with pytest.raises(WeightUpdateError, match="no weight update in progress"):
        eng.finish_weight_update()
    eng.begin_weight_update()
    assert eng.weight_update_in_progress
    with pytest.raises(WeightUpdateError, match="already in progress"):
        eng.begin_weight_update()
    eng.load_weights(hf.named_parameters())  # inside an open update: one bucket of it
    assert eng.weight_version == 0
    assert eng.finish_weight_update() == 1 == eng.weight_version
    assert not eng.weight_update_in_progress


def test_weight_version_is_read_only_and_advanced_once_per_update():
    _, hf, eng = _engine()
    with pytest.raises(AttributeError):
        eng.weight_version = 5
    with eng.weight_update():
        eng.load_weights(list(hf.named_parameters())[:3])
        eng.load_weights(list(hf.named_parameters())[3:])
    assert eng.weight_version == 1
    eng.load_weights(hf.named_parameters())  # one-shot: begin + load + finish
    assert eng.weight_version == 2


def test_incomplete_or_failed_update_commits_nothing():
    _, hf, eng = _engine()
    eng.begin_weight_update()
    eng.load_weights(list(hf.named_parameters())[:-1])
    with pytest.raises(WeightUpdateError, match="incomplete: 1 weights never loaded"):
        eng.finish_weight_update()
    assert eng.weight_version == 0 and not eng.weight_update_in_progress
    with pytest.raises(ValueError, match="incomplete"):
        eng.load_weights(list(hf.named_parameters())[:-1])  # one-shot loads are full loads

    def failing_check():
        raise RuntimeError("verifier says no")

    with pytest.raises(RuntimeError, match="verifier says no"):
        with eng.weight_update(check=failing_check):
            eng.load_weights(hf.named_parameters())
    assert eng.weight_version == 0 and not eng.weight_update_in_progress
    with pytest.raises(ValueError, match="no slot"):
        with eng.weight_update():
            eng.load_weights([("model.nope.weight", torch.zeros(1))])
    assert eng.weight_version == 0 and not eng.weight_update_in_progress


def test_fp8_loader_refuses_writes_outside_an_update():
    _, hf, eng = _engine(quantization="fp8")
    eng.load_weights(hf.named_parameters())
    layer = eng.model.model.layers[0].mlp.down_proj
    with pytest.raises(ValueError, match="outside a weight update"):
        layer.weight.weight_loader(layer.weight, torch.zeros(layer.weight.shape))


def test_route_table_covers_every_weight_element_exactly_once(family):
    cfg, hf, eng = _engine(family)
    routes = eng.weight_routes
    hf_state = hf.state_dict()
    assert routes.expected == set(hf_state) - routes.ignored
    assert routes.ignored == ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    covered = {name: torch.zeros(p.shape[0], dtype=torch.long) for name, p in eng.model.named_parameters()
               if not name.endswith("weight_scale")}
    for r in routes:
        assert r.shape == hf_state[r.hf_name].shape, r.hf_name
        covered[r.param_name][r.rows if r.rows is not None else slice(None)] += 1
    for name, count in covered.items():
        assert bool((count == 1).all()), name


@pytest.mark.parametrize("quantization", [None, "fp8", "fp8_block"])
def test_expected_held_equals_held_after_load(quantization):
    # q, k, v, gate shards of 256, 128, 128, 256 rows: 128-row tiles, so fp8_block applies
    cfg = make_config("qwen2", hidden_size=256, intermediate_size=256)
    hf = make_hf_model(cfg)
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16, quantization=quantization))
    named = list(hf.named_parameters())
    expected = {n: eng.weight_routes[n].expected_held(t.detach()) for n, t in named if n in eng.weight_routes}
    eng.load_weights(named)
    for n, want in expected.items():
        got = eng.weight_routes[n].held()
        assert got.dtype == want.dtype and torch.equal(got, want), n


class _FakeGraphs:
    """Stands in for captured graphs on CPU: never replays, holds no tensors."""

    def can_run(self, batch_size):
        return False

    def named_tensors(self):
        return iter(())


def _count_captures(eng, monkeypatch) -> list:
    calls = []

    def capture(batch_sizes):
        calls.append(list(batch_sizes))
        eng.runner.graphs = _FakeGraphs()

    monkeypatch.setattr(eng, "_use_graphs", True)  # as on CUDA without enforce_eager
    monkeypatch.setattr(eng.runner, "capture_cuda_graphs", capture)
    return calls


def test_graphs_captured_once_at_first_complete_refit(monkeypatch):
    """A refit-only start (no load_weights) must capture, exactly once, and only when complete."""
    _, hf, eng = _engine()
    calls = _count_captures(eng, monkeypatch)
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    eng.begin_weight_update()
    eng.load_weights(named[:-1])
    with pytest.raises(WeightUpdateError):
        eng.finish_weight_update()  # incomplete: no capture from half-loaded weights
    assert calls == []
    for _ in range(3):
        refit_from_model(eng, named, verify=True)
    assert calls == [[1, 2]], "capture at the first complete refit, never again"
    eng.load_weights(named)
    assert len(calls) == 1


def test_graphs_captured_once_at_first_load(monkeypatch):
    _, hf, eng = _engine()
    calls = _count_captures(eng, monkeypatch)
    eng.load_weights(hf.named_parameters())
    refit_from_model(eng, hf)
    assert len(calls) == 1
