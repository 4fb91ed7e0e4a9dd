"""reasoning-gym as a task source (``data.task=reasoning_gym:<dataset>[,<dataset>...]``).

reasoning-gym's procedural generators (offline, seeded) give the prompts; each prompt's
ground truth is a :class:`ReasoningGymAnswer` carrying what the dataset's
``score_answer(answer, entry)`` needs (the dataset name, its generator settings and the
entry), which the ``reasoning_gym`` reward (``rewards/reasoning_gym.py``) calls.

Several datasets mix round-robin (prompt ``i`` from dataset ``i % D``). Each (split,
dataset) draws from its own seed derived from ``data.seed``; reasoning-gym seeds an item
from ``seed + index``, so two nearby seeds would share most items: the derived seeds are
hashed apart, and the held-out questions are also removed from the training split (and
duplicates within a split dropped), so no question appears in both.

reasoning-gym is an optional dependency (``pip install 'hybridrl[reasoning]'``), imported
only here, inside functions.
"""

from __future__ import annotations

import difflib
import random
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

PREFIX = "reasoning_gym:"
INSTALL = "pip install 'hybridrl[reasoning]'"
ANSWER_TAG = "<answer>"
MAX_CHUNKS = 4  # generator chunks per (split, dataset) before a small question space stops the draw
_RESERVED = ("seed", "size")  # data.seed and data.train_size / eval_size set these


def import_reasoning_gym():
    """The ``reasoning_gym`` module, or a one-line error naming the extra to install."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"data.task={PREFIX}...: needs the reasoning-gym package; {INSTALL}") from None
    return reasoning_gym


def dataset_names(task: str) -> list[str]:
    """``"reasoning_gym:a,b"`` -> ``["a", "b"]`` (not checked against reasoning-gym)."""
    return [n.strip() for n in task[len(PREFIX):].split(",") if n.strip()]


def check_task(task: str, settings: dict[str, Any]) -> None:
    """Raise a one-line ValueError unless every dataset of ``task`` exists in reasoning-gym
    and ``settings`` (``data.reasoning_gym``) are valid generator settings of those datasets."""
    from hybridrl.did_you_mean import suggest

    names = dataset_names(task)
    if not names:
        raise ValueError(f"data.task={task!r}: name at least one dataset, e.g. {PREFIX}chain_sum")
    if len(set(names)) != len(names):
        raise ValueError(f"data.task={task!r}: a dataset is named twice; name each once")
    valid = sorted(set(_registry()) - {"composite"})  # composite: mixing is data.task's list
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = suggest(name, valid) if close else (
                f"it has {len(valid)} ({', '.join(valid[:3])}, ...), listed by "
                "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'")
            raise ValueError(f"data.task={task!r}: unknown reasoning-gym dataset {name!r}; {hint}")
    for name, options in settings.items():
        if name not in names:
            raise ValueError(f"data.reasoning_gym.{name}: not a dataset of data.task={task!r}; "
                             f"{suggest(name, names)}")
        _generator_config(name, options)


def _registry() -> dict:
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _generator_config(name: str, options: Any):
    """Dataset ``name``'s config object from ``options``, or a one-line error."""
    key = f"data.reasoning_gym.{name}"
    if not isinstance(options, dict):
        raise ValueError(f"{key}={options!r}: give a mapping of generator settings, e.g. {{min_terms: 2}}")
    config_cls = _registry()[name][1]
    valid = [f.name for f in fields(config_cls) if f.name not in _RESERVED]
    reserved = sorted(set(options) & set(_RESERVED))
    if reserved:
        raise ValueError(f"{key}.{reserved[0]}: set by data.seed / data.train_size / data.eval_size; remove it")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown setting; {name} takes {', '.join(valid)}")
    try:
        config = config_cls(**options)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as e:  # noqa: BLE001 - AssertionError / ValueError / TypeError from the generator's checks
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{key}={options!r}: rejected by reasoning-gym ({why}); fix the settings") from None
    return config


@dataclass
class ReasoningGymAnswer:
    """A prompt's ground truth: what ``score_answer(answer, entry)`` of dataset ``dataset``
    built with ``settings`` needs. Picklable (plain data); ``str()`` is the reference answer."""

    dataset: str
    entry: dict[str, Any]  # reasoning-gym's item: question, answer, metadata
    settings: dict[str, Any] = field(default_factory=dict)
    tagged: bool = False  # the prompt asks for <answer>...</answer>: the reward reads only the tags

    def __str__(self) -> str:
        return str(self.entry.get("answer"))


@dataclass
class Problem:
    """One prompt: its token ids, ground truth, text for the reward, and the reference
    response (the warm start's demonstration)."""

    prompt_ids: list[int]
    answer: ReasoningGymAnswer
    text: str
    demonstration: str


