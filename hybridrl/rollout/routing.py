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
    routed = rollouts.routed_experts             # [B, L, n_moe_layers, k] int16, -1 = none

``routed[b, t, l, j]`` is the j-th expert (router order: descending probability) chosen for
token ``rollouts.input_ids[b, t]`` in the l-th MoE layer (``config.moe_layers[l]``; DeepSeek-V4:
the l-th top-k router layer, its hash layers need no record), when the
engine ran that token through the model: prompt tokens (at prefill) and every response
token but the last (the last is sampled, never fed). -1 there and at padding.

How it is recorded: a decode step's ids are copied into a static per-layer buffer
``[max_batch_size, k]`` (so a captured CUDA graph writes it on every replay: enable before
capture, i.e. before the first complete weight update), and the scheduler scatters them
into a per-row record that mirrors the KV cache (row, slot) after each step (no host
sync). Prefill ids are kept by reference (prefill is eager). A finished request's row is
read out once (``RequestOutput.routed_experts``); a continued conversation inherits its
parent's record with the retained prefix. Cost: one ``[B, k]`` copy per MoE layer per
step, and ``max_batch_size * max_seq_len * layers * k`` int16 on the device.

Trainer half: :func:`replay_routing` (see its docstring for the exact rule).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from hybridrl.rollout.models.moe.block import ROUTING_DTYPE, RoutingTap


class RoutingRecorder:
    """Per cache row, the top-k expert ids of every token fed through each MoE layer.

    ``record [max_rows, max_seq_len, n_moe_layers, k]`` int16 on the engine device mirrors
    the KV cache's rows and slots: the scheduler calls the hooks below where it writes KV
    (prefill, extend, decode, a retained prefix copied in, rows moved), and reads a row out
    when its request leaves. Memory: ``max_rows * max_seq_len * n_moe_layers * k * 2`` bytes.
    """

    def __init__(self, blocks: list[RoutingTap], max_batch_size: int, max_seq_len: int):
        if not blocks:
            raise ValueError("routing record: the model has no MoE layer with a learned router (nothing to record); "
                             "set rollout.routing_replay=false")
        self.blocks = sorted(blocks, key=lambda b: b.moe_index)
        self.top_k = self.blocks[0].top_k
        for b in self.blocks:
            b.enable_routing_buffer(max_batch_size)
        self.enabled = True
        device = self.blocks[0].routing_buffer.device
        self.record = torch.full((max_batch_size, max_seq_len, len(self.blocks), self.top_k), -1,
                                 dtype=ROUTING_DTYPE, device=device)
        self._arange = torch.arange(max_batch_size, device=device)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    # -- called by the scheduler (hybridrl/rollout/core/scheduler.py) --------------------------------
    def begin_prefill(self) -> None:
        for b in self.blocks:
            b.record_prefill, b.last_routing = True, None

    def _prefill_ids(self, B: int, S: int) -> torch.Tensor:
        ids = torch.stack([b.last_routing.view(B, S, self.top_k) for b in self.blocks], dim=2)  # (B, S, n, k)
        for b in self.blocks:
            b.record_prefill, b.last_routing = False, None
        return ids

    def after_prefill(self, dst_rows: torch.Tensor, src_rows: torch.Tensor, U: int, S: int) -> None:
        """A prefill ran ``U`` distinct prompts ``[U, S]``; row ``dst_rows[i]`` holds prompt ``src_rows[i]``."""
        self.record[dst_rows, :S] = self._prefill_ids(U, S).index_select(0, src_rows).to(ROUTING_DTYPE)

    def after_extend(self, row_start: int, positions: torch.Tensor) -> None:
        """An extend fed rows [row_start, row_start + B) their tokens at ``positions [B, C]``."""
        B, C = positions.shape
        rows = self._arange[row_start:row_start + B].view(B, 1)
        self.record[rows, positions] = self._prefill_ids(B, C).to(ROUTING_DTYPE)

    def after_decode(self, n: int, positions: torch.Tensor) -> None:
        """A decode step fed row i's token at slot ``positions[i]`` (rows [0, n))."""
        ids = torch.stack([b.routing_buffer[:n] for b in self.blocks], dim=1)  # (n, layers, k)
        self.record[self._arange[:n], positions] = ids

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        self.record[dst, :length] = self.record[src, :length]

    def write_row(self, row: int, ids: torch.Tensor) -> None:
        """Slots [0, len(ids)) of ``row`` <- a retained prefix's record."""
        self.record[row, :ids.shape[0]].copy_(ids)

    def read_row(self, row: int, length: int) -> torch.Tensor:
        """Slots [0, length) of ``row`` (a copy, on the device)."""
        return self.record[row, :length].clone()

    def sequence_record(self, row: int, total: int) -> torch.Tensor:
        """A finished request's record ``[total, n_moe_layers, k]`` (CPU): prompt + response; the
        last token was sampled, never fed, so its entry is -1."""
        out = self.record[row, :total].to("cpu", copy=True)  # never a view of the live record
        out[total - 1:] = -1
        return out

    # -- for the caller ------------------------------------------------------------------------
    def take(self, rollouts) -> torch.Tensor:
        """The routing of a ``generate`` call, aligned with ``rollouts.input_ids``:
        ``[B, L, n_moe_layers, k]`` int16 (CPU), -1 where not recorded (``rollouts.routed_experts``)."""
        if rollouts.routed_experts is None:
            raise ValueError("these rollouts carry no routing record; generate them with an engine built "
                             "with record_routing=True (or enable_routing_record before the first update)")
        return rollouts.routed_experts


