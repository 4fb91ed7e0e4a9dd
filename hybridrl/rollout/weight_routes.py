"""The route table: every Hugging Face weight name -> its slot in the engine, built once.

A route says where one trainer tensor lands (parameter, fused shard, rows), what shape the
trainer must send, and how it is written (the parameter's own ``weight_loader``). The same
table serves the first load, every refit, and refit's validation and verification, so the
HF-name -> slot mapping exists once. It is derived from the model alone: the model's
``packed_modules_mapping`` (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) and each
linear layer's shard geometry.

Tensor parallel (``layers/tensor_parallel.py``): ``shape`` is still the whole HF tensor's
(what a trainer holds); ``tp`` says which part of it this rank holds. ``load`` and
``expected_held`` take either the whole tensor (sliced here) or exactly that part
(``local_shape``: the FSDP -> TP refit sends only it).

Tied embeddings: ``lm_head.weight`` is then the embedding Parameter itself, so it has no
route of its own; it is in ``ignored`` (accepted and skipped when sent).

Modules that lay out their own weights (MoE experts, ``layers/fused_moe.py``) say so with a
``hf_weight_routes(module_name)`` method; their parameters get no default route. Such a
module may also offer *aliases*: other names for slices of an expected name (the per-expert
``experts.{e}.gate_proj.weight`` of checkpoints on disk, slices of the fused
``experts.gate_up_proj`` that ``named_parameters()`` yields). An alias loads in place like any
route; ``missing(written)`` counts an expected name as written once all its aliases are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from hybridrl.rollout.layers.linear import LinearBase
from hybridrl.rollout.layers.tensor_parallel import TPSlice, take_local

TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class WeightRoute:
    """Where one HF tensor lands. ``shape`` is the HF shape (before fusion)."""

    hf_name: str
    param_name: str
    shard_id: str | int | None
    shape: torch.Size
    param: nn.Parameter
    rows: slice | None
    """rows of ``param`` this shard fills; None = the whole parameter."""
    layer: LinearBase | None
    """set when ``param`` is a linear method's weight: the method then owns its values."""
    tp: TPSlice | None = None
    """the part of the HF tensor this rank holds (tensor parallel); None: all of it."""

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's part (== ``shape`` without tensor parallelism)."""
        return self.shape if self.tp is None else self.tp.local_shape(self.shape)

    def load(self, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (whole, or this rank's part) in place through the parameter's ``weight_loader``."""
        self.param.weight_loader(self.param, take_local(tensor, self.shape, self.tp), self.shard_id)

    def expected_held(self, tensor: torch.Tensor) -> torch.Tensor:
        """What ``held()`` will return once ``load(tensor)`` ran (computed on ``tensor``'s device)."""
        tensor = take_local(tensor, self.shape, self.tp)
        if self.layer is not None:
            return self.layer.method.expected_held(self.layer, tensor, self.shard_id)
        return tensor.to(self.param.dtype)  # a plain copy_ into the slot

    def held(self) -> torch.Tensor:
        """What the engine holds for this name now (the fused slice; FP8: its float32 dequantization)."""
        if self.layer is not None:
            return self.layer.method.held(self.layer, self.rows)
        return self.param.data if self.rows is None else self.param.data[self.rows]


class WeightRoutes:
    """HF name -> ``WeightRoute`` for every weight a full load writes exactly once."""

    def __init__(self, model: nn.Module):
        self._routes: dict[str, WeightRoute] = {}
        self._aliases: dict[str, WeightRoute] = {}
        groups: dict[str, set[str]] = {}
        for r in _build(model):
            canonical = getattr(r, "canonical", None)
            if canonical is None:
                self._routes[r.hf_name] = r
            else:
                self._aliases[r.hf_name] = r
                groups.setdefault(canonical, set()).add(r.hf_name)
        self.expected: frozenset[str] = frozenset(self._routes)
        """every HF name a full load / refit must write exactly once (or through all its aliases)."""
        self.aliases: frozenset[str] = frozenset(self._aliases)
        """other accepted names, each a slice of one expected name (per-expert checkpoint names)."""
        self.alias_groups: dict[str, frozenset[str]] = {c: frozenset(a) for c, a in groups.items()}
        """expected name -> the aliases that together write all of it."""
        self.ignored: frozenset[str] = frozenset({TIED_HEAD} if getattr(model.lm_head, "tied", False) else ())
        """names accepted and skipped (a tied ``lm_head.weight``)."""

    def __getitem__(self, hf_name: str) -> WeightRoute:
        route = self._routes.get(hf_name) or self._aliases.get(hf_name)
        if route is None:
            raise ValueError(f"weight {hf_name!r} has no slot in the rollout model; check that the "
                             "checkpoint's architecture matches the engine config")
        return route

    def __contains__(self, hf_name: object) -> bool:
        return hf_name in self._routes or hf_name in self._aliases

    def __iter__(self) -> Iterator[WeightRoute]:
        """The expected names' routes (aliases are reached by name)."""
        return iter(self._routes.values())

    def canonical(self, hf_name: str) -> str:
        """The expected name ``hf_name`` writes (itself, or the fused name an alias is a slice of)."""
        return getattr(self[hf_name], "canonical", None) or hf_name

    def missing(self, written: Iterable[str]) -> set[str]:
        """Expected names neither written nor covered by all of their aliases."""
        written = set(written)
        return {n for n in self.expected - written
                if not (n in self.alias_groups and self.alias_groups[n] <= written)}

    def overlapping(self, names: Iterable[str]) -> set[str]:
        """Expected names that ``names`` writes twice: under their own name and through an alias."""
        names = set(names)
        return {self.canonical(n) for n in names & self.aliases} & names

    def __len__(self) -> int:
        return len(self._routes)


def _build(model: nn.Module) -> Iterator[WeightRoute]:
    """One route per (parameter, shard); a tied head appears once, as the embedding."""
    fused_to_hf: dict[str, list[tuple[str, str | int]]] = {}
    for hf_part, (fused, shard_id) in model.packed_modules_mapping.items():
        fused_to_hf.setdefault(fused, []).append((hf_part, shard_id))
    claimed: set[int] = set()  # parameters of modules that route their own weights
    for module_name, module in model.named_modules():
        own = getattr(module, "hf_weight_routes", None)
        if own is not None:
            yield from own(module_name)
            claimed.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if id(param) in claimed:
            continue
        module_name, leaf = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if not isinstance(module, LinearBase):  # vocabulary-sharded embeddings mark themselves
            yield WeightRoute(name, name, None, getattr(param, "hf_shape", param.shape), param,
                              getattr(param, "tp_rows", None), None, getattr(param, "tp_slice", None))
            continue
        if leaf not in ("weight", "bias"):
            continue  # a linear method's own tensor (e.g. an FP8 scale), not an HF name
        layer = module if param is module.weight else None
        if module.shard_names == (None,):
            yield WeightRoute(name, name, None, module.hf_shape(None, leaf), param, module.shard_slice(None), layer,
                              module.tp_slice(None, leaf))
            continue
        fused = module_name.rsplit(".", 1)[-1]
        for hf_part, shard_id in fused_to_hf[fused]:
            hf_name = f"{module_name[:-len(fused)]}{hf_part}.{leaf}"
            yield WeightRoute(hf_name, name, shard_id, module.hf_shape(shard_id, leaf), param,
                              module.shard_slice(shard_id), layer, module.tp_slice(shard_id, leaf))
