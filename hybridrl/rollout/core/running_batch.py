"""The running rows of the request scheduler, on the engine device.

Row i of every buffer (and of the KV cache) belongs to the request ``seqs[i]``; the
``n`` running rows are always packed at [0, n). Per decode step: one decode forward over
rows [0, n), one batched sample, a few in-place tensor ops, and one host read of the
``done`` rows (a sync per step on CUDA; free on CPU). A finished row leaves at once: its
hole is filled by moving the *last* row into it (``KVCache.copy_rows`` of only the
moved rows), so joining and leaving cost O(rows moved), never a repack of the batch.

Randomness is per request, never per batch: a request's uniforms ``u[t]`` (one per
generated token t) come from its own seed (``sampler.make_uniforms``), and the sampler
reads ``u[count]`` of each row. A request's tokens therefore depend only on (seed, its
logits), not on which requests share its steps or which row it sits in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridrl.rollout.layers.sampler import SamplingTensors, make_uniforms, sample
from hybridrl.rollout.models.vision_language.inputs import ImageLayout
from hybridrl.rollout.sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    """One request's host-side state (the scheduler owns it; the batch holds running ones)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    """max_tokens capped so prompt + response fits max_seq_len."""
    parent: str | None = None
    retain: bool = False
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_marks: list[tuple[int, int]] = field(default_factory=list)
    """(index of the first generated token, weight version) each time the version changed."""
    cached_tokens: int = 0
    life_start: int = 0
    """len(generated) when the request took its current row (tokens of earlier rows are in `generated`)."""
    layout: ImageLayout | None = None
    """vision-language engines: the prompt's images, mRoPE positions and rope delta."""

    def __post_init__(self):
        p = self.params
        # what the sampler's batch-wide fast paths need: greedy, truncating, T == 1, has stop ids
        self.flags = (p.temperature == 0, p.top_k > 0 or p.top_p < 1.0, p.temperature == 1.0, bool(p.stop_token_ids))

    @property
    def fed_tokens(self) -> list[int]:
        """What a prefill of this request runs: prompt + every generated token so far."""
        return self.prompt + self.generated if self.generated else self.prompt

    @property
    def prefill_key(self) -> tuple:
        """What makes two prefills identical: the fed ids (and, with images, where and which)."""
        tokens = tuple(self.fed_tokens)
        if self.layout is None or self.layout.images is None:
            return tokens
        return tokens, self.layout.annotations

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def token_versions(self) -> list[int]:
        if len(self.version_marks) == 1:
            return [self.version_marks[0][1]] * len(self.generated)
        out, marks = [], self.version_marks + [(len(self.generated), -1)]
        for (start, version), (end, _) in zip(marks, marks[1:]):
            out += [version] * (end - start)
        return out


SLOT_DTYPES = (torch.float64, torch.long, torch.float32)
"""the per-slot buffers ``[max_rows, max_seq_len]``: ``uniforms``, ``out_tokens``, ``out_logprobs``."""