@dataclass
class DrawReport:
    train: int = 0
    held_out: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> prompts
    lengths: list[int] = field(default_factory=list)  # prompt tokens of the kept prompts
    unknown_chars: int = 0  # kept prompts with characters the tokenizer maps to its unk token

    def summary(self) -> str:
        lens = sorted(self.lengths) or [0]
        skipped = ", ".join(f"{n} {why}" for why, n in self.skipped.items()) or "none"
        unk = f", {self.unknown_chars} with characters the tokenizer lacks" if self.unknown_chars else ""
        return (f"{self.train} train / {self.held_out} held-out prompts, prompt tokens {lens[0]}.."
                f"{lens[-1]} (median {lens[len(lens) // 2]}), skipped: {skipped}{unk}")


def draw_splits(task: str, settings: dict[str, Any], *, train_size: int, eval_size: int,
                seed: int) -> tuple[list[ReasoningGymAnswer], list[ReasoningGymAnswer]]:
    """``(train, held_out)`` items, deterministic in ``seed``; no question is in both.

    Per dataset, held-out first (its share of ``eval_size``), then train without those
    questions. A dataset whose question space is small yields fewer (after ``MAX_CHUNKS``
    chunks); when it ran out for train, its held-out part keeps at most half of the
    questions drawn (as the arithmetic task's split does) and gives the rest to train."""
    check_task(task, settings)
    names = dataset_names(task)
    seen: set[str] = set()
    trains, held_outs = [], []
    for n in names:
        options = settings.get(n, {})
        held_out = _draw(n, options, _share(eval_size, names, n), _seed(seed, "eval", n), seen)
        want = _share(train_size, names, n)
        train = _draw(n, options, want, _seed(seed, "train", n), seen)
        keep = (len(held_out) + len(train)) // 2
        if len(train) < want and len(held_out) > keep:
            train, held_out = train + held_out[keep:], held_out[:keep]
        trains.append(train)
        held_outs.append(held_out)
    return _round_robin(trains), _round_robin(held_outs)


def _share(total: int, names: list[str], name: str) -> int:
    i = names.index(name)
    return total // len(names) + (i < total % len(names))


def _seed(seed: int, split: str, name: str, chunk: int = 0) -> int:
    """A 32-bit generator seed per (data.seed, split, dataset, chunk), hashed apart (see the module doc)."""
    return random.Random(f"{seed}:{split}:{name}:{chunk}").getrandbits(32)


def _draw(name: str, options: dict, count: int, seed: int, seen: set[str]) -> list[ReasoningGymAnswer]:
    """``count`` items of ``name`` whose questions are not in ``seen`` (which they join)."""
    import reasoning_gym

    out: list[ReasoningGymAnswer] = []
    for chunk in range(MAX_CHUNKS):
        if len(out) >= count:
            break
        chunk_seed = seed if chunk == 0 else random.Random(f"{seed}:{chunk}").getrandbits(32)
        ds = reasoning_gym.create_dataset(name, seed=chunk_seed, size=count - len(out), **options)
        for i in range(len(ds)):
            entry = ds[i]
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(ReasoningGymAnswer(name, entry, dict(options)))
    return out


def _round_robin(lists: list[list]) -> list:
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def render_problems(items: list[ReasoningGymAnswer], tokenizer, *, system_prompt: str | None,
                    max_prompt_length: int, report: DrawReport) -> list[Problem]:
    """Each item as a chat prompt (``system_prompt`` first when given) rendered with the
    tokenizer's chat template, or as text when it has none; prompts over
    ``max_prompt_length`` tokens are skipped and counted in ``report``."""
    from hybridrl.data.files import render_prompt, with_system_prompt

    chat = bool(getattr(tokenizer, "chat_template", None))
    unk = tokenizer.unk_token_id
    out = []
    for item in items:
        question = item.entry["question"]
        prompt = [{"role": "user", "content": question}] if chat else question
        ids = render_prompt(tokenizer, with_system_prompt(prompt, system_prompt))
        if len(ids) > max_prompt_length:
            report.skipped["longer than data.max_prompt_length"] += 1
            continue
        item.tagged = ANSWER_TAG in question or ANSWER_TAG in (system_prompt or "")
        truth = str(item)
        report.lengths.append(len(ids))
        report.unknown_chars += unk is not None and unk in ids
        out.append(Problem(ids, item, question, f"{ANSWER_TAG}{truth}</answer>" if item.tagged else truth))
    return out


def reasoning_gym_problems(task: str, settings: dict[str, Any], tokenizer, *, sizes: tuple[int, int], seed: int,
                           system_prompt: str | None, max_prompt_length: int
                           ) -> tuple[list[Problem], list[Problem], DrawReport]:
    """``(train, held_out, report)`` for ``data.task``: ``sizes`` = (train, held-out)
    prompts drawn (fewer kept when some are too long or the question space is small)."""
    train_items, eval_items = draw_splits(task, settings, train_size=sizes[0], eval_size=sizes[1], seed=seed)
    report = DrawReport()
    train = render_problems(train_items, tokenizer, system_prompt=system_prompt,
                            max_prompt_length=max_prompt_length, report=report)
    held_out = render_problems(eval_items, tokenizer, system_prompt=system_prompt,
                               max_prompt_length=max_prompt_length, report=report)
    report.train, report.held_out = len(train), len(held_out)
    return train, held_out, report
