"""An agent run refuses a chat template that rewrites the history at start, in one line,
before any training: ``hybridrl train`` with a local checkpoint whose tokenizer carries a
Qwen3-style template (earlier assistant turns lose their ``<think>`` block) and an
environment. The same checkpoint with a prefix-preserving ChatML template gets past the
check to the training loop, so the refusal is the template's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from hybridrl.checkpoint.atomic import save_checkpoint_atomic
from hybridrl.cli import main
from hybridrl.config import ModelConfig
from hybridrl.job import loop
from hybridrl.job.model_factory import builtin_model
from tests.agents.qwen_chat import CHATML, QWEN3_STYLE, qwen_tokenizer

ENV = Path(__file__).resolve().parents[1] / "agents" / "envs_for_tests.py"
SMALL = ["data.train_size=16", "data.eval_size=4", "batch.prompts_per_step=2", "rollout.n=2", "trainer.total_steps=1",
         "warm_start.steps=0", "trainer.threads=1", "checkpoint.save=false", "logging.progress=false",
         "logging.tensorboard=false", "logging.plot=false"]


class TrainingStarted(Exception):
    """Raised where the run's training would begin (config written, warm start, RL steps)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny Qwen2 checkpoint with Qwen's BPE (no download), in two copies that differ only
    in their chat template file: Qwen3-style and ChatML."""
    tok = qwen_tokenizer(QWEN3_STYLE)
    model = builtin_model(tok, ModelConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=True))
    qwen3 = save_checkpoint_atomic(model, tok, tmp_path_factory.mktemp("qwen3") / "model").resolve()
    chatml = tmp_path_factory.mktemp("chatml") / "model"
    shutil.copytree(qwen3, chatml)
    template = chatml / "chat_template.jinja"
    assert QWEN3_STYLE in template.read_text()  # the template file is where the tokenizer keeps it
    template.write_text(CHATML)
    return {"qwen3": qwen3, "chatml": chatml}


def _train(checkpoint: Path, out: Path, monkeypatch) -> int:
    def started(*args, **kwargs):
        raise TrainingStarted()

    monkeypatch.setattr(loop, "_train", started)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar on stderr is not ours to judge
    try:
        return main(["train", f"model.path={checkpoint}", f"env.name={ENV}:GuessNumber", f"trainer.output_dir={out}",
                     *SMALL])
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def test_a_template_that_strips_think_blocks_is_refused_at_start_in_one_line(checkpoints, tmp_path, capsys,
                                                                              monkeypatch):
    assert _train(checkpoints["qwen3"], tmp_path, monkeypatch) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridrl: error: "), err
    line = lines[0]
    assert f"the tokenizer's ({checkpoints['qwen3']}) chat template rewrites the history" in line, line
    assert "strips the <think> blocks of earlier assistant turns" in line and "prefix-preserving template" in line
    assert not list(tmp_path.rglob("config.yaml")) and not list(tmp_path.rglob("metrics*")), "a run got started"


def test_the_same_checkpoint_with_a_prefix_preserving_template_gets_to_training(checkpoints, tmp_path, monkeypatch):
    with pytest.raises(TrainingStarted):
        _train(checkpoints["chatml"], tmp_path, monkeypatch)
