"""The staleness bound, enforced where it cannot starve anything: at admission.

Versions: the trainer's policy advances one weight version per RL step, so step ``s``
trains with version ``version_of_step(s) = base + s``. A token sampled with version ``w``
and trained at step ``s`` is ``version_of_step(s) - w`` versions stale. A sample's
generation starts at the version its worker holds when its request is admitted, and
later tokens (continued after a refit: partial rollouts) only carry newer versions.

**The rule.** The groups of step ``s`` are admitted to a worker holding version ``w`` only
if ``version_of_step(s) - w <= max_staleness``. Every token of step ``s`` is then at most
``max_staleness`` versions stale, whatever the timing: generation is throttled (capacity
``(max_staleness + 1)`` steps of groups), never a long answer discarded — a sample is
trained at the step it was admitted for, however long it took.
"""

from __future__ import annotations

import torch


def last_admissible_step(worker_version: int, *, base: int, max_staleness: int) -> int:
    """The latest step whose groups may start on a worker holding ``worker_version``
    (``version_of_step(s) = base + s``)."""
    return worker_version - base + max_staleness


def staleness_metrics(token_versions: torch.Tensor, mask: torch.Tensor, train_version: int,
                      max_staleness: int) -> dict[str, float]:
    """Per-token staleness of one step's batch: mean, max, the share of tokens generated
    under an older version, and the histogram ``async/staleness_hist_{d}`` (share of
    tokens ``d`` versions stale, d = 0..max_staleness).

    ``token_versions`` ``[B, L]`` int (-1 outside responses), ``mask`` ``[B, L]`` the
    response mask. Raises ``ValueError`` if any token breaks the bound (a bug, never data).
    """
    lag = (train_version - token_versions)[mask.bool()]
    if lag.numel() == 0:
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0, "async/stale_token_fraction": 0.0}
    worst = int(lag.max())
    if worst > max_staleness or int(lag.min()) < 0:
        raise ValueError(f"staleness bound broken: a token {worst} versions stale (min {int(lag.min())}) trained "
                         f"at version {train_version} with pipeline.max_staleness={max_staleness}")
    out = {"async/staleness_mean": float(lag.float().mean()), "async/staleness_max": float(worst),
           "async/stale_token_fraction": float((lag > 0).float().mean())}
    counts = torch.bincount(lag, minlength=max_staleness + 1).float() / lag.numel()
    out.update({f"async/staleness_hist_{d}": float(c) for d, c in enumerate(counts.tolist())})
    return out
