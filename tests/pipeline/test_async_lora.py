"""LoRA in overlapped runs: the rollout workers' refits carry the adapters (adapter mode) or
the merged targets (merged mode), the whole base only on a worker's first load; a worker
process gets them through shared memory (partial refits, verified), a colocated one in
process. Step 1 is sampled by the weights it trains (staleness 0), so its engine-trainer
log-prob gap is the engine's numerics alone."""

from __future__ import annotations

import pytest
from _async_run import ASYNC_JOB

from hybridrl.config.io import load_config


@pytest.mark.parametrize("placement,mode", [("disaggregated", "adapter"), ("colocated", "merged")])
def test_async_lora_refits_send_the_adapter_only(tmp_path, monkeypatch, placement, mode):
    import hybridrl.refit.shm as shm
    from hybridrl.job.loop import train

    sent = []  # (number of tensors, partial) of every shared-memory refit
    real = shm.send_refit

    def recording(channel, named, **kw):
        named = list(named)
        sent.append((len(named), kw.get("partial", False)))
        return real(channel, named, **kw)

    monkeypatch.setattr(shm, "send_refit", recording)
    cfg = load_config(None, ASYNC_JOB + [
        "model.lora.rank=4", "model.lora.init=gaussian", f"rollout.lora_mode={mode}", "optim.lr=3e-2",
        f"pipeline.placement={placement}", "pipeline.max_staleness=1", "trainer.total_steps=3",
        "refit.verify=true", "checkpoint.save=false", f"trainer.output_dir={tmp_path}"])
    result = train(cfg)
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 3 and all(r["async/staleness_max"] <= 1 for r in steps)
    assert steps[0]["async/staleness_max"] == 0
    assert steps[0]["rollout/trainer_logprob_abs_diff_max"] < 1e-4  # every token: the same weights
    if placement == "disaggregated":
        targets = 7  # one layer: q/k/v/o/gate/up/down
        assert sent[0][1] is False  # the worker's first load: the whole base (+ the adapter)
        assert len(sent) >= 3 and all(s == (2 * targets, True) for s in sent[1:]), sent
