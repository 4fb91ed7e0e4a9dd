"""`model.path` (a local HF checkpoint) + `data.train_files` (jsonl with bad rows) end to end."""

import json

from _tiny import TINY_MODEL

from hybridrl.config.io import load_config
from hybridrl.data.char_tokenizer import build_char_tokenizer
from hybridrl.checkpoint.atomic import save_checkpoint_atomic
from hybridrl.job.loop import train
from hybridrl.job.model_factory import builtin_model
from hybridrl.config import ModelConfig


def test_local_checkpoint_and_jsonl(tmp_path):
    tok = build_char_tokenizer()
    model = builtin_model(tok, ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True), seed=7)
    ckpt = save_checkpoint_atomic(model, tok, tmp_path / "init")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 30) for b in range(3)]
    lines = [json.dumps(r) for r in rows] + ["{broken", json.dumps({"question": "no prompt column"})]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    logs: list[str] = []
    cfg = load_config(None, TINY_MODEL + [
        f"model.path={ckpt}", f"data.train_files=[{data}]", "data.eval_size=8", "trainer.total_steps=2",
        "trainer.eval_every=2", "logging.tensorboard=false", "logging.plot=false",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=real",
    ])
    import hybridrl.job.loop as loop

    real_build = loop.build_run
    loop.build_run = lambda c: real_build(c, console=logs.append)
    try:
        result = train(cfg)
    finally:
        loop.build_run = real_build
    summary = next(line for line in logs if line.startswith("data "))
    assert "60 prompts loaded" in summary and "1 unparseable" in summary and "1 no 'prompt' column" in summary
    assert [r["step"] for r in result.history if "reward/mean" in r] == [1, 2]
    assert (result.run_dir / "checkpoint" / "config.json").is_file()


def test_weighted_rewards_and_user_reward_extras_are_logged(tmp_path):
    """reward.functions as a weighted list (a built-in + a user file run in worker processes
    returning a dict): the step's reward is the weighted sum, each part is logged."""
    user = tmp_path / "my_reward.py"
    user.write_text("def digits(response, answer, prompt):\n"
                    "    return {'score': float(response.strip().isdigit()), 'chars': float(len(response))}\n")
    cfg = load_config(None, TINY_MODEL + [
        "data.train_size=200", "data.eval_size=8", "warm_start.steps=20", "trainer.total_steps=2",
        "trainer.eval_every=2", "logging.tensorboard=false", "logging.plot=false", "checkpoint.save=false",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=rw",
        f"reward.functions=[{{name: exact_match, weight: 1.0}}, {{name: '{user}:digits', weight: 0.1}}]",
    ])
    result = train(cfg)
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        parts = {k for k in r if k.startswith("reward/") and k not in ("reward/mean", "reward/std", "reward/failures")}
        assert len(parts) >= 2, parts  # one metric per weighted component
        assert r["reward/failures"] == 0
        assert 0.0 <= r["reward/mean"] <= 1.1 + 1e-6
