"""One seed per test, printed when it fails, replayed with ``pytest --seed N``.

The suite-wide rule (``tests/conftest.py`` applies it to every test): before a test runs,
Python's ``random``, NumPy's and torch's global generators are seeded from the test's seed,
so what a test draws never depends on which tests ran before it on its xdist worker.
A test that draws its own configs calls :func:`fresh_seed` (a new number per call, derived
from the test's seed) and names the value in its assertion messages. The seed is fresh per
run (new inputs every run), unless ``--seed N`` or ``HYBRIDRL_TEST_SEED=N`` fixes it; a
failing test's report ends with the line that replays it.
"""
from __future__ import annotations

import os
import random

ENV = "HYBRIDRL_TEST_SEED"
_state = {"seed": 0, "calls": 0}


def choose(option: int | None) -> int:
    """The seed of the next test: ``--seed``, else ``$HYBRIDRL_TEST_SEED``, else a fresh one."""
    if option is not None:
        return option
    if os.environ.get(ENV):
        return int(os.environ[ENV])
    return random.SystemRandom().randrange(1 << 30)


def begin(seed: int) -> None:
    """Seed every global generator for one test."""
    import numpy as np
    import torch

    _state.update(seed=seed, calls=0)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def current() -> int:
    return _state["seed"]


def fresh_seed() -> int:
    """A new seed per call within a test, a function of the test's seed (replayable)."""
    _state["calls"] += 1
    return random.Random(f"{_state['seed']}:{_state['calls']}").randrange(1 << 30)
