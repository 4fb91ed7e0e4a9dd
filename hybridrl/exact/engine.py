"""The exact rollout engine (``rollout.exact=true``): samples with the trainer's own modules
under batch-invariant numerics, so its log-probs are bitwise the trainer's recomputation.

It holds no weights of its own: it runs the policy module the trainer trains (colocated,
one process), so a "refit" moves nothing and can deliver no stale or half-written
weight. It keeps the engines' weight-update bracket all the same (``begin_weight_update()``
-> ``finish_weight_update(version=...)``, with nothing to load in between): the bracket
records the version of the policy after each update, the number a refit would record.

Generation: the requests of a chunk (up to ``max_batch_size`` rows) are left-padded
into one batch, prefilled in one call and decoded one token per call for every row with
transformers' KV cache; attention is :data:`~hybridrl.exact.attention.EXACT_ATTN` with
each row's sequence start, every GEMM / transcendental / vocabulary reduction runs under
:func:`~hybridrl.exact.ops.batch_invariant`. A row's tokens and log-probs therefore
depend on its own prompt, seed and the weights only. Rows that finished keep decoding
(their outputs are dropped) until the chunk is done: a static batch, not the built-in
engine's continuous batching (docs/exact.md gives the cost).

Sampling follows the built-in sampler's contract (per-row uniforms from the row's own seed,
inverse CDF of the truncated distribution; reported log-prob = the full distribution's),
with logits scaled exactly as the trainer scores them: ``z.float() / T`` by a Python
scalar, then ``z - logsumexp(z)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.exact.attention import exact_attention_for
from hybridrl.exact.ops import batch_invariant, check_batch_invariance, exact_log_softmax
from hybridrl.rollout.backend import expand_requests, next_weight_version
from hybridrl.rollout.layers.sampler import SamplingTensors, draw, make_uniforms
from hybridrl.rollout.rollouts import build_rollouts
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.rollout.weight_update import WeightUpdateError


NOT_EXACT = {"deepseek_v4": "its compressed attention runs padded only, not through the exact attention"}


class ExactEngine:
    """``generate`` over ``model`` (a transformers causal LM, the trainer's policy module)."""

    shares_trainer_weights = True  # RolloutWorker: nothing to send, an empty bracket records the version

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int, max_seq_len: int, pad_token_id: int = 0):
        model_type = getattr(model.config, "model_type", None)
        if model_type in NOT_EXACT:
            raise ValueError(f"rollout.exact: {model_type} is not supported ({NOT_EXACT[model_type]}); "
                             "set rollout.exact=false")
        first = next(model.parameters())
        check_batch_invariance(first.dtype, device=first.device)
        self.model = model
        self.hf_config = model.config  # what every engine exposes (the served model's config)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.pad_token_id = pad_token_id
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.dtype = next(model.parameters()).dtype
        self._weight_version = 0
        self._updating = False  # between begin_weight_update() and finish / abort

    # ---- weights: the trainer's own ------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def weight_update_in_progress(self) -> bool:
        return self._updating

    def begin_weight_update(self) -> None:
        """The policy is changing (an optimizer step, a load); nothing reaches this engine."""
        if self._updating:
            raise WeightUpdateError("a weight update of this engine is already in progress; finish or abort it first")
        self._updating = True

    def load_weights(self, named_tensors) -> set[str]:
        raise ValueError("ExactEngine.load_weights: it runs the trainer's own modules, there is nothing to load; "
                         "call begin_weight_update() then finish_weight_update(version=...)")

    def abort_weight_update(self) -> None:
        self._updating = False

    def finish_weight_update(self, check: Callable[[], None] | None = None, *, version: int | None = None) -> int:
        """Record the policy's new version (``version``: the publisher's; None: +1) after
        ``check()`` passed; returns it. The update is closed whatever happens."""
        if not self._updating:
            raise WeightUpdateError("finish: no weight update in progress; call engine.begin_weight_update() first")
        self._updating = False
        new_version = next_weight_version(self._weight_version, version)
        if check is not None:
            check()
        self._weight_version = new_version
        return new_version

    def state_dict(self) -> dict[str, int]:
        return {"weight_version": self._weight_version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._weight_version = int(state["weight_version"])

    # ---- inference -----------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None):
        """Sample every prompt's responses (``n`` per prompt, rows prompt-major) -> ``Rollouts``."""
        samples = expand_requests(prompt_token_ids, params or SamplingParams(), self.max_seq_len, self.vocab_size)
        prompts, responses, logprobs, reasons = [], [], [], []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), batch_invariant(), exact_attention_for(self.model):
                for s in range(0, len(samples), self.max_batch_size):
                    chunk = samples[s:s + self.max_batch_size]
                    for (prompt, _, _, _), out in zip(chunk, self._generate_chunk(chunk)):
                        prompts.append(prompt)
                        responses.append(out[0])
                        logprobs.append(out[1])
                        reasons.append(out[2])
        finally:
            self.model.train(was_training)
        ro = build_rollouts(prompts, responses, logprobs, reasons, self._weight_version, self.pad_token_id)
        ro.token_versions = torch.where(ro.response_mask.bool(), self._weight_version, -1)
        return ro

    def _generate_chunk(self, chunk):
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        B = len(chunk)
        lengths = torch.tensor([len(p) for p, *_ in chunk])
        P = int(lengths.max())
        starts = (P - lengths).to(device)
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        for b, (prompt, *_) in enumerate(chunk):
            ids[b, P - len(prompt):] = torch.tensor(prompt)
        ids = ids.to(device)
        max_new = [m for *_, m in chunk]
        steps = max(max_new)
        uniforms = make_uniforms([seed for _, _, seed, _ in chunk], steps, device)
        temps = [p.temperature for _, p, _, _ in chunk]
        stops = [set(p.stop_token_ids) for _, p, _, _ in chunk]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for _, p, _, _ in chunk],
                             device=device).view(B, 1)
        top_p = torch.tensor([p.top_p for _, p, _, _ in chunk], dtype=torch.float32, device=device).view(B, 1)
        truncate = bool((top_k < self.vocab_size).any() or (top_p < 1).any())
        st = SamplingTensors(temperature=torch.tensor(temps, dtype=torch.float32, device=device).view(B, 1),
                             top_k=top_k, top_p=top_p, uniforms=uniforms, all_greedy=False,
                             use_top_k_top_p=truncate, any_greedy=any(t == 0 for t in temps))

        backbone = getattr(self.model, self.model.base_model_prefix)
        head = self.model.get_output_embeddings()
        cache = DynamicCache(config=self.model.config)
        positions = (torch.arange(P, device=device).view(1, P) - starts.view(B, 1)).clamp(min=0)
        hidden = backbone(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                          exact_key_starts=starts).last_hidden_state[:, -1]
        out_tokens = [[] for _ in range(B)]
        out_logp = [[] for _ in range(B)]
        reason = [None] * B
        for step in range(steps):
            logits = head(hidden)
            tokens, logp = self._sample(logits, temps, st, step)
            tl, ll = tokens.tolist(), logp.tolist()
            for b in range(B):
                if reason[b] is not None:
                    continue
                out_tokens[b].append(tl[b])
                out_logp[b].append(ll[b])
                if tl[b] in stops[b]:
                    reason[b] = "stop"
                elif len(out_tokens[b]) >= max_new[b]:
                    reason[b] = "length"
            if all(r is not None for r in reason):
                break
            pos = (P + step - starts).view(B, 1)
            hidden = backbone(input_ids=tokens.view(B, 1), position_ids=pos, past_key_values=cache, use_cache=True,
                              exact_key_starts=starts).last_hidden_state[:, -1]
        return [(out_tokens[b], out_logp[b], reason[b]) for b in range(B)]

    @staticmethod
    def _sample(logits, temps, st: SamplingTensors, step: int):
        """logits [B, V] (model dtype) -> tokens [B] long, log-probs [B] float32: the log-probs
        in the trainer's numerics (each row divided by its Python-scalar temperature, as the
        trainer divides, then the fixed-order log-softmax), drawn by the engine's sampler."""
        z = logits.float()
        if len(set(temps)) == 1:
            t = temps[0]
            if t not in (0.0, 1.0):
                z = z / t  # a Python scalar, as the trainer divides
        else:
            z = torch.stack([row / t if t not in (0.0, 1.0) else row for row, t in zip(z, temps)])
        return draw(logits.float(), exact_log_softmax(z), st, step)
