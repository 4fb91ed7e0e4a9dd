"""The request-level API (``add_request`` / ``step`` / ``abort``, rollout/requests.py) of
``VllmEngine``, on vLLM's own continuous-batching scheduler (``llm.llm_engine``).

Each of our requests runs as one tagged ``n=1`` vLLM request at a time (a *segment*):
vLLM id ``hybridrl-req-<tag>``, the tag from the engine's request counter (shared with
``generate``, so no tag is ever reused) keying the log-prob processor's records
(full_vocab_logprobs.py). vLLM streams each segment's new tokens (``RequestOutputKind.DELTA``)
with their raw logits; every ``step`` also takes the processor's records, so a token's
``logsumexp(logits / T)`` is stored with its request as soon as it is sampled.

Invariants (``VllmRequests``):

- ``live`` holds every request added and not yet finished or aborted; each is either
  *held* (``tag is None``: added during a weight update, in ``held`` in arrival order) or
  *in vLLM* (``by_vllm_id[vllm_id(tag)] is it``). Nothing else is ever sent to vLLM here.
- A request's ``tokens``, ``raw`` and ``keys`` have one entry per generated token (across
  all its segments); ``keys[i]`` is ``(tag, position in that segment)``, the processor's key.
- ``version_marks`` are ``(index of the first token, weight version)`` per segment or per
  refit ("keep"), as in the built-in scheduler (running_batch.Sequence.token_versions).
- ``retained``: ids of finished requests added with ``retain=True`` and not released
  (bounded: the oldest are forgotten past :data:`MAX_RETAINED`). vLLM's automatic prefix
  caching reuses a parent's KV by itself, so ``parent`` is only validated against it.

**Refit** (``after_update``): nothing runs while an update is open (the engine's ``step``
refuses, new requests are held). After a committed update, "recompute" aborts every request
in vLLM and re-submits it as prompt + tokens so far with ``max_tokens`` reduced by them (a
new segment), after resetting vLLM's prefix cache (its blocks hold old-weight KV, and vLLM
resets only with nothing running): the KV is recomputed with the new weights. "keep"
continues in vLLM with the KV the old weights wrote; only the version changes.

**Seeded sampling across a recompute**: vLLM draws a request's samples from a per-request
generator seeded once at submission. A re-submitted segment is seeded with
``seed + number of tokens already generated`` — reproducible, but *not* the random stream
an uninterrupted run would have continued with (the built-in engine indexes its uniforms by
token position, so there a recompute changes nothing but the weights). Greedy requests are
exact: their tokens after a recompute are the new weights' greedy continuation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from hybridrl.rollout.backend import check_parent, check_request, request_seed
from hybridrl.rollout.requests import RequestOutput, StepOutput
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.rollout.core.scheduler import KV_ON_REFIT
from hybridrl.vllm_backend import full_vocab_logprobs as fvl
from hybridrl.vllm_backend.isolation import preserve_torch_state
from hybridrl.vllm_backend.requests import vllm_request

MAX_RETAINED = 65536
"""Finished retained ids remembered for ``parent`` (the oldest are forgotten first)."""


def check_kv_on_refit(kv_on_refit: str) -> str:
    if kv_on_refit not in KV_ON_REFIT:
        raise ValueError(f"kv_on_refit={kv_on_refit!r}: use 'recompute' (default, exact) or 'keep'")
    return kv_on_refit


def vllm_id(tag: int) -> str:
    """vLLM's (external) id of the segment with processor tag ``tag``; never an integer
    string, so it cannot clash with ``LLM.generate``'s own counter ids."""
    return f"hybridrl-req-{tag}"


@dataclass(eq=False)
class LiveRequest:
    """One of our requests while it waits or runs (its tokens accumulate over segments)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    """tokens it may generate in all (params.max_tokens capped by max_seq_len)."""
    retain: bool
    tokens: list[int] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    """vLLM's raw logit of each sampled token (``logprobs_mode="raw_logits"``)."""
    keys: list[tuple[int, int]] = field(default_factory=list)
    """(tag, position) of each token's logsumexp record."""
    lse: dict[tuple[int, int], float] = field(default_factory=dict)
    version_marks: list[tuple[int, int]] = field(default_factory=list)
    tag: int | None = None
    """processor tag of the segment in vLLM; None while held outside vLLM."""
    segment_start: int = 0
    """len(tokens) when the current segment was submitted."""
    got_first_output: bool = False
    """whether the current segment has reported (its prefill's cached tokens were read)."""
    cached_tokens: int = 0

    def token_versions(self) -> list[int]:
        out, marks = [], self.version_marks + [(len(self.tokens), -1)]
        for (start, version), (end, _) in zip(marks, marks[1:]):
            out += [version] * (end - start)
        return out