def stack_routing(records: list[torch.Tensor], length: int) -> torch.Tensor:
    """Per-request records ``[len_b, n, k]`` -> ``[B, length, n, k]`` padded with -1."""
    n, k = records[0].shape[1:]
    out = torch.full((len(records), length, n, k), -1, dtype=ROUTING_DTYPE)
    for b, r in enumerate(records):
        out[b, :r.shape[0]] = r
    return out


def moe_blocks(model: torch.nn.Module) -> list[RoutingTap]:
    """The MoE blocks on the record's layer axis (all of them; DeepSeek-V4: its top-k layers)."""
    return [m for m in model.modules() if isinstance(m, RoutingTap) and m.records_routing]


def record_row_bytes(model: torch.nn.Module, max_seq_len: int) -> int:
    """Bytes one row of the ``RoutingRecorder`` record takes: ``max_seq_len x MoE layers x k``."""
    blocks = moe_blocks(model)
    k = blocks[0].top_k if blocks else 0
    return max_seq_len * len(blocks) * k * torch.empty((), dtype=ROUTING_DTYPE).element_size()


def enable_routing_record(engine) -> RoutingRecorder:
    """Attach a ``RoutingRecorder`` to ``engine`` (idempotent). On CUDA call it before the first
    complete weight update: the decode graphs are captured then and must contain the copies."""
    model = engine.model
    if model.routing_recorder is not None:
        return model.routing_recorder
    if getattr(engine.runner, "graphs", None) is not None:
        raise ValueError("enable_routing_record: the engine's CUDA graphs are already captured without the "
                         "routing copies; enable the record right after building the engine")
    model.routing_recorder = RoutingRecorder(moe_blocks(model), engine.max_batch_size, engine.max_seq_len)
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
def _is_v4_topk_router(m: torch.nn.Module) -> bool:
    return type(m).__name__ == "DeepseekV4TopKRouter"


def hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 / DeepSeek-V4 model,
    in layer order (``model.layers.{i}.mlp.gate`` of the sparse layers — V4: of its top-k layers,
    not the hash ones — the engine's MoE layer axis)."""
    routers = []
    for name, m in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(m, "top_k") and (hasattr(m, "norm_topk_prob")
                                                                  or _is_v4_topk_router(m)):
            routers.append((int(name.split("layers.")[1].split(".")[0]), m))
    return [m for _, m in sorted(routers, key=lambda t: t[0])]


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor) -> Iterator[None]:
    """Inside the block, ``model``'s MoE routers use the recorded experts.

    ``routed``: ``[B, L, n_moe_layers, k]`` for a forward over ``input_ids [B, L]`` (or
    ``[N, n_moe_layers, k]`` for a packed forward over N tokens, e.g. ``routed[mask.bool()]``
    for padding-free packing): the router input's rows in the same order. DeepSeek-V3's
    sigmoid router: :func:`_replaying_grouped_forward`; DeepSeek-V4's top-k router:
    :func:`_replaying_v4_forward` (its hash routers are left alone: ``tid2eid[token]`` is the
    engine's choice by construction).

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
    if _is_v4_topk_router(router):
        return _replaying_v4_forward(router, layer_ids)
    if hasattr(router, "e_score_correction_bias"):
        return _replaying_grouped_forward(router, layer_ids)

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


def _replaying_grouped_forward(router, layer_ids: torch.Tensor):
    """DeepSeek-V3's ``DeepseekV3TopkRouter.forward`` with the recorded experts: the logits
    (float32) and sigmoid scores as transformers computes them, the ids replayed (its own
    grouped selection where any id is -1), the weights the trainer's unbiased scores of
    those experts, renormalized (``+ 1e-20``) and scaled by ``routed_scaling_factor``."""
    from hybridrl.rollout.models.moe.block import select_experts_grouped

    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.weight.shape[1])
        logits = F.linear(hidden_states.float(), router.weight.float())
        if layer_ids.shape[0] != logits.shape[0]:
            raise ValueError(f"replay_routing: {layer_ids.shape[0]} recorded tokens, the forward routes "
                             f"{logits.shape[0]}; pass the routing of exactly this forward's tokens")
        own, _ = select_experts_grouped(logits, router.e_score_correction_bias, router.top_k, router.num_group,
                                        router.topk_group, router.norm_topk_prob, router.routed_scaling_factor)
        rec = layer_ids.to(device=logits.device, dtype=torch.long)
        ids = torch.where((rec >= 0).all(dim=-1, keepdim=True), rec, own)
        w = logits.sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * router.routed_scaling_factor, ids
    return forward


def _replaying_v4_forward(router, layer_ids: torch.Tensor):
    """DeepSeek-V4's ``DeepseekV4TopKRouter.forward`` with the recorded experts: logits in the
    model dtype, ``scores = score_fn(logits)``, the ids replayed (its own
    ``topk(scores + e_score_correction_bias)`` where any id is -1), the weights the trainer's
    scores of those experts renormalized (``+ 1e-20``) times ``routed_scaling_factor``."""

    def forward(hidden_states: torch.Tensor):
        flat = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(flat, router.weight)
        if layer_ids.shape[0] != logits.shape[0]:
            raise ValueError(f"replay_routing: {layer_ids.shape[0]} recorded tokens, the forward routes "
                             f"{logits.shape[0]}; pass the routing of exactly this forward's tokens")
        scores = router.score_fn(logits)
        own = torch.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1, sorted=False).indices
        rec = layer_ids.to(device=logits.device, dtype=torch.long)
        ids = torch.where((rec >= 0).all(dim=-1, keepdim=True), rec, own)
        w = scores.gather(1, ids)
        return logits, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor, ids
    return forward
