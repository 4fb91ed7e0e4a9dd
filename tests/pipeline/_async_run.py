"""The tiny async job the pipeline's end-to-end tests run (seconds per run)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from _tiny import TINY_MODEL  # noqa: E402

TRAIN_SIZE = 300
ASYNC_JOB = TINY_MODEL + [f"data.train_size={TRAIN_SIZE}", "data.eval_size=16", "warm_start.steps=5",
                          "trainer.eval_every=100", "trainer.threads=1", "logging.plot=false",
                          "logging.tensorboard=false", "trainer.mode=async"]


def planned_rows(steps: int, prompts_per_step: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """``(step, group, training-set row)`` of every group a run trains, derived by hand: the
    loop's prompt RNG is ``random.Random(trainer.seed + 1)``, each step draws its prompts
    without replacement and then one seed per prompt (``RLStep._draw``)."""
    import random

    rng, out = random.Random(seed + 1), []
    for s in range(1, steps + 1):
        rows = rng.sample(range(TRAIN_SIZE), prompts_per_step)
        [rng.randrange(2**62) for _ in rows]
        out.extend((s, g, r) for g, r in enumerate(rows))
    return out
