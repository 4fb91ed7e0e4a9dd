"""Mistakes a user makes, through the CLI: one line ``hybridrl: error: ...`` naming the file
or key and what to do, exit code 2, never a traceback (issue "Runs that survive")."""

import shutil

import pytest

from hybridrl.cli import main
from hybridrl.data.char_tokenizer import build_char_tokenizer
from hybridrl.checkpoint.atomic import save_checkpoint_atomic
from hybridrl.job.model_factory import builtin_model
from hybridrl.config import ModelConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_char_tokenizer()
    model = builtin_model(tok, ModelConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=True), seed=0)
    link = save_checkpoint_atomic(model, tok, tmp_path_factory.mktemp("ckpt") / "model")
    return link.resolve()


def _broken(checkpoint, tmp_path, how: str):
    """A copy of the checkpoint with one file damaged as ``how`` says."""
    bad = tmp_path / how
    shutil.copytree(checkpoint, bad)
    weights = bad / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        weights.write_bytes(b"not safetensors")
    elif how == "no-weights":
        weights.unlink()
    elif how == "broken-config":
        (bad / "config.json").write_text('{"model_type": "qwen2", ')
    elif how == "config-list":
        (bad / "config.json").write_text("[1, 2]")
    elif how == "no-tokenizer":
        for f in bad.glob("tokenizer*"):
            f.unlink()
    return bad


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridrl: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.mark.parametrize("how, says", [
    ("truncated", "model.safetensors is truncated or corrupt"),
    ("garbage", "model.safetensors is truncated or corrupt"),
    ("no-weights", "no weights there"),
    ("broken-config", "config.json is not valid JSON"),
    ("config-list", "config.json is not a JSON object"),
    ("no-tokenizer", "cannot load its tokenizer"),
])
@pytest.mark.parametrize("command", ["train", "generate"])
def test_broken_checkpoint_is_one_line(checkpoint, tmp_path, capsys, how, says, command):
    bad = _broken(checkpoint, tmp_path, how)
    if command == "train":
        line = _error(capsys, ["train", f"model.path={bad}", f"trainer.output_dir={tmp_path / 'runs'}"])
        assert f"model.path={bad}: {says}" in line
        assert not (tmp_path / "runs").exists()  # failed before touching the run directory
    else:
        line = _error(capsys, ["generate", "--model", str(bad), "1+1="])
        assert f"--model={bad}: {says}" in line


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "/nonexistent/model", "1+1="],
    ["train", "model.path=/nonexistent/model"],
])
def test_missing_checkpoint_is_one_line(tmp_path, capsys, argv):
    line = _error(capsys, argv + ([f"trainer.output_dir={tmp_path}"] if argv[0] == "train" else []))
    assert "/nonexistent/model: no such directory; point it at a local HF checkpoint directory" in line


def test_unknown_reward_module_is_one_line(tmp_path, capsys):
    line = _error(capsys, ["train", "reward.functions=nosuchmod:fn", f"trainer.output_dir={tmp_path}"])
    assert "reward.functions='nosuchmod:fn': cannot import nosuchmod" in line


def test_reward_file_with_a_syntax_error_is_one_line(tmp_path, capsys):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(response, answer, prompt)\n    return 1.0\n")
    line = _error(capsys, ["train", f"reward.functions={f}:score", f"trainer.output_dir={tmp_path / 'runs'}"])
    assert f"{f}:1: SyntaxError: expected ':'; fix the reward file" in line


def test_multi_line_value_errors_print_as_one_line(capsys, monkeypatch):
    import hybridrl.cli as cli

    def raises(args):
        raise ValueError("first line\n  second line")

    monkeypatch.setattr(cli, "_config", raises)
    assert _error(capsys, ["config"]) == "hybridrl: error: first line second line"


def test_an_engine_too_big_for_memory_is_one_line(tmp_path, capsys, monkeypatch):
    """``rollout.max_tokens=100000`` on a 24 GB machine used to end in the kernel's OOM killer
    (exit 137, nothing on the console): the engine's static memory is counted before any of it
    is allocated. The figure is fixed here (a 22 GiB host), so the run is refused the same on
    every machine and never allocates the ~25 GiB."""
    import hybridrl.rollout.core.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: (22 << 30, "MemAvailable on this host"))
    line = _error(capsys, ["train", "rollout.max_tokens=100000", f"trainer.output_dir={tmp_path}"])
    # 256 rows (32 prompts x 8 samples) x (longest prompt + 100000) x (1 KiB of KV + 20 bytes of buffers)
    assert line.startswith("hybridrl: error: rollout.max_tokens=100000: the built-in engine's 256 rows x 1000"), line
    assert " tokens needs 24.89 GiB (KV cache 24.42 GiB, row buffers 488.3 MiB, weights " in line
    assert ") but 22.00 GiB is available (MemAvailable on this host); lower rollout.max_tokens to at most " in line
    assert ", or set rollout.kv_cache_mb=" in line and "(batch.prompts_per_step, rollout.n)" in line
