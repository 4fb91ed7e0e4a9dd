"""Seeded fuzzing of what users type and feed: config trees, dotted overrides, reward specs
and dataset rows. Every malformed input must end as a one-line ``ValueError`` (ConfigError
is one) naming the key, or, for a dataset row, as a row skipped and counted; never a
traceback of another exception type. An input that is *accepted* must have become a valid
value: a config whose every field has its annotated type, finite numbers, no negative
integer unless the field's help documents one (``-1 = off``); a reward whose weights are
finite. Silent acceptance of garbage (a NaN or infinite number, a negative count, a list
where a mapping goes) fails as a crash does. Failures print a reproducer (the input) per
kind of problem, and the test's seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import types
import typing

import pytest
import yaml

import _seeds
from hybridrl.config import GROUPS
from hybridrl.config.io import RENAMED, build_config, load_config
from hybridrl.data.char_tokenizer import build_char_tokenizer
from hybridrl.data.files import load_prompt_files
from hybridrl.rewards import build_reward
from hybridrl.job.model_factory import builtin_tokenizer

CASES = 1500  # per fuzz test (seconds each; the exhaustive per-key test takes longest)


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


def _check(make, inputs, valid=lambda arg, made: None, tolerate=lambda e: False, seed=None) -> None:
    """``make(arg)`` for every input: a one-line ValueError, or a result that ``valid``
    finds nothing wrong with (it returns what is wrong, or None)."""
    crashes: dict[tuple, object] = {}
    for arg in inputs:
        try:
            made = make(arg)
        except ValueError as e:
            if "\n" in str(e):
                crashes.setdefault(("multi-line ValueError", str(e).splitlines()[0][:60]), arg)
        except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
            if not tolerate(e):
                crashes.setdefault((type(e).__name__, str(e)[:80]), arg)
        else:
            wrong = valid(arg, made)
            if wrong is not None:
                crashes.setdefault(("accepted garbage", wrong), arg)
    assert not crashes, f"seed {seed}:\n" + "\n".join(f"{kind}: {arg!r:.300}" for kind, arg in crashes.items())


def _garbage(value, tp, key: str, help_text: str) -> str | None:
    """What is wrong with ``value`` as a value of annotation ``tp`` (None: nothing)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        found = [_garbage(value, a, key, help_text) for a in args if a is not type(None)]
        return None if None in found else " and ".join(found)
    if origin is list:
        if not isinstance(value, list):
            return f"{key}: a {type(value).__name__} where a list goes"
        return next((w for w in (_garbage(v, args[0], key, help_text) for v in value) if w), None)
    if origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        return None if ok else f"{key}: a {type(value).__name__} where a mapping with string keys goes"
    if tp is bool or tp is str:
        return None if type(value) is tp else f"{key}: a {type(value).__name__} where a {tp.__name__} goes"
    if tp is int:
        if type(value) is not int:
            return f"{key}: a {type(value).__name__} where an integer goes"
        if value < 0 and "-1" not in help_text:  # a documented sentinel ("-1 = off") is a value
            return f"{key}: a negative integer"
        return None
    if tp is float:
        if type(value) is not float:
            return f"{key}: a {type(value).__name__} where a number goes"
        return None if math.isfinite(value) else f"{key}: a non-finite number"
    return None


def _config_garbage(cfg, prefix: str = "") -> str | None:
    """The first field of a built config (or group) whose value is garbage, described."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            wrong = _config_garbage(value, f"{prefix}{f.name}.")
        else:
            wrong = _garbage(value, hints[f.name], prefix + f.name, f.metadata.get("help", ""))
        if wrong:
            return wrong
    return None


def _valid_config(arg, cfg) -> str | None:
    return _config_garbage(cfg)


def test_fuzz_config_trees():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _check(build_config, [_random_tree(rng) for _ in range(CASES)], _valid_config, seed=seed)


def test_fuzz_dotted_overrides():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    cases = [[_random_override(rng) for _ in range(rng.randint(1, 3))] for _ in range(CASES)]
    _check(lambda overrides: load_config(None, overrides), cases, _valid_config, seed=seed)


def _single(key: str, value) -> dict:
    """A config tree that sets one dotted key (``algo.kl.coef``) to ``value``."""
    tree: dict = {}
    node = tree
    *parents, name = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[name] = value
    return tree


def _leaf_keys(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [key for f in dataclasses.fields(cls)
            for key in (_leaf_keys(hints[f.name], f"{prefix}{f.name}.") if dataclasses.is_dataclass(hints[f.name])
                        else [prefix + f.name])]


LEAF_KEYS = [key for group, cls in GROUPS.items() for key in _leaf_keys(cls, group + ".")]


def _parsed(value) -> str:
    """An override's text as the config reads it (YAML: ``1_000`` is 1000)."""
    try:
        return str(yaml.safe_load(value)) if isinstance(value, str) else str(value)
    except yaml.YAMLError:
        return str(value)


