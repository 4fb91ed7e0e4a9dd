"""Smoke test of benchmarks/step.py's own side (no TRL needed) and of the shared row helpers."""

from __future__ import annotations

import json
import math

from _bench_module import load_bench


def test_our_side_reports_every_phase(tmp_path):
    step = load_bench("step")
    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 64}
    cfg = step.bench_config(prompts=2, n=2, max_tokens=4, threads=1, output_dir=str(tmp_path), model=tiny,
                            data={"train_size": 64, "eval_size": 8})
    records = step.measure_ours(cfg, steps=2)
    assert len(records) == 2
    for rec in records:
        for phase in ("step", *step.OURS_PHASES):
            assert math.isfinite(rec[phase]) and rec[phase] >= 0, (phase, rec)
        assert sum(rec[p] for p in step.OURS_PHASES) <= rec["step"] * 1.001 + 1e-6
        assert 0 < rec["length"] <= 4


def test_rows_table_and_json(tmp_path):
    common = load_bench("_common")
    rows = [common.row(case="c", metric="step s", ours=1.0, baseline=3.0, baseline_name="b", higher_is_better=False),
            common.row(case="c", metric="tok/s", ours=6.0, baseline=2.0, baseline_name="b", higher_is_better=True)]
    assert [common.speedup(r) for r in rows] == [3.0, 3.0]
    assert "3.00x" in common.format_table(rows)
    path = tmp_path / "out.json"
    common.write_json(str(path), rows)
    loaded = json.loads(path.read_text())["rows"]
    assert [set(r) for r in loaded] == [set(common.ROW_KEYS)] * 2


def test_trl_side_runs_without_gradient_checkpointing_and_says_so(tmp_path):
    """The TRL baseline, tiny, two interleaved steps: gradient checkpointing is off (TRL's
    config defaults it to on) and the rows' baseline name says what TRL ran with."""
    import pytest

    pytest.importorskip("trl", reason="trl not installed (the bench/test extra): no TRL baseline to build")
    pytest.importorskip("datasets", reason="datasets not installed: no TRL dataset")
    import trl

    step = load_bench("step")
    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 64}
    cfg = step.bench_config(prompts=2, n=2, max_tokens=4, threads=1, output_dir=str(tmp_path), model=tiny,
                            data={"train_size": 64, "eval_size": 8})
    ours = step.OursSide(cfg)
    try:
        trainer, records, model = step.build_trl(cfg, ours.run, steps=2, output_dir=str(tmp_path),
                                                 after_step=ours.step)
        assert trainer.args.gradient_checkpointing is False
        assert step._same_weights(ours.run.policy, model)
        trainer.train()
    finally:
        ours.close()
    assert len(records) == 2 and len(ours.steps) == 2  # interleaved: one of ours after each TRL step
    assert not model.is_gradient_checkpointing
    name = step.trl_baseline_name(trainer)
    assert name == (f"TRL {trl.__version__} GRPOTrainer, gradient checkpointing off, eager, "
                    f"{model.config._attn_implementation} attention, HF generate")