class RunningBatch:
    """Device buffers ``[max_rows, ...]`` of the running rows and the ops on them."""

    @staticmethod
    def row_bytes(max_seq_len: int) -> int:
        """Bytes one row takes in the per-slot buffers (its per-row scalars are a few dozen more)."""
        return max_seq_len * sum(torch.empty((), dtype=d).element_size() for d in SLOT_DTYPES)

    def __init__(self, max_rows: int, max_seq_len: int, vocab_size: int, device: torch.device,
                 mrope: bool = False, exact: bool = False):
        """``mrope``: a vision-language model's rows carry a rope offset (``rope_deltas``);
        ``exact``: log-probs in the trainer's batch-invariant numerics (``SamplingTensors.exact``)."""
        M, L, dev = max_rows, max_seq_len, device
        self.exact = exact
        self.max_rows, self.max_seq_len, self.vocab_size, self.device = M, L, vocab_size, dev
        self.seqs: list[Sequence] = []
        self.tokens = torch.zeros(M, dtype=torch.long, device=dev)  # last sampled: the next decode input
        self.positions = torch.zeros(M, dtype=torch.long, device=dev)  # cache slot of `tokens`
        self.counts = torch.zeros(M, dtype=torch.long, device=dev)  # tokens generated so far
        self.max_new = torch.zeros(M, dtype=torch.long, device=dev)
        self.stop_ids = torch.full((M, 1), -1, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(M, 1, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(M, 1, dtype=torch.long, device=dev)
        self.top_p = torch.ones(M, 1, dtype=torch.float32, device=dev)
        self.uniforms, self.out_tokens, self.out_logprobs = (torch.zeros(M, L, dtype=d, device=dev)
                                                              for d in SLOT_DTYPES)
        self.arange = torch.arange(M, device=dev)
        self.host_positions = np.zeros(M, dtype=np.int64)  # mirror of `positions`: no sync for kv_len
        self._row_buffers = [self.tokens, self.positions, self.counts, self.max_new, self.stop_ids,
                             self.temperature, self.top_k, self.top_p, self.uniforms, self.out_tokens,
                             self.out_logprobs]
        # each row's rotary offset: position = slot + delta (vision-language; moves with its row)
        self.rope_deltas = torch.zeros(M, dtype=torch.long, device=dev) if mrope else None
        if mrope:
            self._row_buffers.append(self.rope_deltas)
        self._n_greedy = self._n_truncating = self._n_unit_temp = self._n_stopping = 0

    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self.seqs)

    # ---- joining -------------------------------------------------------------------
    def add(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Rows [n, n + k) <- ``seqs`` (their prefill just wrote those cache rows), then sample
        each one's next token from its prefill ``logits [k, V]``. Returns rows that are done."""
        r0, k = self.n, len(seqs)
        rows = slice(r0, r0 + k)
        width = max(len(s.params.stop_token_ids) for s in seqs)
        if width > self.stop_ids.shape[1]:
            self._widen_stop_ids(width)
        W = self.stop_ids.shape[1]
        dev = self.device
        fed = [len(s.prompt) + len(s.generated) for s in seqs]
        self.host_positions[r0:r0 + k] = fed
        # two host->device transfers for all per-row settings (requests of one generate share params)
        ints, floats, by_params = [], [], {}
        for s, f in zip(seqs, fed):
            p = s.params
            tail = by_params.get(id(p))
            if tail is None:
                tail = by_params[id(p)] = (
                    [p.top_k if p.top_k > 0 else self.vocab_size, *p.stop_token_ids] + [-1] * (W - len(p.stop_token_ids)),
                    [p.temperature, p.top_p])
            ints.append([f, len(s.generated), s.max_new, *tail[0]])
            floats.append(tail[1])
        ints_t = torch.tensor(ints, dtype=torch.long).to(dev)
        floats_t = torch.tensor(floats, dtype=torch.float32).to(dev)
        self.positions[rows] = ints_t[:, 0]
        self.counts[rows] = ints_t[:, 1]
        self.max_new[rows] = ints_t[:, 2]
        self.top_k[rows] = ints_t[:, 3:4]
        self.stop_ids[rows] = ints_t[:, 4:]
        self.temperature[rows] = floats_t[:, 0:1]
        self.top_p[rows] = floats_t[:, 1:2]
        if self.rope_deltas is not None:
            self.rope_deltas[rows] = torch.tensor([s.layout.delta for s in seqs], dtype=torch.long).to(dev)
        sampled = [i for i, s in enumerate(seqs) if not s.greedy]
        if sampled:  # one draw for all: row i's u[t] depends on its seed alone (sampler.make_uniforms)
            width = max(seqs[i].max_new for i in sampled)
            u = make_uniforms([seqs[i].seed for i in sampled], width, dev)
            if len(sampled) == k:
                self.uniforms[rows, :width] = u
            else:
                self.uniforms[torch.tensor(sampled, device=dev) + r0, :width] = u
        for s in seqs:
            s.life_start = len(s.generated)
        self._count(seqs, +1)
        self.seqs += seqs
        return self._sample_and_record(logits, r0, r0 + k)

    # ---- one decode step -----------------------------------------------------------------
    def decode_step(self, runner, recorder=None) -> list[int]:
        """Feed every running row's last token, sample the next; returns the rows now done."""
        n = self.n
        pos = self.host_positions[:n]
        kv_len = int(pos.max()) + 1
        aligned = bool(pos.min() == kv_len - 1)
        deltas = self.rope_deltas[:n] if self.rope_deltas is not None else None
        logits = runner.decode(self.tokens[:n], self.positions[:n], kv_len, aligned, deltas)
        if recorder is not None:
            recorder.after_decode(n, self.positions[:n])
        self.positions[:n].add_(1)
        self.host_positions[:n] += 1
        return self._sample_and_record(logits, 0, n)

    def _sample_and_record(self, logits: torch.Tensor, r0: int, r1: int) -> list[int]:
        rows = slice(r0, r1)
        counts = self.counts[rows]
        st = self._sampling_tensors(r0, r1, counts)
        tokens, logprobs = sample(logits, st, 0)
        ar = self.arange[rows]
        self.out_tokens[ar, counts] = tokens
        self.out_logprobs[ar, counts] = logprobs
        counts.add_(1)
        self.tokens[rows] = tokens
        done = counts >= self.max_new[rows]
        if self._n_stopping:
            done |= (tokens.unsqueeze(1) == self.stop_ids[rows]).any(dim=1)
        return [r0 + i for i in done.nonzero().view(-1).tolist()]

    def _sampling_tensors(self, r0: int, r1: int, counts: torch.Tensor) -> SamplingTensors:
        n, seqs = r1 - r0, self.seqs[r0:r1]
        if r0 == 0 and r1 == self.n:  # the whole batch: the running counters
            n_greedy, n_trunc, n_unit = self._n_greedy, self._n_truncating, self._n_unit_temp
        else:
            n_greedy, n_trunc, n_unit, _ = _flag_sums(seqs)
        all_greedy = n_greedy == n
        # counts < max_new <= max_seq_len here: a row samples only while it is not done
        uniforms = (torch.empty(n, 0, device=self.device) if all_greedy
                    else self.uniforms[r0:r1].gather(1, counts.view(n, 1)))
        return SamplingTensors(temperature=self.temperature[r0:r1], top_k=self.top_k[r0:r1], top_p=self.top_p[r0:r1],
                               uniforms=uniforms, all_greedy=all_greedy, use_top_k_top_p=n_trunc > 0,
                               any_greedy=n_greedy > 0, all_unit_temperature=n_unit == n, exact=self.exact)

    # ---- leaving -------------------------------------------------------------------------
    def take_outputs(self, rows: list[int]) -> list[tuple[Sequence, list[int], list[float]]]:
        """(seq, tokens, log-probs) generated in each row's current life; one host transfer."""
        idx = torch.tensor(rows, device=self.device)
        counts = self.counts[idx].tolist()
        width = max(counts)
        toks = self.out_tokens[idx, :width].tolist()
        lps = self.out_logprobs[idx, :width].tolist()
        out = []
        for r, c, t, lp in zip(rows, counts, toks, lps):
            s = self.seqs[r]
            out.append((s, t[s.life_start:c], lp[s.life_start:c]))
        return out

    def counts_now(self) -> list[int]:
        return self.counts[:self.n].tolist()

    def remove(self, rows: list[int], kv_cache, recorder=None) -> None:
        """Drop ``rows``: the last surviving rows move into their holes (cache + buffers)."""
        if not rows:
            return
        gone = set(rows)
        n, new_n = self.n, self.n - len(gone)
        holes = [r for r in sorted(gone) if r < new_n]
        movers = [r for r in range(new_n, n) if r not in gone]
        self._count([self.seqs[r] for r in gone], -1)
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            length = int(self.host_positions[movers].max()) + 1
            kv_cache.copy_rows(dst, src, length)
            if recorder is not None:
                recorder.copy_rows(dst, src, length)
            for buf in self._row_buffers:
                buf[dst] = buf[src]
            self.host_positions[holes] = self.host_positions[movers]
            for h, m in zip(holes, movers):
                self.seqs[h] = self.seqs[m]
        del self.seqs[new_n:]

    def clear(self) -> None:
        self._count(self.seqs, -1)
        self.seqs = []

    def _count(self, seqs: list[Sequence], sign: int) -> None:
        g, t, u, st = _flag_sums(seqs)
        self._n_greedy += sign * g
        self._n_truncating += sign * t
        self._n_unit_temp += sign * u
        self._n_stopping += sign * st

    def _widen_stop_ids(self, width: int) -> None:
        wider = torch.full((self.max_rows, width), -1, dtype=torch.long, device=self.device)
        wider[:, :self.stop_ids.shape[1]] = self.stop_ids
        i = next(j for j, b in enumerate(self._row_buffers) if b is self.stop_ids)  # identity: == compares values
        self.stop_ids = self._row_buffers[i] = wider


def _flag_sums(seqs: list[Sequence]) -> tuple[int, int, int, int]:
    """(greedy, truncating, unit-temperature, stopping) counts of ``seqs``."""
    if not seqs:
        return 0, 0, 0, 0
    return tuple(map(sum, zip(*(s.flags for s in seqs))))
