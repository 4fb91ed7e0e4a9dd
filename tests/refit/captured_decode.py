"""A CPU stand-in for a captured CUDA decode graph, to test refit's address invariant off GPU.

A CUDA graph records the raw addresses of every tensor the decode step reads and replays
them forever. :class:`CapturedDecode` holds the same thing on CPU: at capture it takes an
alias of the storage of every tensor the engine holds (``t.detach()`` keeps the storage
the tensor had *then*, whatever is later rebound to the module attribute or to
``param.data``) and the records the refit verifier compares (``refit/verify.py``).
:meth:`replay` runs the engine's eager decode step with every parameter, buffer (derived
caches included), KV-cache and runner tensor replaced by those aliases
(``torch.func.functional_call``), so it computes exactly what a graph captured then would
compute now: after an in-place refit the new model's logits; after a refit that rebound any
of them, logits from the stale storage. It also records every tensor the step reads and
returns those that are neither captured nor made by the step itself — a graph would hold
their addresses too, and no refit refreshes them.
"""
from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridrl.refit import verify


class CapturedDecode:
    """Capture ``engine``'s decode step now; :meth:`replay` it later."""

    def __init__(self, engine):
        runner = engine.runner
        aliases: dict[int, torch.Tensor] = {}  # id(live tensor) -> alias of its storage now

        def hold(t: torch.Tensor) -> torch.Tensor:
            return aliases.setdefault(id(t), t.detach())

        model = engine.model
        self.tensors = {f"model.{n}": hold(t) for n, t in itertools.chain(model.named_parameters(),
                                                                           model.named_buffers())}
        kv = {id(t): hold(t) for _, t in runner.kv_cache.named_tensors()}
        self.runner = copy.copy(runner)  # the runner's decode step, over the captured tensors
        self.runner.kv_cache = copy.deepcopy(runner.kv_cache, kv)  # its tensors are the aliases (memo)
        self.runner.rows, self.runner.slot_ids, self.runner.graphs = hold(runner.rows), hold(runner.slot_ids), None
        self.step = _Step(model, self.runner)
        self.storages = {a.untyped_storage().data_ptr() for a in aliases.values()}
        self.records = verify.snapshot(engine.named_state_tensors())

    def moved(self, engine) -> list[str]:
        """Names of the engine's tensors whose address or geometry changed since capture
        (or that appeared or vanished)."""
        now = verify.snapshot(engine.named_state_tensors())
        return sorted(n for n in self.records.keys() | now.keys() if self.records.get(n) != now.get(n))

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int
               ) -> tuple[torch.Tensor, list[str]]:
        """(logits [B, V] of the decode step over the captured tensors, a description of every
        tensor it read that is neither captured, an input, nor made during the step)."""
        inputs = {t.untyped_storage().data_ptr() for t in (tokens, positions)}
        with torch.inference_mode(), _Reads() as reads:
            logits = torch.func.functional_call(self.step, self.tensors, (tokens, positions, kv_len), strict=True)
        foreign = [f"{op} read a {dtype} {list(shape)} tensor" for ptr, (op, shape, dtype) in reads.read.items()
                   if ptr not in self.storages | inputs]
        return logits, foreign


class _Step(nn.Module):
    """The engine's model as a submodule (what ``functional_call`` swaps) and the runner's step."""

    def __init__(self, model: nn.Module, runner):
        super().__init__()
        self.model, self.runner = model, runner

    def forward(self, tokens, positions, kv_len):
        return self.runner.decode_eager(tokens, positions, kv_len)


class _Reads(TorchDispatchMode):
    """Storage address -> (op, shape, dtype) of every tensor an op reads that no earlier op made."""

    def __init__(self):
        super().__init__()
        self.read: dict[int, tuple] = {}
        self.made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.made:
                    self.read.setdefault(ptr, (str(func), tuple(t.shape), t.dtype))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel():
                self.made.add(t.untyped_storage().data_ptr())
        return out
