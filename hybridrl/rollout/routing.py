"""Routing replay, engine half: record the engine's expert choices per token; trainer half:
replay them in transformers' MoE forward.

Why: in an MoE model the trainer's forward re-decides every token's top-k experts from
its own hidden states. Any numeric difference from the rollout engine (bf16 vs fp32,
FP8 / MXFP4 rollout weights, a different kernel order) flips some near-tied choices, and a
flipped expert is a different function: the trainer's log-probs then differ from the
engine's by far more than rounding ("routing mismatch"). Replaying the engine's choices
in the trainer (Rollout Routing Replay, "R3") removes that part of the train/rollout gap,
while the router still gets gradients through the probabilities of the replayed experts.

Engine half::

    recorder = enable_routing_record(engine)     # before the first weight update on CUDA
    rollouts = engine.generate(prompts, params)
    routed = recorder.take(rollouts)             # [B, L, n_moe_layers, k] int16, -1 = none

``routed[b, t, l, j]`` is the j-th expert (router order: descending probability) chosen for
token ``rollouts.input_ids[b, t]`` in the l-th MoE layer (``config.moe_layers[l]``), when the
engine ran that token through the model: prompt tokens (at prefill) and every response
token but the last (the last is sampled, never fed). -1 there and at padding.

How it is recorded: a decode step's ids are copied into a static per-layer buffer
``[max_batch_size, k]`` (so a captured CUDA graph writes it on every replay: enable before
capture, i.e. before the first complete weight update), and the generation loop scatters
them to ``(row_map, position)`` after each step (no host sync; one transfer per batch at
the end). Prefill ids are kept by reference (prefill is eager). Cost: one ``[B, k]`` copy
per MoE layer per step, and ``B * (S + steps) * layers * k`` int16 on the device per batch.

Trainer half: :func:`replay_routing` (see its docstring for the exact rule).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from hybridrl.rollout.models.moe import ROUTING_DTYPE, SparseMoeBlock


class RoutingRecorder:
    """Collects per-token top-k expert ids of every MoE layer during ``engine.generate``."""

    def __init__(self, blocks: list[SparseMoeBlock], max_batch_size: int):
        if not blocks:
            raise ValueError("routing record: the model has no MoE layers")
        self.blocks = sorted(blocks, key=lambda b: b.moe_index)
        self.top_k = self.blocks[0].top_k
        for b in self.blocks:
            b.enable_routing_buffer(max_batch_size)
        self.enabled = True
        self._results: list[torch.Tensor] = []
        self._out: torch.Tensor | None = None
        self._prompt_lens: list[int] = []

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    # -- called by the generation loop (hybridrl/rollout/generation.py) ----------------------
    def begin_batch(self, prompt_lens: list[int], steps: int, device: torch.device) -> None:
        B, S = len(prompt_lens), max(prompt_lens)
        self._out = torch.full((B, S + steps, self.num_layers, self.top_k), -1, dtype=ROUTING_DTYPE, device=device)
        self._prompt_lens = list(prompt_lens)
        for b in self.blocks:
            b.record_prefill, b.last_routing = True, None

    def after_prefill(self, src_rows: torch.Tensor | None, S: int) -> None:
        """Prefill ran U distinct prompts ``[U, S]``; ``src_rows[b]`` is request b's prefill row."""
        ids = torch.stack([b.last_routing.view(-1, S, self.top_k) for b in self.blocks], dim=2)  # (U, S, n, k)
        if src_rows is not None:
            ids = ids.index_select(0, src_rows)
        self._out[:, :S].copy_(ids)
        for b in self.blocks:
            b.record_prefill, b.last_routing = False, None

    def after_decode(self, row_map: torch.Tensor, positions: torch.Tensor) -> None:
        """A decode step fed row i's token at ``positions[i]``; it belongs to request ``row_map[i]``."""
        B = row_map.shape[0]
        ids = torch.stack([b.routing_buffer[:B] for b in self.blocks], dim=1)  # (B, n, k)
        self._out[row_map, positions] = ids

    def end_batch(self, response_lens: list[int]) -> None:
        out = self._out.cpu()  # one transfer per batch
        for b, (p, n) in enumerate(zip(self._prompt_lens, response_lens)):
            r = out[b, :p + n].clone()
            r[p + n - 1:] = -1  # the last token was sampled, never fed through the model
            self._results.append(r)
        self._out = None

    # -- for the caller ------------------------------------------------------------------------
    def take(self, rollouts) -> torch.Tensor:
        """The routing of the last ``generate`` call, aligned with ``rollouts.input_ids``:
        ``[B, L, n_moe_layers, k]`` int16 (CPU), -1 where not recorded. Clears the record."""
        results, self._results = self._results, []
        B, L = rollouts.input_ids.shape
        if len(results) != B:
            raise ValueError(f"routing record holds {len(results)} sequences, rollouts have {B}; call take() "
                             "once after each generate()")
        out = torch.full((B, L, self.num_layers, self.top_k), -1, dtype=ROUTING_DTYPE)
        for b, r in enumerate(results):
            out[b, :r.shape[0]] = r
        return out


