"""Device work for the rollout engine: prefill, decode steps, full-sequence logits.

Owns the model, the static KV cache and (on CUDA) the CUDA-graph runner. Knows
nothing about requests or sampling.

Vision-language models (``models/vision_language/``): prefill and extend take a
``MultimodalBatch`` (3-D rotary positions, image features at the image tokens); decode
takes each row's rope offset ``delta`` (its rotary position is ``slot + delta``, its KV slot
stays ``slot``), a static buffer in graph mode.
"""

from __future__ import annotations

import torch

from hybridrl.attention.masks import sdpa_mask
from hybridrl.rollout.compile import compile_fn
from hybridrl.rollout.core.cuda_graph import CudaGraphRunner
from hybridrl.rollout.core.kv_cache import KVCache, rank_kv_heads
from hybridrl.rollout.layers import flash_decode
from hybridrl.rollout.layers.attention import ForwardContext
from hybridrl.rollout.models.decoder.model import DecoderForCausalLM
from hybridrl.rollout.models.vision_language.inputs import MultimodalBatch, build_batch, logits_batch


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, compile_decode: bool = False):
        self.model, self.device = model, device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.v4 = model.config.v4 is not None  # DeepSeek-V4: its own state and forward (models/deepseek_v4/model.py)
        self.vl = model.config.vl  # vision-language: mRoPE positions and image features (models/vision_language/)
        if self.v4:
            from hybridrl.rollout.models.deepseek_v4.state import V4StateCache

            self.kv_cache = V4StateCache(model.config.v4, max_batch_size, max_seq_len, dtype, device)
        else:
            self.kv_cache = KVCache(model.config, max_batch_size, max_seq_len, dtype, device,
                                    kv_heads=rank_kv_heads(model.config, model.tp))
        self.rows = torch.arange(max_batch_size, device=device)  # decode cache rows, static
        self.slot_ids = torch.arange(max_seq_len, device=device)  # for decode masks, static
        self.graphs: CudaGraphRunner | None = None
        # a cache row decode must leave alone (a chunked prefill's, core/chunked_prefill.py): no
        # graph whose padding rows would write into it replays while it is set
        self.protected_row: int | None = None
        # Decode attention through flash-attn's per-row cache lengths (CUDA, fp16/bf16, the
        # package installed): cost ~ live length, also inside a graph. Else the masked path.
        self.flash_decode = (model.config.mla is None  # MLA decodes over its latent cache (models/deepseek_v3/mla.py)
                             and flash_decode.usable(device, dtype, model.config.head_dim))
        # batch-invariant numerics (``LayerContext.exact``): attention is told each row's keys
        # (``ForwardContext.seq_lens``), nothing is compiled, no mask is built
        self.exact = bool(getattr(model, "exact", False))
        self._decode_step = self.decode_eager
        self.compiled = compile_decode and not self.exact
        if self.compiled:
            # dynamic=True: one compiled step for every batch size (compaction shrinks it) and
            # kv_len (grows every step). Opt-in and not a CPU speedup: measured on 2 cores
            # (tiny model, batch 64) it compiles for ~35 s and then decodes at 0.7x eager.
            self._decode_step = compile_fn(self.decode_eager, dynamic=True)  # cache per CPU capability

    def capture_cuda_graphs(self, batch_sizes: list[int]) -> None:
        self.graphs = CudaGraphRunner(self, batch_sizes)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, row_start: int = 0,
                mm: MultimodalBatch | None = None) -> torch.Tensor:
        """Right-padded prompts input_ids [B, S], lengths [B] -> next-token logits [B, V] float32.

        Writes the prompts' k/v into cache rows [row_start, row_start + B), slots [0, S).
        ``mm``: a vision-language batch's rotary positions and image features (``multimodal``).
        """
        B, S = input_ids.shape
        if self.v4:
            valid = self.slot_ids[:S].view(1, S) < lengths.view(B, 1)
            hidden = self.model.model(input_ids, valid, self.kv_cache, row_start)
            return self.model.compute_logits(hidden[self.rows[:B], lengths - 1]).float()
        positions = self.slot_ids[:S].expand(B, S)
        cos, sin = self.model.model.rotary_emb.tables(positions if mm is None else mm.positions)
        ctx = ForwardContext(positions, cos, sin, kv_cache=self.kv_cache, is_prefill=True, row_start=row_start,
                             visual=mm.visual if mm is not None else None, seq_lens=lengths if self.exact else None)
        hidden = self.model(input_ids, ctx)
        last = hidden[self.rows[:B], lengths - 1]  # (B, hidden)
        return self.model.compute_logits(last).float()

    @torch.inference_mode()
    def extend(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               row_start: int, mm: MultimodalBatch | None = None) -> torch.Tensor:
        """New tokens after cached prefixes -> next-token logits [B, V] float32.

        input_ids [B, C] right-padded; row b's cache row ``row_start + b`` already holds
        slots [0, starts[b]) and its lengths[b] new tokens go to slots starts[b] onwards.
        Pad queries sit past their row's end (clamped to the last slot): what they write
        there is overwritten before any valid query reads it.
        """
        B, C = input_ids.shape
        if self.v4:  # unreachable: V4 rows are never retained (models/deepseek_v4/state.py), so nothing extends
            raise RuntimeError("extend: the DeepSeek-V4 state cannot continue a retained prefix")
        positions = (starts.view(B, 1) + self.slot_ids[:C].view(1, C)).clamp_(max=self.max_seq_len - 1)
        T = int((starts + lengths).max())
        mask = None if self.exact else (self.slot_ids[:T].view(1, 1, T) <= positions.view(B, C, 1)).view(B, 1, C, T)
        cos, sin = self.model.model.rotary_emb.tables(positions if mm is None else mm.positions)
        ctx = ForwardContext(positions, cos, sin, kv_cache=self.kv_cache, is_prefill=True, attn_mask=mask,
                             kv_len=T, row_start=row_start, extend=True, visual=mm.visual if mm is not None else None,
                             seq_lens=starts + lengths if self.exact else None)
        hidden = self.model(input_ids, ctx)
        last = hidden[self.rows[:B], lengths - 1]
        return self.model.compute_logits(last).float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
               aligned: bool = False, rope_deltas: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B] at positions [B] (cache rows [0, B)) -> logits [B, V] float32.
        ``rope_deltas`` [B] (vision-language): row b's rotary position is positions[b] + rope_deltas[b].

        kv_len bounds the slots attended in eager mode; graphs attend over max_seq_len
        (with flash decode, each row over its own length in both modes).
        `aligned` promises every position == kv_len - 1, so eager mode needs no mask.
        """
        if self.graphs is not None and self.graphs.can_run(tokens.shape[0]) and self._graph_spares(tokens.shape[0]):
            return self.graphs.replay(tokens, positions, rope_deltas)
        with torch.inference_mode():
            if self.compiled:
                # Compiled: the aligned path indexes the cache with the Python int kv_len - 1,
                # which dynamo specializes on, recompiling every step until its limit.
                aligned = False
            if rope_deltas is None:
                return self._decode_step(tokens, positions, kv_len, aligned)
            return self._decode_step(tokens, positions, kv_len, aligned, rope_deltas)

    def _graph_spares(self, B: int) -> bool:
        """Whether the graph that runs ``B`` rows pads short of ``protected_row``."""
        return self.protected_row is None or next(b for b in self.graphs.batch_sizes if b >= B) <= self.protected_row

    def decode_eager(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                     aligned: bool = False, rope_deltas: torch.Tensor | None = None) -> torch.Tensor:
        """The decode step itself; also what the CUDA graphs capture (with kv_len = max_seq_len)."""
        B = tokens.shape[0]
        if self.v4:
            return self.model.compute_logits(self.model.model.decode(tokens, positions.view(B), self.kv_cache)).float()
        pos = positions.view(B, 1)
        cos, sin = self.model.model.rotary_emb.tables(pos if rope_deltas is None else pos + rope_deltas.view(B, 1))
        slot = kv_len - 1 if aligned else None
        if self.exact:
            ctx = ForwardContext(pos, cos, sin, kv_cache=self.kv_cache, is_prefill=False, rows=self.rows[:B],
                                 kv_len=kv_len, slot=slot, seq_lens=positions.view(B) + 1)
        elif self.flash_decode:
            # Row b attends slots [0, positions[b]] over whole cache rows, whatever kv_len is:
            # the same call eager and in a graph, and no mask.
            seqlens = (positions.view(B) + 1).to(torch.int32)
            ctx = ForwardContext(pos, cos, sin, kv_cache=self.kv_cache, is_prefill=False, rows=self.rows[:B],
                                 kv_len=self.max_seq_len, slot=slot, cache_seqlens=seqlens)
        else:
            mask = None if aligned else (self.slot_ids[:kv_len].view(1, kv_len) <= pos).view(B, 1, 1, kv_len)
            ctx = ForwardContext(pos, cos, sin, kv_cache=self.kv_cache, is_prefill=False, attn_mask=mask,
                                 rows=self.rows[:B], kv_len=kv_len, slot=slot)
        hidden = self.model(tokens.view(B, 1), ctx)
        return self.model.compute_logits(hidden[:, 0]).float()

    def multimodal(self, layouts: list, starts: list[int], width: int) -> MultimodalBatch:
        """The vision-language inputs of a prefill (``starts`` 0) or an extend of rows laid
        out by ``layouts`` (``ImageLayout``), ``width`` tokens each: one vision-tower call
        over the images with tokens among them."""
        return build_batch(layouts, starts, width, self.model.model.encode, self.max_seq_len - 1, self.device)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, images=None) -> torch.Tensor:
        """Full-sequence logits [B, S, V] float32, no KV cache involved.

        Right padding (or no padding) runs as plain causal attention, no mask at all; any
        other padding is honoured with positions = cumsum(mask) - 1 and the bool
        [B, 1, S, S] `sdpa_mask`, built at the memory floor (its output plus O(B*S), never
        an S x S temporary). Outputs at pad positions are meaningless (a pad query attends
        only to itself there); valid positions never see a pad key. ``images``: a
        vision-language model's ``RowImages`` (each row's valid tokens laid out with its images).
        """
        B, S = input_ids.shape
        mask = attention_mask.to(torch.bool)
        if self.v4:  # V4's compressors cut windows from position 0: move each row's tokens there
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid tokens first, in order
            packed = self.model.logits(input_ids.gather(1, order), mask.gather(1, order))
            return torch.empty_like(packed).scatter_(1, order.unsqueeze(-1).expand_as(packed), packed)
        if self.exact:
            return self._logits_exact(input_ids, mask, images)
        right_padded = bool((mask.long().cumsum(-1) == torch.arange(1, S + 1, device=mask.device)).eq(mask).all())
        if right_padded:
            positions, attn_mask = self.slot_ids[:S].expand(B, S), None
        else:
            positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)
            attn_mask = sdpa_mask(mask)
        rope_positions, visual = positions, None
        if self.vl is not None:
            mm = logits_batch(input_ids, attention_mask, images, self.vl.tokens, self.model.model.encode)
            rope_positions, visual = mm.positions, mm.visual
        elif images is not None:
            raise ValueError(f"logits: images given, but the {self.model.config.model_type} model takes none")
        cos, sin = self.model.model.rotary_emb.tables(rope_positions)
        ctx = ForwardContext(positions, cos, sin, kv_cache=None, attn_mask=attn_mask, visual=visual)
        return self.model.compute_logits(self.model(input_ids, ctx)).float()

    def _logits_exact(self, input_ids: torch.Tensor, mask: torch.Tensor, images=None) -> torch.Tensor:
        """``logits`` under exact numerics: each row's tokens moved to slot 0 (the exact attention
        counts key blocks from a sequence's first token), run, and put back in place."""
        B, S = input_ids.shape
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid tokens first, in order
        ids = input_ids.gather(1, order)
        positions = rope_positions = self.slot_ids[:S].expand(B, S)
        visual = None
        if self.vl is not None:  # the images laid out over the moved rows (right-padded now)
            mm = logits_batch(ids, mask.gather(1, order).long(), images, self.vl.tokens, self.model.model.encode)
            rope_positions, visual = mm.positions, mm.visual
        elif images is not None:
            raise ValueError(f"logits: images given, but the {self.model.config.model_type} model takes none")
        cos, sin = self.model.model.rotary_emb.tables(rope_positions)
        ctx = ForwardContext(positions, cos, sin, kv_cache=None, seq_lens=mask.sum(1), visual=visual)
        packed = self.model.compute_logits(self.model(ids, ctx)).float()
        return torch.empty_like(packed).scatter_(1, order.unsqueeze(-1).expand_as(packed), packed)

    def named_state_tensors(self):
        yield from self.kv_cache.named_tensors()
        yield "runner.rows", self.rows
        yield "runner.slot_ids", self.slot_ids
        if self.graphs is not None:
            yield from self.graphs.named_tensors()
