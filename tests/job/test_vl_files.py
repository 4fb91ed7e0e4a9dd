"""A vision-language run on a data file whose rows carry pictures: a jsonl with image paths
relative to it (and bad rows), a local Qwen2.5-VL checkpoint (``model.path``, saved by
hybridrl itself: its tokenizer, chat template and config), ``hybridrl train`` 2 steps, then
``hybridrl eval`` of the run's checkpoint on the same file. Checks the skip report names
each bad image with file:row, that the pictures reach the engine's requests, and that the
run's checkpoint serves ``hybridrl eval`` on the same file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import _seeds

from hybridrl.checkpoint.atomic import save_checkpoint_atomic
from hybridrl.cli import main
from hybridrl.config import ModelConfig
from hybridrl.data.shapes import make_example
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer

RUN = ["data.eval_size=2", "batch.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=3", "trainer.total_steps=2",
       "warm_start.steps=0", "trainer.threads=1", "logging.progress=false", "logging.tensorboard=false",
       "logging.plot=false", "eval.k=0", "data.max_prompt_length=96"]


def _data(tmp: Path, seed: int) -> Path:
    rng = random.Random(seed)
    (tmp / "pictures").mkdir()
    rows = []
    for i in range(8):
        ex = make_example(rng, cells=4, cell=28, max_count=3)
        ex.image.save(tmp / "pictures" / f"{i}.png")
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ex.question}]}],
                     "images": [f"pictures/{i}.png"], "answer": ex.answer})
    rows.append({"prompt": "How many red? (no picture)", "answer": "0"})  # a text row beside them
    rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                 "images": ["pictures/missing.png"], "answer": "1"})
    (tmp / "broken.png").write_bytes(b"not a png")
    rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                 "images": ["broken.png"], "answer": "1"})
    path = tmp / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_vl_run_on_a_data_file_with_pictures(tmp_path: Path, capsys, monkeypatch) -> None:
    from hybridrl.rollout.engine import RolloutEngine

    given = []  # the number of images each request carried
    add = RolloutEngine.add_request

    def counting_add(engine, request_id, token_ids, params=None, **kw):
        given.append(0 if kw.get("images") is None else kw["images"].n_images)
        return add(engine, request_id, token_ids, params, **kw)

    monkeypatch.setattr(RolloutEngine, "add_request", counting_add)
    seed = _seeds.fresh_seed()
    data = _data(tmp_path, seed)
    tok = builtin_tokenizer("qwen2_5_vl")
    spec = ModelConfig(arch="qwen2_5_vl", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=64)
    model_dir = save_checkpoint_atomic(builtin_model(tok, spec, seed=seed), tok, tmp_path / "model").resolve()
    rc = main(["train", f"model.path={model_dir}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
               f"trainer.output_dir={tmp_path}", "trainer.run_name=vl", f"trainer.seed={seed}", *RUN])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = next(line for line in out.splitlines() if "prompts loaded" in line)
    assert "9 prompts loaded" in report, report
    assert f"image file not found (first at {data}:10)" in report, report
    assert f"undecodable image (first at {data}:11)" in report, report
    rows = [json.loads(line) for line in (tmp_path / "vl" / "metrics.jsonl").read_text().splitlines()]
    assert sum("reward/mean" in r for r in rows) == 2
    assert any(n == 1 for n in given), "no request carried its row's picture"
    rc = main(["eval", "--model", str(tmp_path / "vl" / "checkpoint"), f"data.val_files=[{data}]", "eval.k=0",
               "rollout.max_tokens=3", "logging.progress=false"])
    assert rc == 0, capsys.readouterr().out
