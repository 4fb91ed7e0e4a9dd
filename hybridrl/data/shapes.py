"""The built-in visual task (``data.task=shapes``): count the shapes of one colour in a picture.

Each picture is a ``cells x cells`` board of ``cell``-pixel squares (one vision patch each,
so the task is about what the policy sees, not about resampling); some squares hold a
filled shape (square, disc or diamond) in one of ``COLOURS``. The question names a colour:
``How many red?``; the answer is the number of shapes of that colour (0 to ``max_count``).

Like the arithmetic task's teacher, this one has a systematic slip, for the warm start:
it counts *every* shape, whatever the colour (``slip``), a mistake the picture alone
reveals and only the reward corrects. Pictures are drawn from a seed; the held-out split
never repeats a (picture, question) of the training split.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (230, 210, 20)}
# the image processors' normalization mean (OpenAI CLIP's, which Qwen-VL uses): the background normalizes to
# ~0, so even a random-init vision tower (the built-in tiny policies') sees the shapes, not the paper (measured:
# on a white board the features are one shared vector plus a small per-shape part, and the tiny
# policy cannot even overfit 32 pictures; on this board it fits them in 50 steps)
BACKGROUND = (122, 116, 104)
SHAPES = ("square", "disc", "diamond")


@dataclass(frozen=True)
class ShapesExample:
    image: object
    """a PIL RGB image, ``cells * cell`` pixels square."""
    question: str
    answer: str
    slip: str | None
    """the teacher's slip (the count of every shape) when it differs from the answer, else None."""
    key: str
    """content hash of the picture and question (split disjointness)."""


def draw_board(rng: random.Random, shapes: list[str], *, cells: int, cell: int):
    """A board with one shape per colour in ``shapes`` at distinct random squares (PIL image)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (cells * cell, cells * cell), BACKGROUND)
    draw = ImageDraw.Draw(img)
    spots = rng.sample([(r, c) for r in range(cells) for c in range(cells)], len(shapes))
    pad = max(1, cell // 7)
    for (r, c), colour in zip(spots, shapes):
        x0, y0, x1, y1 = c * cell + pad, r * cell + pad, (c + 1) * cell - pad - 1, (r + 1) * cell - pad - 1
        fill, shape = COLOURS[colour], rng.choice(SHAPES)
        if shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif shape == "disc":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            mx, my = (x0 + x1) // 2, (y0 + y1) // 2
            draw.polygon([(mx, y0), (x1, my), (mx, y1), (x0, my)], fill=fill)
    return img


def make_example(rng: random.Random, *, cells: int, cell: int, max_count: int) -> ShapesExample:
    """The asked count is uniform over [0, max_count] (chance accuracy 1 / (max_count + 1));
    0-3 shapes of other colours are the distractors the teacher's slip counts too."""
    colour = rng.choice(list(COLOURS))
    count, others = rng.randint(0, max_count), rng.randint(0, 3)
    if count + others == 0:
        others = 1
    shapes = [colour] * count + [rng.choice([c for c in COLOURS if c != colour]) for _ in range(others)]
    img = draw_board(rng, shapes, cells=cells, cell=cell)
    question = f"How many {colour}?"
    key = hashlib.sha256(img.tobytes() + question.encode()).hexdigest()[:24]
    slip = str(len(shapes)) if others else None
    return ShapesExample(img, question, str(count), slip, key)


def shapes_splits(*, train_size: int, eval_size: int, seed: int, cells: int = 4, cell: int = 14,
                  max_count: int = 4) -> tuple[list[ShapesExample], list[ShapesExample]]:
    """Deterministic ``(train, eval)``; no (picture, question) of eval is in train."""
    rng = random.Random(seed)
    kw = dict(cells=cells, cell=cell, max_count=max_count)
    seen: set[str] = set()
    evals: list[ShapesExample] = []
    while len(evals) < eval_size:
        ex = make_example(rng, **kw)
        if ex.key not in seen:
            seen.add(ex.key)
            evals.append(ex)
    train: list[ShapesExample] = []
    attempts = 0
    while len(train) < train_size and attempts < 50 * train_size:
        attempts += 1
        ex = make_example(rng, **kw)
        if ex.key not in seen:
            train.append(ex)
    return train, evals
