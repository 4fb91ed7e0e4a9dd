"""A vision-language policy (the built-in tiny Qwen2.5-VL / Qwen3-VL on ``data.task=shapes``)
through the one batch source in every mode, at 2 ranks, and as an agent whose environment
sends pictures — each a real job (real processes, real engines), checked with the
composition matrix's invariants (``test_composition.py``, ``_composition.py``):

- async at ``max_staleness=0`` == sync, bit for bit (metrics and final weights);
- 2 ranks (gloo, FSDP2) == 1 process on the sampled rows and losses;
- one_step_off / async keep every sample within the staleness bound;
- agents: every trained row's ids and images are exactly what the engine was given at the
  episode's last turn (token-in/token-out holds for the pictures too).
"""

from __future__ import annotations

from pathlib import Path

import _seeds
import pytest
from _composition import assert_bitwise_equal, assert_same_as_one_process, assert_started_within_bound, run_job

HERE = Path(__file__).resolve().parent
VL = ["data.task=shapes", "data.max_prompt_length=64", "rollout.max_tokens=3"]


def _vl(arch: str) -> list[str]:
    return VL + [f"model.arch={arch}"]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_vl_async_at_staleness_zero_is_sync(tmp_path: Path, monkeypatch, arch: str) -> None:
    seed = _seeds.fresh_seed()
    sync = run_job(tmp_path, "sync", "single_turn", _vl(arch), seed=seed, monkeypatch=monkeypatch)
    a = run_job(tmp_path, "async", "single_turn", _vl(arch) + ["trainer.mode=async", "pipeline.max_staleness=0",
                                                               "pipeline.placement=disaggregated"],
                seed=seed, monkeypatch=monkeypatch)
    assert any(r["actor/grad_norm"] > 0 for r in sync.steps()), f"seed {seed}: no gradient, nothing compared"
    assert_bitwise_equal(sync, a)
    assert_started_within_bound(a, 0)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_vl_overlapped_modes_keep_the_bound(tmp_path: Path, monkeypatch, mode: str) -> None:
    seed = _seeds.fresh_seed()
    extra = [f"trainer.mode={mode}", "rollout.step_latency_ms=5"] + (["pipeline.max_staleness=2"] if mode == "async"
                                                                     else [])
    run = run_job(tmp_path, mode, "single_turn", _vl("qwen2_5_vl") + extra, seed=seed, monkeypatch=monkeypatch)
    assert_started_within_bound(run, 1 if mode == "one_step_off" else 2)


def test_vl_two_ranks_match_one_process(tmp_path: Path, monkeypatch) -> None:
    seed = _seeds.fresh_seed()
    one = run_job(tmp_path, "one", "single_turn", _vl("qwen2_5_vl"), seed=seed, monkeypatch=monkeypatch)
    two = run_job(tmp_path, "two", "single_turn", _vl("qwen2_5_vl"), seed=seed, monkeypatch=monkeypatch, ranks=2)
    for line in assert_same_as_one_process(one, two):
        print(f"note: {line}")


def test_vl_agent_trains_on_what_the_engine_saw(tmp_path: Path, monkeypatch) -> None:
    """Episodes whose second turn sees a picture the environment sent (the warm start teaches
    "a digit, end of turn", so first turns end and reach the picture): each trained row's ids
    start with the ids of one request the engine was given and hold exactly that request's
    images, and the pictures do reach the trainer."""
    from hybridrl.rollout.engine import RolloutEngine
    from hybridrl.trainer.actor import Actor

    requests, trained = [], []
    add, update = RolloutEngine.add_request, Actor.update

    def recording_add(engine, request_id, token_ids, params=None, **kw):
        images = kw.get("images")
        requests.append((list(token_ids), () if images is None else images.keys))
        return add(engine, request_id, token_ids, params, **kw)

    def recording_update(actor, batch, **kw):
        images = batch.get("images")
        for b in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()
            row = None if images is None else images.rows[b]
            trained.append((ids, () if row is None else row.keys))
        return update(actor, batch, **kw)

    monkeypatch.setattr(RolloutEngine, "add_request", recording_add)
    monkeypatch.setattr(Actor, "update", recording_update)
    seed = _seeds.fresh_seed()
    run_job(tmp_path, "agent", "single_turn",
            _vl("qwen2_5_vl") + [f"env.name={HERE / '_vl_env.py'}:PictureEnv", "env.workers=1", "env.max_turns=2",
                                 "env.overlap=false", "rollout.max_tokens=4", "warm_start.steps=80", "warm_start.lr=3e-3",
                                 "env.context_tokens=96"],
            seed=seed, monkeypatch=monkeypatch)
    assert trained and requests
    with_pictures = [t for t in trained if t[1]]
    assert with_pictures, f"seed {seed}: no trained episode reached the picture turn"
    for ids, keys in trained:
        sent = [r for r in requests if r[0] == ids[:len(r[0])] and r[1] == keys]
        assert sent, f"seed {seed}: a trained row (images {keys}) matches no request the engine was given"
        assert max(len(r[0]) for r in sent) < len(ids)  # the last turn's sampled tokens follow its prompt
