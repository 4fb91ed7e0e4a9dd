"""Evaluation (greedy, pass@k, maj@k), the eval command, datasets directories and the
system prompt — on small datasets written here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _tiny import TINY_MODEL

from hybridrl.config.io import load_config


def test_majority_and_pass_at_k_by_hand():
    from hybridrl.job.evaluation import _majority_correct

    # majority "7" (2 of 3) is wrong although one sample is right: pass@3 yes, maj@3 no
    assert not _majority_correct(["7", " 7", "8"], [0.0, 0.0, 1.0])
    assert _majority_correct(["8", "7", "8"], [1.0, 0.0, 1.0])
    assert _majority_correct(["8", "7"], [1.0, 0.0])  # tie: the earliest wins


def _checkpoint(tmp_path):
    from hybridrl.data.char_tokenizer import build_char_tokenizer
    from hybridrl.checkpoint.atomic import save_checkpoint_atomic
    from hybridrl.job.model_factory import builtin_model
    from hybridrl.config import ModelConfig

    tok = build_char_tokenizer()
    model = builtin_model(tok, ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True), seed=3)
    return save_checkpoint_atomic(model, tok, tmp_path / "ckpt")


def test_eval_command_writes_samples_and_consistent_metrics(tmp_path):
    ckpt = _checkpoint(tmp_path)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 16) for b in range(10, 13)]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "samples.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "eval", "--model", str(ckpt), "--k", "4",
                           "--out", str(out), f"data.val_files=[{val}]", "rollout.max_tokens=4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) == len(rows) and all(len(s["samples"]) == 4 for s in samples)
    greedy = sum(s["greedy_score"] > 0.5 for s in samples) / len(samples)
    pass_k = sum(any(x > 0.5 for x in s["scores"]) for s in samples) / len(samples)
    line = proc.stdout.strip().splitlines()[-1]
    assert f"greedy accuracy {greedy:.3f}" in line and f"pass@4 {pass_k:.3f}" in line and "maj@4" in line


def test_datasets_directory_and_system_prompt(tmp_path):
    import datasets

    from hybridrl.data.char_tokenizer import build_char_tokenizer
    from hybridrl.data.files import load_prompt_files

    rows = {"prompt": ["12+3=", "4+5=", "7*8="], "answer": ["15", "9", "56"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    tok = build_char_tokenizer()
    recs, report = load_prompt_files([str(tmp_path / "ds")], tok, prompt_key="prompt", answer_key="answer",
                                     max_prompt_length=64)
    assert report.loaded == 3 and [r.answer for r in recs] == rows["answer"]
    with_sys, _ = load_prompt_files([str(tmp_path / "ds")], tok, prompt_key="prompt", answer_key="answer",
                                    max_prompt_length=64, system_prompt="1+1=2")
    plain = tok.decode(recs[0].prompt_ids, skip_special_tokens=True)
    assert tok.decode(with_sys[0].prompt_ids, skip_special_tokens=True).startswith("1+1=2")
    assert tok.decode(with_sys[0].prompt_ids, skip_special_tokens=True).endswith(plain)
    assert len(with_sys[0].prompt_ids) > len(recs[0].prompt_ids)
    # the length filter counts what it drops
    _, short = load_prompt_files([str(tmp_path / "ds")], tok, prompt_key="prompt", answer_key="answer",
                                 max_prompt_length=5)
    assert short.loaded == 2 and "longer than data.max_prompt_length" in short.summary()
    with pytest.raises(ValueError, match="save_to_disk"):
        load_prompt_files([str(tmp_path)], tok, prompt_key="prompt", answer_key="answer", max_prompt_length=64)


def test_chat_prompt_gets_the_system_message():
    from hybridrl.data.files import with_system_prompt

    chat = [{"role": "user", "content": "2+2?"}]
    assert with_system_prompt(chat, "Be brief.") == [{"role": "system", "content": "Be brief."}, *chat]
    already = [{"role": "system", "content": "x"}, *chat]
    assert with_system_prompt(already, "Be brief.") == already


def test_training_logs_and_plots_pass_at_k(tmp_path):
    from hybridrl.job.loop import train

    cfg = load_config(None, TINY_MODEL + ["data.train_size=200", "data.eval_size=8", "warm_start.steps=5",
                                          "trainer.total_steps=2", "trainer.eval_every=2", "eval.k=3",
                                          "logging.tensorboard=false", "checkpoint.save=false",
                                          f"trainer.output_dir={tmp_path}"])
    result = train(cfg)
    evals = [r for r in result.history if "eval/accuracy" in r]
    assert len(evals) == 2 and all("eval/pass@3" in r and "eval/maj@3" in r for r in evals)
    assert all(r["eval/pass@3"] >= r["eval/maj@3"] - 1e-9 for r in evals)
    assert (result.run_dir / "curves.png").stat().st_size > 0
