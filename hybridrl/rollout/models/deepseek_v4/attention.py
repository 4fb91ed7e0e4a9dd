"""DeepSeek-V4 attention, stateless (full sequences, no KV cache): work in progress (#32).

Equal to transformers' ``DeepseekV4Attention`` without a cache, module names mirrored so
Hugging Face names route by default. Per layer type (``layer_types``):

- ``sliding_attention``: shared-KV multi-query attention (one head read as K and V) over the
  last ``sliding_window`` positions, the *main* rope;
- ``heavily_compressed_attention`` (HCA): the sliding part (compress rope) plus one compressed
  entry per ``M`` tokens (:class:`HcaCompressor`, non-overlapping softmax-gated windows), all
  attended once complete;
- ``compressed_sparse_attention`` (CSA): the sliding part plus one entry per ``m`` tokens from
  overlapping ``2m`` windows (:class:`CsaCompressor`), of which the lightning indexer
  (:class:`Indexer`) keeps the top ``index_topk`` per query.

Queries: q-LoRA, an unweighted per-head RMS norm, rope on the trailing ``rope_dim`` channels
(interleaved pairs, float32). Scores get a per-head learned sink logit (softmax over keys +
sink, the sink's share dropped); the output's rope slice is rotated back (the conjugate,
``-sin``, at the query's position); ``o_a_proj`` projects each of ``o_groups`` head groups to
``o_lora_rank`` (a block-diagonal matmul), ``o_b_proj`` mixes them.

Not built yet: the per-request state a cache needs (sliding ring, compressed entries, the
compressors' partial windows) — ``docs/design/deepseek_v4_plan.md`` §3. Rows must be right
padded (the compressors cut windows from position 0; transformers is wrong with left
padding too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.rollout.models.deepseek_v4.config import V4Dims
from hybridrl.rollout.models.deepseek_v4.hyper_connection import loaded_param, unweighted_rms_norm
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.linear import ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear
from hybridrl.rollout.layers.norm import RMSNorm
from hybridrl.rollout.layers.tensor_parallel import TPSlice, mark_split
from hybridrl.rollout.models.deepseek_v4.selection import select_top_entries
from hybridrl.rollout.models.deepseek_v4.state import ring_positions


class V4Rotary(nn.Module):
    """cos / sin ``[max_seq_len, rope_dim / 2]`` for the ``main`` and ``compress`` ropes (one
    frequency per interleaved pair), times the rope's attention factor, in the engine dtype."""

    def __init__(self, dims: V4Dims, max_seq_len: int, dtype, device):
        super().__init__()
        pos = torch.arange(max_seq_len, dtype=torch.float32)[:, None]
        for label, inv, factor in (("main", dims.main_inv_freq, dims.main_attention_factor),
                                   ("compress", dims.compress_inv_freq, dims.compress_attention_factor)):
            freqs = pos * torch.tensor(inv, dtype=torch.float32)[None, :]
            self.register_buffer(f"{label}_cos", (freqs.cos() * factor).to(dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"{label}_sin", (freqs.sin() * factor).to(dtype=dtype, device=device),
                                 persistent=False)

    def tables(self, label: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] long -> (cos, signed sin) [..., rope_dim], what :func:`rotate_tail`
        takes: each pair's cos twice, its sin as ``(-sin, +sin)`` (the sign of the rotation's
        swapped term, so a rotation is two multiplies and an add, no negation per call)."""
        cos, sin = getattr(self, f"{label}_cos")[positions], getattr(self, f"{label}_sin")[positions]
        return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the trailing ``cos.shape[-1]`` channels of ``x`` (float32 math, cast
    back); ``cos``/``sin`` (``V4Rotary.tables``: signed sin) broadcast against ``x[..., -R:]``.

    Pair (a, b) -> (a cos - b sin, b cos + a sin): the swapped pair (b, a) times the signed sin
    (-sin, sin) — bitwise the negate-and-interleave form, in one ``flip``."""
    R = cos.shape[-1]
    rope = x[..., -R:]
    swapped = rope.unflatten(-1, (R // 2, 2)).flip(-1).flatten(-2)
    if x.dtype == torch.float32:  # the casts would be no-ops, each still a dispatch (~30 rotations a step)
        return torch.cat([x[..., :-R], rope * cos + swapped * sin], dim=-1)
    return torch.cat([x[..., :-R], (rope.float() * cos + swapped.float() * sin).to(x.dtype)], dim=-1)


class GroupedLinear(LinearBase):
    """``o_a_proj``: ``G`` groups of ``K`` inputs each projected to ``r`` outputs (the HF
    weight ``[G * r, K]``, one block per group). x ``[..., G, K]`` -> ``[..., G, r]``.

    Under FP8 the matmul reads the layer's dequantized ``weight_dequant`` — a registered
    derived cache, so this is exactly seed PR #7455's bf16 ``wo_a`` copy: preallocated once,
    refreshed in place by every weight update after every FP8 layer is back in inference
    layout (refused before), checked by the refit verifier, never dropped and rebuilt."""

    adapter_capable = False  # its own grouped matmul, not LinearBase.forward: no LoRA add there
    adapter_capable_why = "a grouped projection (one matmul per output group)"

    needs_dense_weight = True  # fp8_linear: keep the dequantized cache even where _scaled_mm could run

    def __init__(self, in_per_group: int, out_features: int, n_groups: int, ctx: LayerContext):
        """Tensor parallel: this rank's ``n_groups / T`` groups (the heads it holds)."""
        tp = ctx.tp
        g0, local = tp.split(n_groups, "o_groups")
        per = out_features // n_groups
        sl = None if tp.size == 1 else [TPSlice(0, ((g0 * per, local * per),))]
        self.n_groups = local
        super().__init__(in_per_group, [local * per], ctx, bias=False, tp_slices=sl,
                         hf_sizes=(in_per_group, [out_features]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = getattr(self, "weight_dequant", None)
        w = self.weight if w is None else w
        G, K = self.n_groups, self.input_size
        y = torch.bmm(x.reshape(-1, G, K).transpose(0, 1), w.view(G, -1, K).transpose(1, 2))  # (G, T, r)
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1)


def _ring_gather(seq: torch.Tensor, lengths: torch.Tensor, ring: int) -> torch.Tensor:
    """seq [B, S, C] of right-padded rows -> [B, ring, C]: slot s holds the row's newest valid
    position p with p % ring == s (zeros where the row has none)."""
    pos = ring_positions(lengths - 1, ring)  # (B, ring)
    got = seq.gather(1, pos.clamp(min=0).unsqueeze(-1).expand(-1, -1, seq.shape[-1]))
    return got.masked_fill((pos < 0).unsqueeze(-1), 0.0)


def _pool(kv: torch.Tensor, gate: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """Softmax-gated sum over the window slots (dim 2, float32 softmax per channel), normed."""
    return norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))


class _Compressor(nn.Module):
    """kv_proj / gate_proj (never quantized: the checkpoints ship them unquantized),
    position_bias, kv_norm; ``overlap``: CSA's 2m windows of stride m."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float, ctx: LayerContext):
        super().__init__()
        out = 2 * width if overlap else width
        plain = ctx.unquantized()
        self.kv_proj = ReplicatedLinear(hidden, out, plain.child("kv_proj"))
        self.gate_proj = ReplicatedLinear(hidden, out, plain.child("gate_proj"))
        self.position_bias = loaded_param(rate, out, dtype=ctx.dtype, device=ctx.device)
        self.kv_norm = RMSNorm(width, eps, ctx.dtype, ctx.device)
        self.rate, self.width, self.overlap = rate, width, overlap

    def entries_and_raw(self, x: torch.Tensor, rotary: V4Rotary):
        """x [B, S, hidden] -> (the complete windows' entries [B, S // rate, width], rotated at
        each window's first position; raw kv [B, S, out], raw gate [B, S, out]: the raw
        projections are what the state's rings keep, the gate without position_bias)."""
        B, S, _ = x.shape
        m, D = self.rate, self.width
        n = S // m
        raw_kv, raw_gate = self.kv_proj(x), self.gate_proj(x)
        kv = raw_kv[:, :n * m].reshape(B, n, m, raw_kv.shape[-1])
        gate = raw_gate[:, :n * m].reshape(B, n, m, raw_gate.shape[-1]) + self.position_bias
        if self.overlap:  # slots [0, m): window w-1's first half; [m, 2m): window w's second half
            kv2 = kv.new_zeros(B, n, 2 * m, D)
            gate2 = gate.new_full((B, n, 2 * m, D), float("-inf"))
            kv2[:, :, m:], gate2[:, :, m:] = kv[..., D:], gate[..., D:]
            kv2[:, 1:, :m], gate2[:, 1:, :m] = kv[:, :-1, :, :D], gate[:, :-1, :, :D]
            kv, gate = kv2, gate2
        pooled = _pool(kv, gate, self.kv_norm)  # (B, n, D)
        cos, sin = rotary.tables("compress", torch.arange(n, device=x.device) * m)
        return rotate_tail(pooled, cos, sin), raw_kv, raw_gate

    def decode_entry(self, raw_kv: torch.Tensor, raw_gate: torch.Tensor, t: torch.Tensor,
                     rotary: V4Rotary) -> torch.Tensor:
        """The entry of the window each row's position ``t [B]`` is in, from the rings
        ``raw_kv / raw_gate [B, ring, out]`` (slot = position % ring) -> [B, width]. Valid only
        once that window is complete (callers mask it until then)."""
        m, D = self.rate, self.width
        ring = raw_kv.shape[1]
        w = torch.div(t, m, rounding_mode="floor")  # (B,)
        j = torch.arange(m, device=t.device).view(1, m)
        def take(src, pos):  # rows' ring slots of positions pos [B, m] -> [B, m, out]
            slots = torch.remainder(pos, ring).unsqueeze(-1).expand(-1, -1, src.shape[-1])
            return src.gather(1, slots)
        own = (w.view(-1, 1) * m + j)  # window w's positions
        pb = self.position_bias
        if not self.overlap:
            kv, gate = take(raw_kv, own), take(raw_gate, own) + pb
        else:
            prev = own - m
            kv_p, gate_p = take(raw_kv, prev)[..., :D], take(raw_gate, prev)[..., :D] + pb[:, :D]
            none = (prev < 0).unsqueeze(-1)  # window 0 has no previous window: weight 0
            kv_p = kv_p.masked_fill(none, 0.0)
            gate_p = gate_p.masked_fill(none, float("-inf"))
            kv = torch.cat([kv_p, take(raw_kv, own)[..., D:]], dim=1)
            gate = torch.cat([gate_p, take(raw_gate, own)[..., D:] + pb[:, D:]], dim=1)
        pooled = _pool(kv.unsqueeze(1), gate.unsqueeze(1), self.kv_norm)[:, 0]  # (B, D)
        cos, sin = rotary.tables("compress", w * m)
        return rotate_tail(pooled, cos, sin)

    def fill(self, state: dict, prefix: str, rows: slice, entries, raw_kv, raw_gate, lengths) -> None:
        """Prefill: the rows' rings <- the last ring-many raw projections, entries <- all
        computed windows (those past a row's complete ones are masked until rewritten)."""
        ring = state[f"{prefix}raw_kv"].shape[1]
        state[f"{prefix}raw_kv"][rows] = _ring_gather(raw_kv, lengths, ring)
        state[f"{prefix}raw_gate"][rows] = _ring_gather(raw_gate, lengths, ring)
        key = "index" if prefix else "comp"
        state[key][rows, :entries.shape[1]] = entries


class Indexer(_Compressor):
    """The lightning indexer: its own overlapping compressor at ``index_head_dim`` (its
    kv_proj / gate_proj / position_bias / kv_norm), then scores ``sum_h w_h relu(q_h . K_c)``
    (float32) that pick the top ``index_topk`` complete entries per query."""

    def __init__(self, hidden: int, dims: V4Dims, eps: float, ctx: LayerContext):
        super().__init__(hidden, dims.index_head_dim, dims.csa_rate, True, eps, ctx)
        self.heads, self.head_dim, self.topk = dims.index_n_heads, dims.index_head_dim, dims.index_topk
        self.q_b_proj = ReplicatedLinear(dims.q_lora_rank, self.heads * self.head_dim, ctx.child("q_b_proj"))
        self.scorer = nn.Module()
        self.scorer.weights_proj = ReplicatedLinear(hidden, self.heads, ctx.child("scorer.weights_proj").unquantized())

    def select(self, x, q_res, positions, rotary: V4Rotary, keys: torch.Tensor, tabs=None) -> torch.Tensor:
        """Queries x / q_res [B, S, *] at ``positions [B, S]`` over the index keys ``[B, n, D_I]``
        -> ids [B, S, min(topk, n)] of the chosen complete entries, -1 = none (the rule:
        :func:`select_top_entries`). ``tabs``: the compress rope's tables at ``positions`` if
        the caller has them (a decode step computes them once for every layer)."""
        B, S, _ = x.shape
        q = self.q_b_proj(q_res).view(B, S, self.heads, self.head_dim)
        cos, sin = rotary.tables("compress", positions) if tabs is None else tabs
        q = rotate_tail(q, cos.unsqueeze(2), sin.unsqueeze(2))
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # (B, S, H_I, n)
        scores = F.relu(scores) * self.head_dim ** -0.5
        weights = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # (B, S, n)
        # ties to the most recent entry: the choice never depends on the row's length (v4_selection)
        return select_top_entries(scores, (positions + 1) // self.rate, self.topk)


class V4Attention(nn.Module):
    """Tensor parallel (``ctx.tp``): this rank's heads (whole ``o_groups``; their ``q_b_proj`` rows,
    sinks and ``o_a_proj`` groups), ``o_b_proj`` row-parallel with one all-reduce. The shared KV
    head, the compressors and the lightning indexer (its own heads) stay whole on every rank,
    so every rank keeps the same state and the indexer picks the same entries on every rank."""

    def __init__(self, hidden: int, heads: int, dims: V4Dims, layer_type: str, eps: float, ctx: LayerContext):
        super().__init__()
        D, tp, dtype, device = dims.head_dim, ctx.tp, ctx.dtype, ctx.device
        h0, local = tp.split(heads, "the attention heads")
        self.heads, self.head_dim, self.window, self.eps = local, D, dims.sliding_window, eps
        self.layer_type, self.dims = layer_type, dims
        self.rope = "main" if layer_type == "sliding_attention" else "compress"
        self.q_a_proj = ReplicatedLinear(hidden, dims.q_lora_rank, ctx.child("q_a_proj"))
        self.q_a_norm = RMSNorm(dims.q_lora_rank, eps, dtype, device)
        self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, heads * D, ctx.child("q_b_proj"), unit=D,
                                             what="the attention heads")
        self.kv_proj = ReplicatedLinear(hidden, D, ctx.child("kv_proj"))
        self.kv_norm = RMSNorm(D, eps, dtype, device)
        self.o_a_proj = GroupedLinear(heads * D // dims.o_groups, dims.o_groups * dims.o_lora_rank, dims.o_groups,
                                      ctx.child("o_a_proj"))
        self.o_b_proj = RowParallelLinear(dims.o_groups * dims.o_lora_rank, hidden, ctx.child("o_b_proj"),
                                          unit=dims.o_lora_rank, what="o_groups")
        self.sinks = mark_split(loaded_param(local, dtype=dtype, device=device), [heads],
                                None if tp.size == 1 else TPSlice(0, ((h0, local),)))
        self.compressor = None
        if layer_type == "heavily_compressed_attention":
            self.compressor = _Compressor(hidden, D, dims.hca_rate, False, eps, ctx.child("compressor"))
        elif layer_type == "compressed_sparse_attention":
            self.compressor = _Compressor(hidden, D, dims.csa_rate, True, eps, ctx.child("compressor"))
            self.compressor.indexer = Indexer(hidden, dims, eps, ctx.child("compressor.indexer"))

    def _qkv(self, x, cos, sin):
        B, S, _ = x.shape
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(B, S, self.heads, self.head_dim).transpose(1, 2), self.eps)
        q = rotate_tail(q, cos, sin)  # (B, H, S, D)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)).view(B, 1, S, self.head_dim), cos, sin)  # (B, 1, S, D)
        return q_res, q, kv

    def _attend(self, q, keys, bias, cos, sin) -> torch.Tensor:
        """Sink attention over keys (= values) -> conjugate rope -> o_a (grouped) -> o_b."""
        B, H, S, D = q.shape
        T = keys.shape[-2]
        # one GEMM per row over all its heads' queries (the KV head is shared): matmul's
        # broadcast of keys [B, 1, T, D] over H would copy them H times first
        k = keys.reshape(B, T, D)
        scores = torch.bmm(q.reshape(B, H * S, D), k.transpose(1, 2)).view(B, H, S, T) * D ** -0.5 + bias
        logits = torch.cat([scores, self.sinks.view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        o = torch.bmm(probs.to(keys.dtype).reshape(B, H * S, T), k).view(B, H, S, D)  # V is the same rotated kv
        o = rotate_tail(o, cos, -sin).transpose(1, 2)  # conjugate rotation at the query position
        z = self.o_a_proj(o.reshape(B, S, self.o_a_proj.n_groups, -1)).flatten(2)
        return self.o_b_proj(z)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, rotary: V4Rotary,
                state: dict | None = None, rows: slice | None = None, lengths: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Full sequences. x [B, S, hidden], positions [B, S], key_valid [B, S] bool (right
        padding) -> [B, S, hidden]. With ``state`` (a ``V4StateCache`` layer) the rows ``rows``
        of it are filled for decoding on (``lengths [B]``: each row's valid tokens)."""
        B, S, _ = x.shape
        cos, sin = rotary.tables(self.rope, positions)  # (B, S, R)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads: (B, 1, S, R)
        q_res, q, kv = self._qkv(x, cos, sin)
        t = positions.unsqueeze(-1)  # query positions (B, S, 1); keys are the row's own positions
        p = positions.unsqueeze(1)
        mask = (p <= t) & (p > t - self.window) & key_valid.unsqueeze(1)  # (B, S, S)
        bias = torch.zeros(B, 1, S, S, dtype=x.dtype, device=x.device).masked_fill_(~mask.unsqueeze(1),
                                                                                    float("-inf"))
        keys = kv
        if state is not None:
            state["swa"][rows] = _ring_gather(kv[:, 0], lengths, self.window)
        if self.compressor is not None:
            entries, raw_kv, raw_gate = self.compressor.entries_and_raw(x, rotary)
            if state is not None:
                self.compressor.fill(state, "", rows, entries, raw_kv, raw_gate, lengths)
            entries = entries.unsqueeze(1)  # (B, 1, n, D)
            bias = torch.cat([bias, self._entry_bias(x, q_res, positions, entries.shape[2], rotary,
                                                     state, rows, lengths)], dim=-1)
            keys = torch.cat([kv, entries], dim=2)
        return self._attend(q, keys, bias, cos, sin)

    def _entry_bias(self, x, q_res, positions, n: int, rotary: V4Rotary, state=None, rows=None,
                    lengths=None) -> torch.Tensor:
        """[B, 1, S, n] additive: 0 where query t may read entry c, -inf elsewhere."""
        B, S, _ = x.shape
        if self.layer_type == "heavily_compressed_attention":
            threshold = (positions + 1) // self.dims.hca_rate
            blocked = torch.arange(n, device=x.device).view(1, 1, -1) >= threshold.unsqueeze(-1)
        else:
            indexer = self.compressor.indexer
            keys, raw_kv, raw_gate = indexer.entries_and_raw(x, rotary)
            if state is not None:
                indexer.fill(state, "index_", rows, keys, raw_kv, raw_gate, lengths)
            blocked = _unchosen(indexer.select(x, q_res, positions, rotary, keys), n)
        return torch.zeros(B, 1, S, n, dtype=x.dtype, device=x.device).masked_fill_(blocked.unsqueeze(1),
                                                                                    float("-inf"))

    def decode(self, x: torch.Tensor, t: torch.Tensor, rotary: V4Rotary, state: dict, tabs: dict) -> torch.Tensor:
        """One token per row: rows [0, B) of ``state`` at positions ``t [B]`` -> [B, 1, hidden].
        ``tabs``: ``{label: rotary.tables(label, t.view(B, 1))}``, computed once per step for
        every layer (the same tables in all of them)."""
        B = x.shape[0]
        W = self.window
        tab = tabs[self.rope]  # (B, 1, R) each
        cos, sin = tab[0].unsqueeze(1), tab[1].unsqueeze(1)  # (B, 1, 1, R)
        q_res, q, kv = self._qkv(x, cos, sin)
        arange = torch.arange(B, device=x.device)
        swa = state["swa"][:B]
        swa[arange, torch.remainder(t, W)] = kv[:, 0, 0]
        pos = ring_positions(t, W)  # (B, W): every slot is within the window, empty if < 0
        bias = torch.zeros(B, 1, 1, W, dtype=x.dtype, device=x.device).masked_fill_(
            (pos < 0).view(B, 1, 1, W), float("-inf"))
        keys = swa.unsqueeze(1)  # (B, 1, W, D)
        if self.compressor is not None:
            comp = self.compressor
            entries = state["comp"][:B]
            threshold = (t + 1) // comp.rate  # entries < threshold are complete
            rebuild = _completes(t, threshold, comp.rate)
            self._write_entry(comp, state, "", x, t, rotary, entries, rebuild)
            n = entries.shape[1]
            if self.layer_type == "heavily_compressed_attention":
                blocked = torch.arange(n, device=x.device).view(1, n) >= threshold.view(B, 1)
            else:
                indexer = comp.indexer
                index = state["index"][:B]
                self._write_entry(indexer, state, "index_", x, t, rotary, index, rebuild)
                ids = indexer.select(x, q_res, t.view(B, 1), rotary, index, tab)[:, 0]  # (B, k)
                blocked = _unchosen(ids, n)
            bias = torch.cat([bias, torch.zeros(B, 1, 1, n, dtype=x.dtype, device=x.device).masked_fill_(
                blocked.view(B, 1, 1, n), float("-inf"))], dim=-1)
            keys = torch.cat([keys, entries.unsqueeze(1)], dim=2)
        return self._attend(q, keys, bias, cos, sin)

    @staticmethod
    def _write_entry(comp, state: dict, prefix: str, x, t, rotary, entries, rebuild: bool = True) -> None:
        """Append this token's raw projections to the rings and, if ``rebuild``, (re)build its
        window's entry (skipped when no row completes a window: a partial entry is never read)."""
        B = x.shape[0]
        arange = torch.arange(B, device=x.device)
        raw_kv, raw_gate = state[f"{prefix}raw_kv"][:B], state[f"{prefix}raw_gate"][:B]
        slot = torch.remainder(t, raw_kv.shape[1])
        raw_kv[arange, slot] = comp.kv_proj(x)[:, 0]
        raw_gate[arange, slot] = comp.gate_proj(x)[:, 0]
        if rebuild:
            entries[arange, torch.div(t, comp.rate, rounding_mode="floor")] = comp.decode_entry(raw_kv, raw_gate, t,
                                                                                               rotary)


def _completes(t: torch.Tensor, threshold: torch.Tensor, rate: int) -> bool:
    """Whether a decode step at positions ``t`` must rebuild entries: always off the CPU (no
    host sync in the launch queue, and a graph could not branch on it); on the CPU only if some
    row completes its window now (``t + 1 == threshold * rate``). A partial entry is masked
    until its window completes (attention bias, the indexer's ``complete``) and is rebuilt then
    from the rings, so skipping the per-step rebuild changes no output; it saves the rebuild
    on ``rate - 1`` of every ``rate`` steps (all but one in 128 on an HCA layer)."""
    if t.device.type != "cpu":
        return True
    return bool((threshold * rate == t + 1).any())


def _unchosen(ids: torch.Tensor, n: int) -> torch.Tensor:
    """ids [..., k] of chosen entries (-1 = none) -> bool [..., n], True where not chosen."""
    chosen = torch.zeros(*ids.shape[:-1], n + 1, dtype=torch.bool, device=ids.device)
    chosen.scatter_(-1, torch.where(ids >= 0, ids, torch.full_like(ids, n)), True)
    return ~chosen[..., :n]
