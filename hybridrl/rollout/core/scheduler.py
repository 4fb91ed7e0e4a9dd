"""The request scheduler of the built-in engine: continuous batching over the slot KV cache.

``step()`` does, in order:

1. **decode** every running row once (``RunningBatch.decode_step``);
2. **retire** the rows that finished (stop token or length): their outputs are read once,
   a ``retain``-ed one leaves its KV in the prefix cache, the rows are freed at once;
3. **admit** waiting requests FIFO into the free rows, against a per-step prefill budget
   (``max_prefill_tokens`` new prompt tokens; at least one request per step, so a prompt
   longer than the budget still runs, alone — or, with ``chunked_prefill``, is
   prefilled in chunks: ``core/chunked_prefill.py``): fresh prompts in one right-padded prefill
   (identical prompts — the ``n`` samples of a GRPO group — prefilled once and their rows
   copied), continued conversations as an *extend* over their parent's retained prefix.
   Each admitted request samples its first token from its prefill logits; it decodes
   from the next step on.

With ``chunked_prefill``, a prompt longer than the whole budget takes its first chunk from
what the budget has left at its turn, and one chunk per later step, before any admission:
a step decodes the running rows and prefills at most ``max_prefill_tokens`` new tokens (a
chunk may run on to the end of an image), so no running request waits more than one
chunk per token. Nothing changes while no prompt exceeds the budget.

So a request that finishes frees its row for a waiting one in the same step, and a
long answer never holds back the rest (the run-to-completion loop this replaces waited
for a chunk's longest row). Admission control is rows: each row reserves a whole
``max_seq_len`` sequence, so an admitted request always runs to its end (nothing to
preempt for memory).

**Weight updates** (``on_weights_changed``): between steps only (the engine's lock). With
``kv_on_refit="recompute"`` (default) every running request goes back to the *front* of
the queue keeping its tokens, and is prefilled again (prompt + generated so far) with the
new weights — exactly what a request started with the new weights from there would do;
retained prefixes computed with the old weights are dropped. ``"keep"`` continues with the
KV the old weights wrote (an approximation, measured in benchmarks/rollout.py); the
prefixes stay. Either way every token records the version that sampled it.

**Images** (vision-language engines): a request's images are laid out and checked against
its image tokens at ``add`` (``models/vision_language/inputs.py``: a mismatch raises before
anything is queued). Identical prompts are identical only with the same images at the same
places; a retained prefix serves a continuation only up to the first image the two do not
share (same place, same content), and a prefill encodes only the images with tokens among
its new tokens: a continued conversation's earlier images are not encoded again, a
recomputed request's are.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from hybridrl.rollout.backend import check_parent, check_request, request_seed
from hybridrl.data.vision import ImageInputs
from hybridrl.rollout.core.chunked_prefill import ChunkedPrefill
from hybridrl.rollout.core.kv_cache import KVCache
from hybridrl.rollout.core.prefix_cache import PrefixCache, PrefixEntry, common_prefix_length
from hybridrl.rollout.routing import active_recorder
from hybridrl.rollout.requests import RequestOutput, StepOutput
from hybridrl.rollout.core.running_batch import RunningBatch, Sequence
from hybridrl.rollout.models.vision_language.inputs import image_layout, shared_image_prefix
from hybridrl.rollout.sampling_params import SamplingParams

KV_ON_REFIT = ("recompute", "keep")


class Scheduler:
    def __init__(self, runner, vocab_size: int, weight_version: Callable[[], int], *, max_prefill_tokens: int,
                 prefix_cache_bytes: int, kv_on_refit: str = "recompute", chunked_prefill: bool = True):
        """``weight_version``: reads the engine's version (the engine is its only writer);
        ``chunked_prefill``: prefill prompts longer than the budget in chunks (False: alone, whole)."""
        if kv_on_refit not in KV_ON_REFIT:
            raise ValueError(f"kv_on_refit={kv_on_refit!r}: use 'recompute' (default, exact) or 'keep'")
        self.runner, self.kv_cache = runner, runner.kv_cache
        self.vocab_size, self.max_seq_len = vocab_size, runner.max_seq_len
        self.max_prefill_tokens, self.kv_on_refit = max_prefill_tokens, kv_on_refit
        self.vl = runner.vl  # vision-language: the model's image token ids and merge size (None: text only)
        self.batch = RunningBatch(runner.max_batch_size, runner.max_seq_len, vocab_size, runner.device,
                                  mrope=self.vl is not None, exact=runner.exact)
        self.waiting: deque[Sequence] = deque()
        self.live: dict[str, Sequence] = {}  # every waiting or running request by id
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self._weight_version = weight_version
        self.chunks = ChunkedPrefill(runner)
        self.chunked = chunked_prefill and self.chunks.usable
        self.stats = {"steps": 0, "prefill_tokens": 0, "cached_tokens": 0, "recomputed_requests": 0,
                      "chunks": 0}

    @property
    def weight_version(self) -> int:
        return self._weight_version()

    @property
    def recorder(self):
        """The MoE routing recorder (routing.py) when one is enabled, else None."""
        return active_recorder(self.runner.model)

    # ---- requests ------------------------------------------------------------------------
    def add(self, request_id: str, token_ids: list[int], params: SamplingParams, *,
            parent: str | None = None, retain: bool = False, front: bool = False,
            images: ImageInputs | None = None, placeholders=None) -> None:
        token_ids = check_request(request_id, token_ids, params, self.live, self.max_seq_len, self.vocab_size)
        if parent is not None:
            self._check_parent(request_id, parent)
        layout = self._layout(request_id, token_ids, images, placeholders)
        seq = Sequence(request_id, token_ids, params, request_seed(params.seed, 0),
                       min(params.max_tokens, self.max_seq_len - len(token_ids)), parent=parent, retain=retain,
                       layout=layout)
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        self.live[request_id] = seq

    def _layout(self, request_id: str, token_ids: list[int], images: ImageInputs | None, placeholders):
        """A vision-language request's image layout (checked: ``ImageTokenMismatch``); None otherwise."""
        if self.vl is None:
            if images is not None:
                raise ValueError(f"add_request {request_id!r}: images given, but this model takes none "
                                 "(a text-only model)")
            return None
        try:
            return image_layout(token_ids, images, self.vl.tokens, placeholders)
        except ValueError as e:
            raise type(e)(f"add_request {request_id!r}: {e}") from None

    def add_samples(self, request_ids: list[str], samples, images: list[ImageInputs | None] | None = None) -> None:
        """``generate``'s requests: ``(prompt, params, seed, max_new)`` from ``expand_requests``
        (prompts already checked; ``params.n`` samples share one params object); ``images``:
        each sample's (vision-language), all checked before any is queued."""
        clash = self.live.keys() & set(request_ids)
        if clash:
            raise ValueError(f"add_samples: ids already waiting or running: {sorted(clash)[:4]}")
        images = images or [None] * len(samples)
        layouts, by_prompt = [], {}
        for rid, (prompt, *_), im in zip(request_ids, samples, images):
            key = (id(prompt), id(im))  # the n samples of a prompt share its list and its images
            if key not in by_prompt:
                by_prompt[key] = self._layout(rid, prompt, im, None)
            layouts.append(by_prompt[key])
        for rid, (prompt, params, seed, max_new), layout in zip(request_ids, samples, layouts):
            seq = Sequence(rid, prompt, params, seed, max_new, layout=layout)
            self.waiting.append(seq)
            self.live[rid] = seq

    def _check_parent(self, request_id: str, parent: str) -> None:
        check_parent(request_id, parent, parent in self.prefixes or self.prefixes.was_evicted(parent), self.live)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The request's output so far (finish_reason "abort"); None if it is not waiting or running."""
        s = self.live.pop(request_id, None)
        if s is None:
            return None
        if s in self.waiting:
            self.waiting.remove(s)
            return _output(s, "abort")
        if self.chunks.remove(s):
            return _output(s, "abort")
        row = self.batch.seqs.index(s)
        (_, toks, lps), = self.batch.take_outputs([row])
        s.generated += toks
        s.logprobs += lps
        self.batch.remove([row], self.kv_cache, self.recorder)
        return _output(s, "abort")

    def release(self, request_id: str) -> bool:
        """Drop a retained prefix (a conversation that will not continue); True if one was held."""
        return self.prefixes.drop(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.batch.n > 0 or self.chunks.current is not None

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput()
        done = self.batch.decode_step(self.runner, self.recorder) if self.batch.n else []
        self._retire(done, out)
        budget = self.max_prefill_tokens
        if self.chunks.current is not None:
            budget -= self._advance_chunk(out, budget)
        if self.waiting and self.batch.free_rows > self.chunks.reserved and budget > 0:
            self._admit(out, budget)
        out.running = tuple(self.batch.seqs)
        self.stats["steps"] += 1
        return out

    def _retire(self, rows: list[int], out: StepOutput) -> None:
        if not rows:
            return
        for row, (s, toks, lps) in zip(rows, self.batch.take_outputs(rows)):
            s.generated += toks
            s.logprobs += lps
            total = len(s.prompt) + len(s.generated)
            routing = self.recorder.sequence_record(row, total) if self.recorder is not None else None
            if s.retain:
                self._retain(row, s, total - 1, routing)
            reason = "stop" if s.generated[-1] in s.params.stop_token_ids else "length"
            out.finished.append(_output(s, reason, routing))
            del self.live[s.request_id]
        self.batch.remove(rows, self.kv_cache, self.recorder)

    def _retain(self, row: int, s: Sequence, fed: int, routing: torch.Tensor | None) -> None:
        if not getattr(self.kv_cache, "retainable", True):  # DeepSeek-V4's state cannot be rewound
            self.prefixes.decline(s.request_id)
            return
        kv = self.kv_cache.read_row(row, fed)
        self.prefixes.put(s.request_id, PrefixEntry(s.fed_tokens[:fed], kv,
                                                    routing[:fed].to(kv[0].device) if routing is not None else None,
                                                    self.weight_version,
                                                    s.layout.annotations if s.layout is not None else ()))

    def _admit(self, out: StepOutput, budget: int) -> None:
        fresh: list[Sequence] = []  # prefilled from slot 0
        extend: list[tuple[Sequence, PrefixEntry, int]] = []  # (seq, parent prefix, cached tokens)
        seen: set[tuple[int, ...]] = set()
        free, chunk = self.batch.free_rows - self.chunks.reserved, None
        while self.waiting and len(fresh) + len(extend) < free:
            s = self.waiting[0]
            tokens = s.fed_tokens
            entry = self._parent_prefix(s)
            cached = min(common_prefix_length(entry.tokens, tokens), len(tokens) - 1) if entry is not None else 0
            if cached and s.layout is not None:  # the cache serves only up to the first image not shared
                cached = shared_image_prefix(entry.images, s.layout.annotations, cached)
            cost = len(tokens) - cached
            key = s.prefill_key if not cached else None
            if key is not None and key in seen:
                cost = 0  # an identical prompt in this prefill: its rows are copied
            if cost > budget and (fresh or extend or self.chunked):
                if self.chunked and cost > self.max_prefill_tokens and self.chunks.current is None and budget:
                    chunk = (self._take_group(key, free - len(fresh) - len(extend)), entry, cached)
                break
            self.waiting.popleft()
            budget -= cost
            if cached:
                extend.append((s, entry, cached))
            else:
                fresh.append(s)
                seen.add(key)
        logits = []
        if not (fresh or extend):  # the head waits for budget (a chunk in progress took it) or starts chunking
            if chunk is not None:
                self._start_chunk(chunk, out, budget)
            return
        if fresh:
            logits.append(self._prefill_fresh(fresh, out))
        if extend:
            logits.append(self._prefill_extend(extend, out, self.batch.n + len(fresh)))
        seqs = fresh + [s for s, _, _ in extend]
        for s in seqs:
            s.version_marks.append((len(s.generated), self.weight_version))
        r0 = self.batch.n
        done = self.batch.add(seqs, torch.cat(logits) if len(logits) > 1 else logits[0])
        assert self.batch.n == r0 + len(seqs)
        self._retire(done, out)
        if chunk is not None:
            self._start_chunk(chunk, out, budget)

    # ---- chunked prefill (core/chunked_prefill.py) ---------------------------------------------
    def _take_group(self, key: tuple | None, room: int) -> list[Sequence]:
        """The queue's head and the identical prompts right behind it (``room`` rows at most)."""
        group = [self.waiting.popleft()]
        while (key is not None and len(group) < room and self.waiting and self.waiting[0].parent is None
               and self.waiting[0].prefill_key == key):
            group.append(self.waiting.popleft())
        return group

    def _start_chunk(self, chunk: tuple[list[Sequence], PrefixEntry | None, int], out: StepOutput,
                     budget: int) -> None:
        seqs, entry, cached = chunk
        self.chunks.start(seqs, entry, cached, self.recorder)
        if cached:
            self.stats["cached_tokens"] += cached
            self.prefixes.hit_tokens += cached
        self._advance_chunk(out, budget)

    def _advance_chunk(self, out: StepOutput, budget: int) -> int:
        """The chunked request's next chunk; after its last, it joins the running rows. Tokens fed."""
        fed, logits = self.chunks.advance(budget, self.recorder)
        out.prefilled_tokens += fed
        self.stats["prefill_tokens"] += fed
        self.stats["chunks"] += 1
        if logits is not None:
            seqs = self.chunks.finish(self.batch.n, self.recorder)
            for s in seqs:
                s.version_marks.append((len(s.generated), self.weight_version))
            done = self.batch.add(seqs, logits[[0] * len(seqs)])
            self._retire(done, out)
        return fed

    def _parent_prefix(self, s: Sequence) -> PrefixEntry | None:
        if s.parent is None or s.generated:  # a recomputed request runs its whole prefix again
            return None
        version = self.weight_version if self.kv_on_refit == "recompute" else None
        return self.prefixes.get(s.parent, version)

    def _prefill_fresh(self, seqs: list[Sequence], out: StepOutput) -> torch.Tensor:
        """One prefill of the distinct prompts into rows [n, n + U), copied to the rows of
        identical prompts; returns next-token logits [len(seqs), V]."""
        dev, r0 = self.runner.device, self.batch.n
        first: dict[tuple, int] = {}
        src = [first.setdefault(s.prefill_key, len(first)) for s in seqs]
        reps = {k: s for k, s in zip((s.prefill_key for s in seqs), seqs)}
        unique = [reps[k].fed_tokens for k in first]
        S = max(len(p) for p in unique)
        input_ids = torch.tensor([list(p) + [0] * (S - len(p)) for p in unique], dtype=torch.long)
        lengths = torch.tensor([len(p) for p in unique], device=dev)
        mm = (self.runner.multimodal([reps[k].layout for k in first], [0] * len(first), S)
              if self.vl is not None else None)
        if self.recorder is not None:
            self.recorder.begin_prefill()
        logits = self.runner.prefill(input_ids.to(dev), lengths, row_start=r0, mm=mm)
        src_rows = torch.tensor(src, device=dev)
        dst_rows = torch.arange(r0, r0 + len(seqs), device=dev)
        if self.recorder is not None:
            self.recorder.after_prefill(dst_rows, src_rows, len(unique), S)
        if len(unique) < len(seqs):
            self.kv_cache.copy_rows(dst_rows, src_rows + r0, S)
            logits = logits[src_rows]
        n_tokens = sum(len(p) for p in unique)
        out.prefilled_tokens += n_tokens
        self.stats["prefill_tokens"] += n_tokens
        return logits

    def _prefill_extend(self, items: list[tuple[Sequence, PrefixEntry, int]], out: StepOutput,
                        r0: int) -> torch.Tensor:
        """Copy each parent's retained prefix into rows [r0, r0 + k), then prefill the rest."""
        dev = self.runner.device
        news, starts = [], []
        for i, (s, entry, cached) in enumerate(items):
            self.kv_cache.write_row(r0 + i, entry.kv, cached)
            if self.recorder is not None and entry.routing is not None:
                self.recorder.write_row(r0 + i, entry.routing[:cached])
            s.cached_tokens = cached
            news.append(s.fed_tokens[cached:])
            starts.append(cached)
        C = max(len(t) for t in news)
        input_ids = torch.tensor([t + [0] * (C - len(t)) for t in news], dtype=torch.long, device=dev)
        starts_t = torch.tensor(starts, device=dev)
        lengths = torch.tensor([len(t) for t in news], device=dev)
        mm = (self.runner.multimodal([s.layout for s, _, _ in items], starts, C)
              if self.vl is not None else None)
        if self.recorder is not None:
            self.recorder.begin_prefill()
        logits = self.runner.extend(input_ids, starts_t, lengths, row_start=r0, mm=mm)
        if self.recorder is not None:
            positions = (starts_t.view(-1, 1) + torch.arange(C, device=dev)).clamp_(max=self.max_seq_len - 1)
            self.recorder.after_extend(r0, positions)
        n_new, n_cached = sum(len(t) for t in news), sum(starts)
        out.prefilled_tokens += n_new
        self.stats["prefill_tokens"] += n_new
        self.stats["cached_tokens"] += n_cached
        self.prefixes.hit_tokens += n_cached
        return logits

    # ---- weights -------------------------------------------------------------------------
    def on_weights_changed(self, version: int) -> None:
        """A weight update committed ``version`` (called between steps). A request being
        prefilled in chunks restarts its prefill under the new weights (``"recompute"``) or
        continues it (``"keep"``)."""
        if self.kv_on_refit == "recompute" and self.chunks.current is not None:
            chunked = self.chunks.clear()
            for s in chunked:
                s.cached_tokens = 0
            self.stats["recomputed_requests"] += len(chunked)
            self.waiting.extendleft(reversed(chunked))
        if not self.batch.n:
            if self.kv_on_refit == "recompute":
                self.prefixes.clear()
            return
        if self.kv_on_refit == "keep":
            for s, count in zip(self.batch.seqs, self.batch.counts_now()):
                s.version_marks.append((count, version))
            return
        self.prefixes.clear()
        rows = list(range(self.batch.n))
        held = []
        for s, toks, lps in self.batch.take_outputs(rows):
            s.generated += toks
            s.logprobs += lps
            held.append(s)
        self.batch.clear()
        self.stats["recomputed_requests"] += len(held)
        self.waiting.extendleft(reversed(held))  # first in line, in their order


def _output(s: Sequence, reason: str | None, routing: torch.Tensor | None = None) -> RequestOutput:
    """A finished request's lists are handed over (it never changes again); a running one's copied."""
    done = reason is not None
    return RequestOutput(request_id=s.request_id, prompt_token_ids=s.prompt,
                         token_ids=s.generated if done else list(s.generated),
                         logprobs=s.logprobs if done else list(s.logprobs), token_versions=s.token_versions(),
                         finished=done,
                         finish_reason=reason, cached_tokens=s.cached_tokens, routed_experts=routing,
                         images=s.layout.images if s.layout is not None else None)
