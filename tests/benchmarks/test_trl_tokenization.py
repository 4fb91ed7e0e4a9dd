"""TRL generates from exactly our prompt ids: the prompt texts the benchmarks hand
``GRPOTrainer`` (``trl_side_inputs``) go through TRL's own ``_tokenize_prompts`` and come
out as hybridrl's ids for the same prompts (the built-in arithmetic task, char tokenizer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("trl", reason="trl not installed (pip install -e '.[bench]' or '.[test]'): TRL's tokenization "
                                  "cannot be checked")
pytest.importorskip("datasets", reason="datasets not installed: the benchmarks' TRL dataset cannot be built")

from trl import GRPOTrainer  # noqa: E402

from hybridrl.data.arithmetic import arithmetic_splits  # noqa: E402
from hybridrl.data.char_tokenizer import build_char_tokenizer, encode_prompt  # noqa: E402

from _bench_module import load_bench  # noqa: E402


def trl_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """TRL's real ``GRPOTrainer._tokenize_prompts``, unbound, on a stand-in ``self`` with the
    one attribute it reads for text (non-conversational) prompts."""
    ids, images, fields = GRPOTrainer._tokenize_prompts(SimpleNamespace(processing_class=tokenizer), texts)
    assert images is None and fields == {}
    return [list(x) for x in ids]


def _examples(n: int = 64):
    train, _ = arithmetic_splits(num_digits=2, operations="+-*", train_size=n, eval_size=8, seed=0)
    return train


def test_bare_prompt_texts_tokenize_to_our_ids():
    tok = build_char_tokenizer()
    exs = _examples()
    ours = [encode_prompt(tok, e.prompt) for e in exs]
    assert all(ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id for ids in ours)
    assert trl_ids(tok, [e.prompt for e in exs]) == ours
    # what the benchmarks used to pass: "<bos>" + text, which TRL turned into [bos, bos, ...]
    doubled = trl_ids(tok, [tok.bos_token + e.prompt for e in exs])
    assert doubled == [[tok.bos_token_id] + ids for ids in ours]


def test_trl_side_inputs_hands_trl_texts_that_give_our_ids(tmp_path):
    """The benchmarks' own path: a built run's train prompts, ``trl_side_inputs``'s dataset."""
    common, learning = load_bench("_common"), load_bench("learning")
    from hybridrl.job.build import build_run

    overrides = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
                 "model.num_key_value_heads=1", "model.intermediate_size=64", "data.train_size=64",
                 "data.eval_size=8", "warm_start.steps=0", "batch.prompts_per_step=2", "rollout.n=2"]
    cfg = learning.bench_config(threads=1, output_dir=str(tmp_path), overrides=overrides)
    run = build_run(cfg, console=lambda s: None)
    try:
        _, data, reward = common.trl_side_inputs(cfg, run, "test")
        train = run.step.train_set
        assert trl_ids(run.tokenizer, list(data["prompt"])) == [list(p) for p in train.prompts]
        assert list(data["prompt"]) == list(train.prompt_texts)  # no "<bos>" in the texts
        assert reward([train.answers[0], "x"], [train.answers[0], train.answers[1]]) == [1.0, 0.0]
    finally:
        run.log.close()
        run.step.scorer.close()
        if hasattr(run, "directory"):
            run.directory.close()
