"""Sampling log-probs of the full vocabulary, before top-k / top-p, from vLLM.

Our definition (docs/interfaces.md, the built-in sampler, the trainer's recompute):
``log_softmax(logits / T)`` over the whole vocabulary, *before* top-k / top-p truncation;
``log_softmax(logits)`` for greedy rows. No vLLM ``logprobs_mode`` gives that with truncation
on (vllm/v1/sample/sampler.py): ``raw_*`` are before the temperature, ``processed_*`` after
top-k / top-p (a ``processed_logprobs`` value is renormalized over the kept tokens, higher than
ours by ``-log(kept mass)``).

So the engine runs vLLM with ``logprobs_mode="raw_logits"`` — the sampled token's logit ``r``,
float32, before any processing — and this logits processor records, at every step, the other
half: ``lse = logsumexp(logits / T)`` of each of our rows over the full vocabulary. The
log-prob is then ``r / T - lse`` in float32 (:func:`sampled_logprob`), exact to the float32
rounding of the trainer's ``log_softmax``.

Where it runs: a processor that is *not* argmax-invariant runs in
``Sampler.apply_logits_processors`` on every batch, greedy ones included, on the float32
logits before penalties, temperature and top-k / top-p; it returns them unchanged. This is
the V1 model runner's interface (``vllm.v1.sample.logits_processor``); vLLM 0.32's V2 runner
(the CUDA default) has another, so the engine selects V1 (``VLLM_USE_V2_MODEL_RUNNER=0``).

Bookkeeping: rows are tagged through ``SamplingParams.extra_args[TAG]``; untagged requests
(vLLM's own warm-up) are ignored. A record is keyed by (tag, number of tokens the request has
generated so far) — the position of the token being sampled. A step that is sampled and then
discarded (a chunk of a prefill) is recorded under the same key as the real step after it,
which overwrites it. Records stay on the device until :meth:`take` (one transfer per generate).
"""

from __future__ import annotations

import torch

TAG = "hybridrl_row"
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy (vllm/v1/sample/sampler.py)


_CLASS: list[type] = []  # built once per process (vLLM caches loaded processor classes)


def processor_class() -> type:
    """The processor class (built lazily: importing this module must not import vLLM)."""
    if not _CLASS:
        _CLASS.append(_make_class())
    return _CLASS[0]


def _make_class() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class FullVocabLogprobs(LogitsProcessor):
        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.device = torch.device(device)
            self.rows: dict[int, tuple[int, float, list[int]]] = {}  # batch index -> (tag, T, output ids)
            self.order: list[int] = []  # batch indices of our rows, in the order of `temps`
            self.temps = torch.ones(0, 1, device=self.device)  # (R, 1) float32
            self.records: list[tuple[list[tuple[int, int]], torch.Tensor]] = []

        def is_argmax_invariant(self) -> bool:
            return False  # placement only (every batch, before temperature); logits are not changed

        @staticmethod
        def _row(params, _prompt_ids, output_ids):
            tag = (params.extra_args or {}).get(TAG)
            if tag is None:
                return None
            t = params.temperature
            return int(tag), (t if t >= _SAMPLING_EPS else 1.0), output_ids

        def update_state(self, batch_update) -> None:
            if process_dict_updates(self.rows, batch_update, self._row):
                self.order = sorted(self.rows)
                self.temps = torch.tensor([[self.rows[i][1]] for i in self.order], dtype=torch.float32,
                                          device=self.device).reshape(-1, 1)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.order:
                return logits
            if self.order == list(range(logits.shape[0])):
                rows = logits  # (B, V) float32, every row ours
            else:
                rows = logits[torch.tensor(self.order, device=logits.device)]
            lse = torch.logsumexp(rows / self.temps, dim=-1)  # (R,) float32, no host sync
            self.records.append(([(self.rows[i][0], len(self.rows[i][2])) for i in self.order], lse))
            return logits

        def take(self) -> dict[tuple[int, int], float]:
            """(tag, position) -> logsumexp, later records overwriting earlier; clears the records."""
            out: dict[tuple[int, int], float] = {}
            if self.records:
                values = torch.cat([lse for _, lse in self.records]).tolist()  # one transfer
                keys = [k for ks, _ in self.records for k in ks]
                out = dict(zip(keys, values))
            self.records.clear()
            return out

    FullVocabLogprobs.__qualname__ = "FullVocabLogprobs"
    return FullVocabLogprobs


def take_records(worker) -> dict[tuple[int, int], float]:
    """The processor's records in ``worker`` (called in-process through ``collective_rpc``)."""
    procs = worker.model_runner.input_batch.logitsprocs
    for proc in procs.all:
        if hasattr(proc, "take") and type(proc).__name__ == "FullVocabLogprobs":
            return proc.take()
    raise RuntimeError("VllmEngine: vLLM's model runner does not hold the FullVocabLogprobs logits processor "
                       "(a model runner without V1 logits processors?); sampling log-probs cannot be computed")


def sampled_logprobs(raw_logits: list[float], temperatures: list[float], lse: list[float]) -> list[float]:
    """``log_softmax(logits / T)[token]`` per token from its raw logit and its row's logsumexp,
    in float32 as vLLM scales (``logits / T``; greedy: T = 1)."""
    t = torch.tensor(temperatures, dtype=torch.float32)
    t = torch.where(t >= _SAMPLING_EPS, t, torch.ones_like(t))
    z = torch.tensor(raw_logits, dtype=torch.float32) / t
    return (z - torch.tensor(lse, dtype=torch.float32)).tolist()