def moe_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def enable_routing_record(engine) -> RoutingRecorder:
    """Attach a ``RoutingRecorder`` to ``engine`` (idempotent). On CUDA call it before the first
    complete weight update: the decode graphs are captured then and must contain the copies."""
    model = engine.model
    if model.routing_recorder is not None:
        return model.routing_recorder
    if getattr(engine.runner, "graphs", None) is not None:
        raise ValueError("enable_routing_record: the engine's CUDA graphs are already captured without the "
                         "routing copies; enable the record right after building the engine")
    model.routing_recorder = RoutingRecorder(moe_blocks(model), engine.max_batch_size)
    return model.routing_recorder


def active_recorder(model: torch.nn.Module) -> RoutingRecorder | None:
    rec = getattr(model, "routing_recorder", None)
    return rec if rec is not None and rec.enabled else None


@torch.inference_mode()
def routing_of_sequences(engine, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits ``[B, S, V]``, routing ``[B, S, n_moe_layers, k]`` int16) of one full-sequence
    forward (``engine.logits``), for comparisons; no recorder needed."""
    blocks = sorted(moe_blocks(engine.model), key=lambda b: b.moe_index)
    for b in blocks:
        b.record_prefill, b.last_routing = True, None
    try:
        logits = engine.logits(input_ids, attention_mask)
        B, S = input_ids.shape
        ids = torch.stack([b.last_routing.view(B, S, -1) for b in blocks], dim=2).to(ROUTING_DTYPE).cpu()
    finally:
        for b in blocks:
            b.record_prefill, b.last_routing = False, None
    return logits, ids


# ---- trainer half --------------------------------------------------------------------------
def hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers Qwen3-MoE / Qwen2-MoE model, in layer order
    (``model.layers.{i}.mlp.gate`` of the sparse layers: the engine's MoE layer axis)."""
    routers = []
    for name, m in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "norm_topk_prob"):
            routers.append((int(name.split("layers.")[1].split(".")[0]), m))
    return [m for _, m in sorted(routers, key=lambda t: t[0])]


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor) -> Iterator[None]:
    """Inside the block, ``model``'s MoE routers use the recorded experts.

    ``routed``: ``[B, L, n_moe_layers, k]`` for a forward over ``input_ids [B, L]`` (or
    ``[N, n_moe_layers, k]`` for a packed forward over N tokens, e.g. ``routed[mask.bool()]``
    for padding-free packing): the router input's rows in the same order.

    Per token and layer, transformers' ``Qwen3MoeTopKRouter.forward`` becomes::

        logits = hidden @ W_gate.T                       # unchanged (router_logits, aux loss)
        probs  = softmax(logits, dim=-1, dtype=float32)
        ids    = routed[token, layer]                    # replayed; the own top-k where any id is -1
        w      = probs.gather(-1, ids)                   # the trainer's probabilities of those experts
        w      = w / w.sum(-1, keepdim=True) if norm_topk_prob else w
        return logits, w.to(logits.dtype), ids

    so expert *choice* is the engine's while the weights (and their gradients to the router)
    are the trainer's. The load-balancing aux loss still recomputes its own top-k from
    ``router_logits``. Restores the routers' forward on exit.
    """
    routers = hf_routers(model)
    ids = routed.reshape(-1, routed.shape[-2], routed.shape[-1]) if routed.dim() == 4 else routed
    if ids.shape[1] != len(routers):
        raise ValueError(f"replay_routing: {ids.shape[1]} recorded MoE layers, the model has {len(routers)}")
    originals = []  # an instance-level forward the router had before (None: its class's)
    for layer, router in enumerate(routers):
        originals.append(router.__dict__.get("forward"))
        router.forward = _replaying_forward(router, ids[:, layer])
    try:
        yield
    finally:
        for router, fwd in zip(routers, originals):
            if fwd is None:
                del router.forward
            else:
                router.forward = fwd


def _replaying_forward(router, layer_ids: torch.Tensor):
    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.weight.shape[1])
        logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        if layer_ids.shape[0] != logits.shape[0]:
            raise ValueError(f"replay_routing: {layer_ids.shape[0]} recorded tokens, the forward routes "
                             f"{logits.shape[0]}; pass the routing of exactly this forward's tokens")
        rec = layer_ids.to(device=logits.device, dtype=torch.long)
        ids = torch.where((rec >= 0).all(dim=-1, keepdim=True), rec, own)
        w = probs.gather(-1, ids)
        if router.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, w.to(logits.dtype), ids
    return forward
