"""hybridrl doctor mismatch: the decomposition adds up, a planted cause is found, bad input is one line."""

from __future__ import annotations

import json

import pytest

from hybridrl.config.io import load_config
from hybridrl.doctor.run import doctor_mismatch

# the default job's model and data (its warm start shortened: the doctor runs it like a job)
JOB = ["warm_start.steps=150", "batch.prompts_per_step=16", "logging.progress=false"]


def _causes(d):
    return {c.name: c for c in d.causes}


def test_fp8_gap_is_explained_by_its_causes_within_10_percent(tmp_path):
    cfg = load_config(None, [*JOB, "rollout.quantization=fp8", f"trainer.output_dir={tmp_path}"])
    d, out = doctor_mismatch(cfg, str(tmp_path / "doc"), console=lambda line: None)
    assert d.total["kl"] > 0 and d.total["tokens"] > 100
    assert abs(d.explained_kl - d.total["kl"]) <= 0.1 * d.total["kl"], (d.explained_kl, d.total)
    top = max((c for c in d.causes if c.additive and c.effect_kl is not None), key=lambda c: c.effect_kl)
    assert top.name == "quantization"
    assert any(r.startswith("rollout.quantization=null") for r in d.recommendations)
    exact = [r for r in d.recommendations if r.startswith("rollout.exact=true")]
    assert exact and "token KL 0," in exact[0] and " 0 of " in exact[0]  # measured: bitwise on this batch
    record = json.loads((out / "mismatch.json").read_text())
    assert record["total"]["kl"] == d.total["kl"] and {c["name"] for c in record["causes"]} >= {"quantization"}
    assert (out / "mismatch.png").stat().st_size > 10_000 and (out / "mismatch.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc"]  # the scratch job folder is gone


def test_a_planted_temperature_mismatch_is_the_top_cause(tmp_path):
    cfg = load_config(None, [*JOB, "rollout.top_p=0.9", f"trainer.output_dir={tmp_path}"])
    d, _ = doctor_mismatch(cfg, str(tmp_path / "doc"), engine_temperature=0.8, console=lambda line: None)
    causes = _causes(d)
    assert causes["sampling truncation"].effect_kl > 0 and not causes["sampling truncation"].additive
    top = max((c for c in d.causes if c.additive and c.effect_kl is not None), key=lambda c: c.effect_kl)
    assert top.name == "temperature", [(c.name, c.effect_kl) for c in d.causes]
    assert causes["temperature"].effect_kl > 0.9 * d.total["kl"]
    assert any("trainer's temperature" in r for r in d.recommendations)


def test_async_staleness_is_measured(tmp_path):
    """trainer.mode=async: the doctor runs max_staleness steps of the job and reports the
    trainer's drift on the batch's tokens (outside the sum); sync reports none."""
    cfg = load_config(None, [*JOB, "batch.prompts_per_step=8", "trainer.mode=async", "pipeline.max_staleness=2",
                             f"trainer.output_dir={tmp_path}"])
    d, _ = doctor_mismatch(cfg, str(tmp_path / "doc"), console=lambda line: None)
    stale = _causes(d)["staleness"]
    assert stale.setting == "async, max_staleness=2" and not stale.additive
    # fp32, full precision: the engine mismatch is rounding (~1e-14); two updates move far more
    assert stale.effect_kl > 100 * d.total["kl"] > 0, (stale, d.total)
    assert any(r.startswith("staleness outweighs") for r in d.recommendations)


def test_periodic_mismatch_metric_is_logged(tmp_path):
    from hybridrl.job.loop import train

    cfg = load_config(None, ["warm_start.steps=20", "trainer.total_steps=2", "trainer.eval_every=2",
                             "trainer.mismatch_report_every=1", "rollout.quantization=fp8", "eval.k=0",
                             "data.eval_size=8", "batch.prompts_per_step=4", "logging.progress=false",
                             "logging.plot=false", "logging.tensorboard=false", f"trainer.output_dir={tmp_path}"])
    result = train(cfg)
    rows = [r for r in result.history if "mismatch/kl" in r]
    assert len(rows) == 2 and all(r["mismatch/kl"] > 0 and r["mismatch/max_abs"] > 0 for r in rows)


@pytest.mark.parametrize("bad,says", [(["model.path=/nonexistent/ckpt"], "model.path=/nonexistent/ckpt"),
                                      (["rollout.backend=vllm", "model.arch=deepseek_v4"], "deepseek_v4")])
def test_unbuildable_jobs_are_one_line_errors_and_write_nothing(tmp_path, bad, says, capsys):
    from hybridrl.cli import main

    out = tmp_path / "doc"
    assert main(["doctor", "mismatch", *JOB, *bad, f"trainer.output_dir={tmp_path}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridrl: error:") and says in err and "\n" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
