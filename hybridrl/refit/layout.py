"""Name layout: which HF names a refit must write, where each lands, and bucket validation.

Every engine weight must be written exactly once per refit. A bucket is validated as a
whole — unknown names, duplicates (within the bucket or already written this refit),
shape and dtype mismatches — *before* any of it is written, and all problems are
reported in one error, so a rejected bucket leaves the engine as it was.

Missing names can only be known once the producer says what it will send. So a refit
announces its name set in ``begin(names=...)`` and the set is checked against the
engine's before anything is written: a partial layout (the classic "fused / MoE weight
skipped by name matching") is rejected with the engine unchanged. ``refit_from_model``
always announces. A session begun without names is taken to announce the engine's full
set; if the stream then ends short, ``finish()`` cannot undo what was written (that
would need a model-sized staging copy, which bucketing exists to avoid): it raises, does
not advance ``weight_version``, and still leaves layouts and caches consistent.

Tied embeddings: ``lm_head.weight`` is not among the expected names; if sent it is
accepted and ignored (the head *is* the embedding storage, so it stays tied).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.refit.errors import RefitError, listing
from hybridrl.rollout.layers.linear import LinearBase

TIED_HEAD = "lm_head.weight"
TRAINER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Route:
    """Where one HF tensor lands: ``param`` rows ``rows`` (all rows if unfused/non-linear)."""

    hf_name: str
    param: torch.nn.Parameter
    shard_id: str | int | None
    layer: LinearBase | None  # owning linear layer, None for embeddings / norms
    rows: slice | None

    @property
    def fp8(self) -> bool:
        """True when the slot is an FP8 weight (quantized on arrival)."""
        return self.layer is not None and self.param is self.layer.weight and hasattr(self.layer, "weight_scale")

    def held(self) -> torch.Tensor:
        """What the engine holds for this name: the slice, or its float32 dequantization."""
        if self.fp8:
            return self.layer.fp8_method.dequantize_rows(self.layer, self.rows)
        return self.param.data if self.rows is None else self.param.data[self.rows]

    def write(self, tensor: torch.Tensor) -> None:
        """Through the parameter's own ``weight_loader`` (the load path, run again)."""
        if self.shard_id is None:
            self.param.weight_loader(self.param, tensor)
        else:
            self.param.weight_loader(self.param, tensor, self.shard_id)


class NameLayout:
    """The engine's HF name set, each name's route and expected (shape, dtype)."""

    def __init__(self, engine):
        model = engine.model
        self.tied = bool(getattr(model.lm_head, "tied", False))
        self.expected = frozenset(model.hf_weight_names())
        params = dict(model.named_parameters(remove_duplicate=False))
        self.routes: dict[str, Route] = {}
        for hf_name in self.expected:
            name, shard_id = model.resolve(hf_name)
            mod_name, leaf = name.rsplit(".", 1)
            module = model.get_submodule(mod_name)
            layer = module if isinstance(module, LinearBase) else None
            rows = layer.shard_slice(shard_id) if layer is not None else None
            self.routes[hf_name] = Route(hf_name, params[name], shard_id, layer, rows)
        self.specs = {n: self._spec(engine, n) for n in self.expected}

    def _spec(self, engine, hf_name: str) -> tuple[torch.Size, torch.dtype]:
        if hasattr(engine, "weight_spec"):
            shape, dtype = engine.weight_spec(hf_name)
            return torch.Size(shape), dtype
        r = self.routes[hf_name]
        shape = r.param.shape if r.rows is None else torch.Size([r.rows.stop - r.rows.start, *r.param.shape[1:]])
        return shape, r.param.dtype

    def check_announced(self, names: Iterable[str]) -> None:
        """The announced set must be exactly the expected set (tied head tolerated)."""
        names = list(names)
        seen, dup = set(), set()
        for n in names:
            (dup if n in seen else seen).add(n)
        if self.tied:
            seen.discard(TIED_HEAD)
        self._raise_if("announced refit", missing=self.expected - seen,
                       unknown=seen - self.expected, duplicate=dup)

    def check_bucket(self, named: list[tuple[str, torch.Tensor]], written: set[str]) -> list[Route]:
        """Validate a whole bucket; return its routes in order (tied head dropped)."""
        seen, dup, unknown, bad = set(), set(), set(), []
        routes = []
        for name, t in named:
            if self.tied and name == TIED_HEAD:
                continue
            if name not in self.expected:
                unknown.add(name)
                continue
            if name in seen or name in written:
                dup.add(name)
            seen.add(name)
            shape, _ = self.specs[name]
            if tuple(t.shape) != tuple(shape):
                bad.append(f"{name} shape {tuple(t.shape)} != {tuple(shape)}")
            elif t.dtype not in TRAINER_DTYPES:
                bad.append(f"{name} dtype {t.dtype} is not a trainer float dtype {TRAINER_DTYPES}")
            routes.append(self.routes[name])
        self._raise_if("refit bucket", unknown=unknown, duplicate=dup, mismatched=bad)
        return routes

    @staticmethod
    def _raise_if(where: str, **problems) -> None:
        parts = [f"{kind} ({len(v)}): {listing(v)}" for kind, v in problems.items() if v]
        if parts:
            raise RefitError(f"{where} rejected, engine unchanged — " + "; ".join(parts)
                             + "; send each name of engine.expected_weight_names() exactly once "
                             "with the shape of engine.weight_spec(name)")
