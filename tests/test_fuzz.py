"""Seeded fuzzing of what users type and feed: config trees, dotted overrides, reward specs
and dataset rows. Every malformed input must end as a one-line ``ValueError`` (ConfigError
is one) or, for a dataset row, as a row skipped and counted; never a traceback of another
exception type. Failures print a reproducer (the input) per kind of crash.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import typing

import pytest

from hybridrl.config import GROUPS
from hybridrl.config.io import RENAMED, build_config, load_config
from hybridrl.data.char_tokenizer import build_char_tokenizer
from hybridrl.data.files import load_prompt_files
from hybridrl.rewards import build_reward
from hybridrl.job.model_factory import builtin_tokenizer

SEED = 20240611
CASES = 1500  # per fuzz test; the whole file runs in a few seconds


def _keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += [prefix + f.name] + _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


KEYS = {group: _keys(cls) for group, cls in GROUPS.items()}
OLD_KEYS = [old.split(".", 1)[1] for old in RENAMED]
BAD_VALUES = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**63, 10**40, -10**40, 0.5, -0.0, 1e-320, 1e308,
    math.nan, math.inf, -math.inf, "", " ", "x", "nan", "inf", "-1", "1e999", "\x00", "é", "../up", "/abs",
    "cuda:99", "fp8", "grpo", "auto", "off", "gsm8k", "a" * 5000, [], [1], [None], ["a", 2], [[1]], [math.nan],
    {}, {"a": 1}, {"name": 1}, {"name": "gsm8k", 1: 2}, [{}], [{"name": "format", "pattern": 5}],
    [{"name": "gsm8k", "weight": math.nan}], [{"name": "exact_match", "label": ""}], b"bytes", (1, 2), {1, 2},
]
RAW_VALUES = [
    "nan", ".nan", "inf", "-.inf", "1e999", "-1", "0", "0x10", "1_000", "~", "null", "", " ", "yes", "off",
    "[1,2", "{a: 1", "]", "'", '"', "[", "{", "*alias", "&a [*a]", "!!python/object:os.system", "!!binary aGk=",
    "- a", "a: b", "? x", "|", "%YAML", "@", "`", "2020-01-01", "\t", "é", "a=b", "[{name: gsm8k, weight: .nan}]",
    "[grpo]", "{x: 1}", "[[[[1]]]]", "9" * 400, "true", "1.5", "[0.9]", "[0.9, 2]",
]


def _value(rng: random.Random):
    return rng.choice(BAD_VALUES) if rng.random() < 0.85 else rng.choice(RAW_VALUES)


def _random_tree(rng: random.Random) -> dict:
    tree: dict = {}
    for _ in range(rng.randint(1, 4)):
        group = rng.choice([*GROUPS, "algo", "nosuch", "", "Trainer"])
        if rng.random() < 0.08:
            tree[group] = _value(rng)  # a scalar or list where a group goes
            continue
        key = rng.choice(KEYS.get(group, ["x"]) + OLD_KEYS + ["bogus", "x.y"])
        node = tree.setdefault(group, {})
        *parents, name = key.split(".")
        for p in parents:
            if not isinstance(node, dict):
                break
            node = node.setdefault(p, {})
        if isinstance(node, dict):
            node[name] = _value(rng)
    return tree


def _random_override(rng: random.Random) -> str:
    group = rng.choice([*GROUPS, "nosuch"])
    key = rng.choice(KEYS.get(group, ["x"]) + OLD_KEYS + ["", "a.b.c"])
    raw = rng.choice(RAW_VALUES + [str(v) for v in BAD_VALUES[:30]])
    return rng.choice([f"{group}.{key}={raw}", f"{group}.{key}", f"{group}={raw}", f".{key}={raw}", f"{raw}={raw}",
                       f"{group}.{key}={raw}{rng.choice(RAW_VALUES)}", f"{group}.{key}=={raw}"])


def _check(make, inputs, tolerate=lambda e: False) -> None:
    crashes: dict[tuple, object] = {}
    for arg in inputs:
        try:
            make(arg)
        except ValueError as e:
            if "\n" in str(e):
                crashes.setdefault(("multi-line ValueError", str(e).splitlines()[0][:60]), arg)
        except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
            if not tolerate(e):
                crashes.setdefault((type(e).__name__, str(e)[:80]), arg)
    assert not crashes, "\n".join(f"{kind}: {arg!r:.300}" for kind, arg in crashes.items())


def test_fuzz_config_trees():
    rng = random.Random(SEED)
    _check(build_config, [_random_tree(rng) for _ in range(CASES)])


def test_fuzz_dotted_overrides():
    rng = random.Random(SEED + 1)
    cases = [[_random_override(rng) for _ in range(rng.randint(1, 3))] for _ in range(CASES)]
    _check(lambda overrides: load_config(None, overrides), cases)


@pytest.mark.parametrize("override", ["trainer.total_steps=[1,2", "model.path=*x", "data.seed=a: b: c"])
def test_override_that_is_not_yaml_is_one_line(override):
    with pytest.raises(ValueError):
        load_config(None, [override])


@pytest.mark.parametrize("preset", [["grpo"], {"a": 1}])
def test_unhashable_preset_is_one_line(preset):
    with pytest.raises(ValueError):
        build_config({"algo": {"preset": preset}})


@pytest.mark.parametrize("text", ["[1, 2]", "just text"])
def test_yaml_file_that_is_not_a_mapping_is_one_line_naming_it(tmp_path, text):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match="run.yaml: top level must be a mapping"):
        load_config(str(f))


def test_fuzz_reward_specs():
    rng = random.Random(SEED + 2)
    names = ["exact_match", "last_number", "gsm8k", "format", "exact_mach", "", "nosuchmod:fn", "hybridrl.nosuch:fn",
             "math:sqrt", "/nonexistent/r.py:fn", ":fn", "x.py:", "::", "a:b:c", "json:nosuch"]

    def entry():
        keys = ["name", "weight", "label", "pattern", "flags", 1]
        e = {rng.choice(keys): _value(rng) for _ in range(rng.randint(0, 3))}
        if rng.random() < 0.7:
            e["name"] = rng.choice(names)
        return e if rng.random() < 0.9 else _value(rng)

    specs = [rng.choice(names) if rng.random() < 0.3 else [entry() for _ in range(rng.randint(0, 3))]
             for _ in range(CASES)]
    _check(build_reward, specs)


# ---- dataset rows ---------------------------------------------------------------------
MAX_PROMPT = 40
MESSAGE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}a:"


def _random_text(rng: random.Random) -> str:
    alphabet = "0123456789+-*= " if rng.random() < 0.6 else "0123456789+-=xyzé\u00a0\ud800\U0001f600\t\x00"
    n = rng.choice([0, 1, 3, 8, 30, 60, 20_000 if rng.random() < 0.05 else 12])
    return "".join(rng.choice(alphabet) for _ in range(n))


def _random_row(rng: random.Random) -> bytes:
    """One jsonl line (bytes, no newline): sometimes valid, mostly malformed."""
    kind = rng.randrange(10)
    if kind == 0:  # broken JSON
        return rng.choice([b"{", b"not json", b'{"prompt": "1+1=",}', b"[" * 5000, b"NaN", b"nul", b'"\\ud800"',
                           b'{"prompt": "1', b"\xef\xbb\xbf{}", b"{}" * 3])
    if kind == 1:  # invalid UTF-8 inside an otherwise good row
        return b'{"prompt": "1+' + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + b'="}'
    if kind == 2:  # the row is not an object
        return json.dumps(rng.choice([1, "1+1=", [1, 2], None, True, 1e308])).encode()
    if kind in (3, 4):  # chat messages, often malformed
        msgs = rng.choice([[], [{}], [{"role": "user"}], [{"role": "user", "content": _random_text(rng)}],
                           [{"role": 5, "content": [1, 2]}], [{"role": "user", "content": None}], ["hi"], [[1]],
                           [{"role": "user", "content": {"nested": {"deep": [1]}}}]])
        row = {"prompt": msgs, "answer": _random_text(rng)}
    else:  # a text prompt of the wrong type, length or content, with odd answers and keys
        prompt = rng.choice([_random_text(rng), _random_text(rng), 7, 1.5, None, True, {"text": "1"}, [1, "a"]])
        row = {rng.choice(["prompt", "prompt", "prompt", "question", ""]): prompt,
               "answer": rng.choice([_random_text(rng), None, 3, math.nan, [1], {"a": None}])}
    try:
        return json.dumps(row).encode("utf-8", "surrogatepass")
    except ValueError:
        return b"{}"


@pytest.mark.parametrize("templated", [False, True])
def test_fuzz_dataset_rows(tmp_path, templated):
    rng = random.Random(SEED + 3 + templated)
    tokenizer = builtin_tokenizer()
    if templated:  # a tokenizer that renders chat messages, so malformed ones reach the template
        tokenizer = build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz:\n")
        tokenizer.chat_template = MESSAGE_TEMPLATE
    total_rows, chat_errors = 0, 0
    for file_no in range(40):
        rows = [_random_row(rng) for _ in range(rng.randint(20, 60))]
        if not templated and rng.random() < 0.5:  # half the files: no chat rows, to see every row counted
            rows = [r for r in rows if b'"role"' not in r]
        lines = rows + [b"", b"   "]
        rng.shuffle(lines)
        path = tmp_path / f"f{file_no}.jsonl"
        path.write_bytes(b"\n".join(lines) + rng.choice([b"", b"\n"]))
        expected = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
        try:
            records, report = load_prompt_files([str(path)], tokenizer, prompt_key="prompt", answer_key="answer",
                                                max_prompt_length=MAX_PROMPT)
        except ValueError as e:  # only a setup problem stops a file: chat rows without a chat template
            assert not templated and "chat_template" in str(e) and "\n" not in str(e), e
            chat_errors += 1
            continue
        assert report.loaded + sum(report.skipped.values()) == expected, (path, report.summary())
        assert set(report.first) == set(report.skipped)
        assert all(0 < len(r.prompt_ids) <= MAX_PROMPT and r.source.startswith(f"{path}:") for r in records)
        assert all(isinstance(i, int) for r in records for i in r.prompt_ids)
        total_rows += expected
    assert total_rows >= (1000 if templated else 600) and (templated or chat_errors > 0)
