"""Name validation: which HF names a refit must send, checked before anything is written.

Every engine weight must be written exactly once per refit. The names, their HF shapes
and the names to ignore come from the engine's route table (``engine.weight_routes``, the
one HF-name -> slot mapping, owned by the rollout side); this module only judges what the
producer sends against it. A bucket is validated as a whole — unknown names, duplicates
(within the bucket or already written this refit), shape and dtype mismatches — *before*
any of it is written, and all problems are reported in one error, so a rejected bucket
leaves the engine as it was.

Missing names can only be known once the producer says what it will send. So a refit
announces its name set in ``begin(names=...)`` and the set is checked against the
engine's before anything is written: a partial layout (the classic "fused / MoE weight
skipped by name matching") is rejected with the engine unchanged. ``refit_from_model``
always announces. A session begun without names is taken to announce the engine's full
set; if the stream then ends short, ``finish()`` cannot undo what was written (that
would need a model-sized staging copy, which bucketing exists to avoid): it raises, does
not advance ``weight_version``, and still leaves layouts and caches consistent.

Tied embeddings: ``lm_head.weight`` is then in ``routes.ignored``: accepted and skipped
(the head *is* the embedding storage, so it stays tied).
"""
from __future__ import annotations

from typing import Iterable

import torch

from hybridrl.refit.errors import RefitError
from hybridrl.rollout.backend import bucket_problems, describe_problems


def check_announced(routes, names: Iterable[str], *, partial: bool = False) -> None:
    """The announced set must be exactly ``routes.expected`` (ignored names tolerated);
    ``partial``: a subset of it (no unknown or duplicate names, nothing else required)."""
    seen, dup = set(), set()
    for n in names:
        (dup if n in seen else seen).add(n)
    seen -= routes.ignored
    unknown = {n for n in seen if n not in routes}
    # a fused weight may come as its per-expert pieces (MoE checkpoints): the route table
    # says which names cover which weight, and a weight sent in both forms is a duplicate
    dup |= set(_overlapping(routes, seen - unknown))
    missing = set() if partial else _missing(routes, seen - unknown)
    _raise_if("announced refit", missing=missing, unknown=unknown, duplicate=dup)


def _missing(routes, written: set[str]) -> set[str]:
    missing = getattr(routes, "missing", None)
    return missing(written) if missing is not None else routes.expected - written


def _overlapping(routes, names: set[str]) -> set[str]:
    overlapping = getattr(routes, "overlapping", None)
    return set(overlapping(names)) if overlapping is not None else set()


def check_bucket(routes, named: list[tuple[str, torch.Tensor]], written: set[str]
                 ) -> list[tuple[str, torch.Tensor]]:
    """Validate a whole bucket against ``routes``; return the pairs to load (ignored ones dropped).
    The checks are the ones both backends share (``rollout/backend.py: bucket_problems``)."""
    kept, problems = bucket_problems(routes, named, written)
    _raise_if("refit bucket", **problems)
    return kept


def _raise_if(where: str, **problems) -> None:
    described = describe_problems(problems)
    if described:
        raise RefitError(f"{where} rejected, engine unchanged — " + described
                         + "; send each name of engine.expected_weight_names() exactly once "
                         "with the shape of engine.weight_spec(name)")
