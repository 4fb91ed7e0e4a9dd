"""Chunked prefill (vLLM's scheduling on the slot KV cache): a prompt longer than the per-step
prefill budget is prefilled a chunk per engine step, between the running rows' decode steps.

One request (with the identical prompts of its group, ``n`` samples: prefilled once) is
chunked at a time, in the *last* cache row: the running rows are packed at ``[0, n)`` and
the scheduler holds back as many rows as the group has samples, so decode never touches
that row (``ModelRunner.protected_row`` keeps padded CUDA-graph rows off it too). The
first chunk is a prefill into slots ``[0, C)`` (a continued conversation's first chunk is
an extend after its parent's retained prefix, copied in); each later chunk is an ``extend``
over the row's own slots. Only the last chunk's logits are sampled: the row is then copied
to the group's rows ``[n, n + k)`` (``KVCache.copy_rows``) and the requests join the batch.

A chunk holds at most the step's remaining budget, except that it never ends inside an
image's tokens (vision-language): it runs on to the image's end, and each image is encoded
in the chunk that holds its tokens. The MoE routing recorder records every chunk
(``begin_prefill`` / ``after_prefill`` / ``after_extend``), so the record covers every
prompt token. DeepSeek-V4's state cannot extend (``ModelRunner.extend``): its prompts are
never chunked here; they prefill whole, alone, as without chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.rollout.core.prefix_cache import PrefixEntry
from hybridrl.rollout.core.running_batch import Sequence
from hybridrl.rollout.models.vision_language.inputs import ImageLayout


@dataclass(eq=False)
class Chunking:
    seqs: list[Sequence]
    """the request and the identical prompts prefilled with it (their rows copied at the end)."""
    done: int
    """tokens of ``seqs[0].fed_tokens`` already in the row (slots ``[0, done)``)."""
    prefilled: bool
    """whether the row holds anything yet (the first chunk of a fresh prompt is a prefill)."""


class ChunkedPrefill:
    def __init__(self, runner):
        self.runner, self.kv_cache = runner, runner.kv_cache
        self.row = runner.max_batch_size - 1
        self.current: Chunking | None = None

    @property
    def usable(self) -> bool:
        """DeepSeek-V4 cannot extend, so it cannot chunk."""
        return not self.runner.v4

    @property
    def reserved(self) -> int:
        """Rows held back for the chunked group (it joins at ``[n, n + k)``)."""
        return len(self.current.seqs) if self.current is not None else 0

    @property
    def seqs(self) -> list[Sequence]:
        return self.current.seqs if self.current is not None else []

    def start(self, seqs: list[Sequence], entry: PrefixEntry | None, cached: int, recorder) -> None:
        """Begin chunking ``seqs`` (identical prompts); ``entry``: the parent's retained prefix
        serving the first ``cached`` tokens (copied into the row now)."""
        if cached:
            self.kv_cache.write_row(self.row, entry.kv, cached)
            if recorder is not None and entry.routing is not None:
                recorder.write_row(self.row, entry.routing[:cached])
        seqs[0].cached_tokens = cached
        self.current = Chunking(seqs, cached, bool(cached))
        self.runner.protected_row = self.row

    def advance(self, budget: int, recorder) -> tuple[int, torch.Tensor | None]:
        """Run the next chunk (``budget`` tokens at most, to an image's end): (tokens fed, the
        last chunk's next-token logits ``[1, V]`` or None while more chunks remain)."""
        c = self.current
        s = c.seqs[0]
        tokens = s.fed_tokens
        start = c.done
        end = chunk_end(s.layout, start, min(start + budget, len(tokens)))
        C, dev = end - start, self.runner.device
        input_ids = torch.tensor([tokens[start:end]], dtype=torch.long, device=dev)
        lengths = torch.tensor([C], device=dev)
        mm = (self.runner.multimodal([_layout_until(s.layout, end)], [start], C)
              if self.runner.vl is not None else None)
        if recorder is not None:
            recorder.begin_prefill()
        if not c.prefilled:
            logits = self.runner.prefill(input_ids, lengths, row_start=self.row, mm=mm)
            if recorder is not None:
                recorder.after_prefill(torch.tensor([self.row], device=dev), torch.zeros(1, dtype=torch.long,
                                                                                         device=dev), 1, C)
        else:
            starts = torch.tensor([start], device=dev)
            logits = self.runner.extend(input_ids, starts, lengths, row_start=self.row, mm=mm)
            if recorder is not None:
                positions = (starts.view(1, 1) + torch.arange(C, device=dev)).clamp_(max=self.runner.max_seq_len - 1)
                recorder.after_extend(self.row, positions)
        c.done, c.prefilled = end, True
        return C, (logits if end == len(tokens) else None)

    def finish(self, r0: int, recorder) -> list[Sequence]:
        """The prefill is complete: copy the row to rows ``[r0, r0 + k)``; the group's requests."""
        seqs, length = self.current.seqs, self.current.done
        k, dev = len(seqs), self.runner.device
        if not (k == 1 and r0 == self.row):
            dst = torch.arange(r0, r0 + k, device=dev)
            src = torch.full((k,), self.row, dtype=torch.long, device=dev)
            self.kv_cache.copy_rows(dst, src, length)
            if recorder is not None:
                recorder.copy_rows(dst, src, length)
        self.clear()
        return seqs

    def remove(self, s: Sequence) -> bool:
        """Drop ``s`` (an abort); the row is freed with the last of its group."""
        if s not in self.seqs:
            return False
        self.current.seqs.remove(s)
        if not self.current.seqs:
            self.clear()
        return True

    def clear(self) -> list[Sequence]:
        """Stop chunking (a refit that recomputes); the requests that were being prefilled."""
        seqs = self.seqs
        self.current = None
        self.runner.protected_row = None
        return seqs


def chunk_end(layout: ImageLayout | None, start: int, end: int) -> int:
    """``end``, moved on to the end of an image it would cut (never through an image's tokens)."""
    if layout is not None:
        for a, e in layout.spans:
            if a < end < e and e > start:
                end = e
    return end


def _layout_until(layout: ImageLayout, end: int) -> ImageLayout:
    """``layout`` without the images that start at or after ``end`` (not in this chunk)."""
    m = sum(1 for a, _ in layout.spans if a < end)
    if m == len(layout.spans):
        return layout
    images = layout.images.select(0, m) if layout.images is not None else None
    return ImageLayout(images, layout.spans[:m], layout.positions, layout.delta)
