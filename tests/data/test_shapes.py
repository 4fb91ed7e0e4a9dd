"""The built-in visual task: deterministic, disjoint splits; answers uniform over 0..max_count;
the teacher's slip is the count of every shape, present exactly when other colours are on the
board; the board's background normalizes to ~0 under the Qwen-VL image processor."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from hybridrl.data.shapes import BACKGROUND, COLOURS, draw_board, make_example, shapes_splits
from tests._seeds import fresh_seed


def test_splits_are_deterministic_and_disjoint():
    seed = fresh_seed()
    train, held_out = shapes_splits(train_size=300, eval_size=60, seed=seed)
    again, _ = shapes_splits(train_size=300, eval_size=60, seed=seed)
    assert [x.key for x in train] == [x.key for x in again]
    assert not {x.key for x in train} & {x.key for x in held_out}, f"seed {seed}"


def test_answers_and_the_teachers_slip():
    rng = random.Random(fresh_seed())
    examples = [make_example(rng, cells=4, cell=28, max_count=4) for _ in range(2000)]
    counts = Counter(x.answer for x in examples)
    assert set(counts) == {"0", "1", "2", "3", "4"} and min(counts.values()) > 300  # ~400 each
    for x in examples[:200]:
        colour = x.question.removeprefix("How many ").removesuffix("?")
        pixels = np.asarray(x.image).reshape(4, 28, 4, 28, 3)[:, 14, :, 14]  # each cell's centre
        asked = sum(tuple(p) == COLOURS[colour] for p in pixels.reshape(-1, 3))
        shapes = sum(tuple(p) != BACKGROUND for p in pixels.reshape(-1, 3))
        assert int(x.answer) == asked
        assert x.slip == (str(shapes) if shapes != asked else None)


def test_the_background_normalizes_to_about_zero():
    from transformers import Qwen2VLImageProcessorPil

    board = draw_board(random.Random(0), [], cells=4, cell=28)
    out = Qwen2VLImageProcessorPil()(images=[board], return_tensors="pt")
    assert float(out["pixel_values"].abs().max()) < 0.05