class VllmRequests:
    """Request bookkeeping of one ``VllmEngine`` (``owner``: its ``llm``, its tag counter
    ``_requests``, ``weight_version``, ``max_seq_len``, ``vocab_size``). The engine checks the
    weights (update open, broken) before :meth:`step`; everything else is checked here."""

    def __init__(self, owner: Any, kv_on_refit: str = "recompute"):
        self.owner = owner
        self.kv_on_refit = check_kv_on_refit(kv_on_refit)
        self.live: dict[str, LiveRequest] = {}
        self.held: list[LiveRequest] = []  # added during an open weight update, in order
        self.by_vllm_id: dict[str, LiveRequest] = {}
        self.retained: OrderedDict[str, None] = OrderedDict()
        from vllm.sampling_params import RequestOutputKind  # the engine imported vLLM already

        self._delta = RequestOutputKind.DELTA

    @property
    def llm(self):
        return self.owner.llm

    @property
    def in_vllm(self) -> int:
        """Number of our requests vLLM holds (``generate`` and ``sleep`` need none)."""
        return len(self.by_vllm_id)

    # ---- requests ------------------------------------------------------------------------
    def add(self, request_id: str, token_ids: list[int], params: SamplingParams | None, *,
            parent: str | None, retain: bool, hold: bool) -> None:
        """Validate, then submit to vLLM (or hold while a weight update is open: ``hold``)."""
        params = params or SamplingParams()
        max_seq_len = self.owner.max_seq_len
        token_ids = check_request(request_id, token_ids, params, self.live, max_seq_len, self.owner.vocab_size)
        if parent is not None:
            self._check_parent(request_id, parent)
        r = LiveRequest(request_id, token_ids, params, request_seed(params.seed, 0),
                        min(params.max_tokens, max_seq_len - len(token_ids)), retain)
        self.live[request_id] = r
        if hold:
            self.held.append(r)
        else:
            self._submit(r)

    def _check_parent(self, request_id: str, parent: str) -> None:
        check_parent(request_id, parent, parent in self.retained, self.live)

    def _submit(self, r: LiveRequest) -> None:
        """Send ``r``'s next segment to vLLM: prompt + tokens so far, the tokens left, a new tag."""
        done = len(r.tokens)
        tag = self.owner._requests
        self.owner._requests += 1
        params = vllm_request(self.owner._vllm_sampling_params, r.params, (r.seed + done) % 2**63,
                              r.max_new - done, tag)
        params.output_kind = self._delta  # each step reports only the new tokens
        with preserve_torch_state():
            # rendered as LLM.generate does (vLLM deprecates raw prompts in add_request)
            (prompt,) = self.llm.renderer.render_cmpl([{"prompt_token_ids": r.prompt + r.tokens}])
            self.llm.llm_engine.add_request(vllm_id(tag), prompt, params, lora_request=self.owner.lora_request)
        r.tag, r.segment_start, r.got_first_output = tag, done, False
        self._mark_version(r)
        self.by_vllm_id[vllm_id(tag)] = r

    def _mark_version(self, r: LiveRequest) -> None:
        """Tokens from ``len(r.tokens)`` on carry the engine's current version."""
        mark = (len(r.tokens), self.owner.weight_version)
        if r.version_marks and r.version_marks[-1][0] == mark[0]:
            r.version_marks[-1] = mark  # no token came from the previous mark
        elif not r.version_marks or r.version_marks[-1][1] != mark[1]:
            r.version_marks.append(mark)

    def _withdraw(self, r: LiveRequest) -> None:
        """Abort ``r``'s segment in vLLM (its KV blocks are freed at once, in-process)."""
        name = vllm_id(r.tag)
        with preserve_torch_state():
            self.llm.llm_engine.abort_request([name])
        del self.by_vllm_id[name]
        r.tag = None

    def abort(self, request_id: str) -> RequestOutput | None:
        r = self.live.pop(request_id, None)
        if r is None:
            return None
        if r.tag is None:
            self.held.remove(r)
        else:
            self._withdraw(r)
        return self._output(r, "abort")

    def release(self, request_id: str) -> bool:
        """Forget a retained id (its conversation ends); True if it was retained."""
        if request_id not in self.retained:
            return False
        del self.retained[request_id]
        return True

    def has_unfinished(self) -> bool:
        return bool(self.live)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """One ``llm_engine.step()``: new tokens of every segment that progressed, then the
        processor's records of this step; finished requests come back complete."""
        with preserve_torch_state():
            outputs = self.llm.llm_engine.step()
            records = self.llm.collective_rpc(fvl.take_records)[0]
        out, progressed = StepOutput(), []
        for o in outputs:
            r = self.by_vllm_id.get(o.request_id)
            if r is None:
                continue  # not ours (nothing else should run while we step; ignore it)
            if not r.got_first_output:
                r.got_first_output = True
                cached = int(getattr(o, "num_cached_tokens", None) or 0)
                if r.segment_start == 0:
                    r.cached_tokens = cached
                out.prefilled_tokens += len(o.prompt_token_ids or ()) - cached
            c = o.outputs[0]
            for i, t in enumerate(c.token_ids):
                r.raw.append(c.logprobs[i][t].logprob)  # raw logit (logprobs_mode)
                r.keys.append((r.tag, len(r.tokens) - r.segment_start))
                r.tokens.append(int(t))
            if o.finished:
                progressed.append((r, c.finish_reason))
            else:
                progressed.append((r, None))
        for (tag, pos), value in records.items():
            r = self.by_vllm_id.get(vllm_id(tag))
            if r is not None:
                r.lse[(tag, pos)] = value  # later records (a discarded chunk's sample) overwrite
        running = []
        for r, reason in progressed:
            if reason is None:
                running.append(r)
                continue
            del self.by_vllm_id[vllm_id(r.tag)]
            del self.live[r.request_id]
            if r.retain:
                self.retained[r.request_id] = None
                self.retained.move_to_end(r.request_id)
                while len(self.retained) > MAX_RETAINED:
                    self.retained.popitem(last=False)
            out.finished.append(self._output(r, str(reason)))
        out.running = tuple(running)
        return out

    def _output(self, r: LiveRequest, reason: str) -> RequestOutput:
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM finished request {r.request_id!r} with reason {reason!r}")
        missing = [i for i, k in enumerate(r.keys) if k not in r.lse]
        if missing:
            raise RuntimeError(f"VllmEngine: no logsumexp recorded for request {r.request_id!r} at positions "
                               f"{missing[:8]}; the full-vocabulary log-prob bookkeeping lost track of a request")
        temps = [r.params.temperature] * len(r.tokens)
        logprobs = fvl.sampled_logprobs(r.raw, temps, [r.lse[k] for k in r.keys]) if r.tokens else []
        return RequestOutput(request_id=r.request_id, prompt_token_ids=r.prompt, token_ids=r.tokens,
                             logprobs=logprobs, token_versions=r.token_versions(), finished=True,
                             finish_reason=reason, cached_tokens=r.cached_tokens)

    # ---- weights -------------------------------------------------------------------------
    def after_update(self, committed: bool) -> None:
        """A weight update closed (``committed``: vLLM holds new weights and the engine's
        version advanced). Committed: recompute or keep the requests in vLLM and reset the
        prefix cache when vLLM allows it. Then submit the requests held during the update."""
        if committed:
            with preserve_torch_state():
                self._apply_new_weights()
        for r in self.held:
            self._submit(r)
        self.held.clear()

    def _apply_new_weights(self) -> None:
        running = list(self.by_vllm_id.values())
        if self.kv_on_refit == "recompute":
            for r in running:
                self._withdraw(r)
            self._reset_prefix_cache()  # nothing of ours runs now, so vLLM resets
            for r in running:
                self._submit(r)  # a new segment: prompt + tokens so far, KV from the new weights
            return
        for r in running:
            self._mark_version(r)
        if not running:
            self._reset_prefix_cache()
        # else "keep": no reset — vLLM refuses while requests hold blocks, and the running
        # requests are meant to continue on their old-weight KV. Blocks of requests that
        # finished before the refit stay cached too, so a later prompt with the same prefix
        # may reuse old-weight KV: part of the "keep" approximation (the next update that
        # finds nothing running resets them).

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():  # cached KV blocks were computed with the old weights
            raise RuntimeError("VllmEngine: vLLM refused to reset its prefix cache after a weight update "
                               f"({self.in_vllm} of our requests in vLLM); its cached KV is stale")