@pytest.mark.parametrize("how", ["tree", "override"])
def test_every_key_refuses_each_bad_value_by_name_or_takes_a_valid_one(how):
    """Every leaf key with every bad value (and, as an override, every raw text): a one-line
    ValueError that names the key (or, for a check across keys, the value), or a config in
    which every field is valid. Exhaustive, so no seed decides what is covered."""
    problems: dict[tuple, str] = {}
    values = BAD_VALUES if how == "tree" else RAW_VALUES + [str(v) for v in BAD_VALUES[:30]]
    for key in LEAF_KEYS:
        for value in values:
            case = f"{key}={value!r:.60}"
            try:
                cfg = build_config(_single(key, value)) if how == "tree" else load_config(None, [f"{key}={value}"])
            except ValueError as e:
                line = str(e)
                if "\n" in line:
                    problems.setdefault(("multi-line ValueError", key), case)
                elif key not in line and str(value)[:40] not in line and _parsed(value)[:40] not in line:
                    problems.setdefault(("error names neither the key nor the value", key), f"{case}: {line[:160]}")
                continue
            except Exception as e:  # noqa: BLE001 - what this test is looking for
                problems.setdefault((type(e).__name__, key), f"{case}: {str(e)[:80]}")
                continue
            wrong = _config_garbage(cfg)
            if wrong is not None:
                problems.setdefault(("accepted garbage", key), f"{case}: {wrong}")
    assert not problems, "\n".join(f"{kind} {key}: {case}" for (kind, key), case in problems.items())


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
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
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
    _check(build_reward, specs, _valid_reward, seed=seed)


def _valid_reward(spec, fn) -> str | None:
    """An accepted spec is a callable; a weighted sum's weights finite floats, its labels named."""
    if not callable(fn):
        return f"not callable: {type(fn).__name__}"
    for label, part, weight in getattr(fn, "parts", []):
        if type(weight) is not float or not math.isfinite(weight):
            return f"weight {weight!r} of {label!r}"
        if not isinstance(label, str) or not label or not callable(part):
            return f"component {label!r}"
    return None


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
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    tokenizer = builtin_tokenizer()
    if templated:  # a tokenizer that renders chat messages, so malformed ones reach the template
        tokenizer = build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz:\n")
        tokenizer.chat_template = MESSAGE_TEMPLATE
    loaded_files, chat_errors = 0, 0
    for file_no in range(40):
        rows = [_random_row(rng) for _ in range(rng.randint(20, 60))]
        if not templated and file_no % 2 == 0:  # half the files: no chat rows, to see every row counted
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
            assert not templated and "chat_template" in str(e) and "\n" not in str(e), (seed, e)
            chat_errors += 1
            continue
        assert report.loaded + sum(report.skipped.values()) == expected, (seed, path, report.summary())
        assert set(report.first) == set(report.skipped), seed
        assert all(0 < len(r.prompt_ids) <= MAX_PROMPT and r.source.startswith(f"{path}:") for r in records), seed
        assert all(isinstance(i, int) for r in records for i in r.prompt_ids), seed
        loaded_files += 1
    # with the template every file loads; without it the 20 files without chat rows do, and the other 20
    # (400+ rows, 8.9% of them chat rows: 2 of 10 kinds x 4 of 9 message lists) hold none with a chance
    # 0.911**400 < 1e-16
    assert loaded_files == 40 if templated else (loaded_files >= 20 and chat_errors > 0), (seed, loaded_files)
