"""The trainer's DeepSeek-V4 lightning indexer: transformers' scores, hybridrl's selection.

transformers' ``DeepseekV4Indexer`` picks its top ``index_topk`` entries with ``torch.topk``
over score rows whose length is the padded batch length / rate; its scores tie at exactly 0
often (``hybridrl/rollout/models/deepseek_v4/selection.py`` says why), and ``topk`` breaks those ties
by row length. So transformers' log-prob of a token depends on the batch it is in and on
the tokens after it, and differs from the engine's (up to 1.9 nats measured with 2 indexer
heads). Inside :func:`engine_selection` every indexer of the model keeps transformers'
computation (its compressor, rotary, scorer: the same floats) and returns the entries the
engine's rule picks: ties to the most recent entry. Public hooks, removed on exit: a hook
on the scorer keeps its output, a hook on the indexer replaces transformers' picks.

Where hybridrl's trainer differs from transformers: only on queries whose k-th best score
is tied; there transformers' answer depends on the row length and hybridrl's does not.
Indices carry no gradient (transformers' indexer gets none either), so training is
otherwise transformers' computation.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridrl.rollout.models.deepseek_v4.selection import select_top_entries

INDEXER_CLASS = "DeepseekV4Indexer"


def _indexers(model: torch.nn.Module) -> list[torch.nn.Module]:
    if getattr(getattr(model, "config", None), "model_type", None) != "deepseek_v4":
        return []
    return [m for m in model.modules() if type(m).__name__ == INDEXER_CLASS]


@contextlib.contextmanager
def engine_selection(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s V4 indexers select as the engine does; a no-op for
    other models. ``DeepseekV4Indexer.forward(hidden_states, q_residual, position_ids, cache,
    layer_idx)`` returns ``[B, S, k]`` ids (``-1`` = none); the hook returns
    :func:`select_top_entries` of the same scores at the same ``position_ids``."""
    handles = []
    for indexer in _indexers(model):
        scores: list[torch.Tensor] = []

        def keep(module, args, out, scores=scores):
            scores.append(out)  # [B, S, T] float32

        def choose(module, args, kwargs, out, scores=scores):
            position_ids = args[2] if len(args) > 2 else kwargs["position_ids"]  # [B, S]
            chosen = select_top_entries(scores.pop(), (position_ids + 1) // module.compress_rate, module.index_topk)
            assert chosen.shape == out.shape, (chosen.shape, out.shape)
            return chosen

        handles.append(indexer.scorer.register_forward_hook(keep))
        handles.append(indexer.register_forward_hook(choose, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
