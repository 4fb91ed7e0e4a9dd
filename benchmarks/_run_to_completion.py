"""The baseline: the built-in engine's generation loop before continuous batching (kept
verbatim but for the routing record, which it does not need here), as the benchmarks'
"run to completion" side: requests cut into chunks of max_batch_size, each chunk run to
its longest row. It drives the same engine's ModelRunner (same model, same kernels).

The decode loop for one batch of requests (<= max_batch_size rows).

Per step: one decode forward, one batched sample, a few small in-place tensor ops; the
only host sync is the `done` check every `sync_every` steps (free on CPU). When at
most `compact_at` of the current rows are still running (half on CUDA, where graphs come
in batch buckets; 7/8 on CPU, where a step costs in proportion to its rows), finished
rows are *compacted* out:
the survivors' cache rows move to [0, n) and every per-row tensor is gathered, so the
remaining steps run on a smaller batch (on CUDA: replay a smaller graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.rollout.layers.sampler import SamplingTensors, make_uniforms, sample
from hybridrl.rollout.core.model_runner import ModelRunner
from hybridrl.rollout.sampling_params import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    """max_tokens capped so prompt + response fits max_seq_len."""


@dataclass
class BatchState:
    """Per-row decode state; rows are compacted together."""

    row_map: torch.Tensor  # [B] long: output row of each running row
    tokens: torch.Tensor  # [B] long: last sampled token (input of the next step)
    positions: torch.Tensor  # [B] long: cache slot of `tokens`
    done: torch.Tensor  # [B] bool
    max_new: torch.Tensor  # [B] long
    stop_ids: torch.Tensor  # [B, n_stop] long, -1 padded
    sampling: SamplingTensors

    def select(self, rows: torch.Tensor) -> "BatchState":
        return BatchState(self.row_map[rows], self.tokens[rows], self.positions[rows], self.done[rows],
                          self.max_new[rows], self.stop_ids[rows], self.sampling.select(rows))


def run_batch(runner: ModelRunner, requests: list[Request], vocab_size: int,
              sync_every: int = 1, compact_at: float = 0.5) -> list[tuple[list[int], list[float], str]]:
    """Generate for `requests`; returns (response ids, log-probs, finish reason) per request."""
    dev, B = runner.device, len(requests)
    lens = [len(r.prompt) for r in requests]
    S, steps = max(lens), max(r.max_new for r in requests)
    # Rows with equal-length prompts all sit at the same slot every step: no decode mask needed.
    aligned = min(lens) == S
    state = _initial_state(requests, torch.tensor(lens, device=dev), steps, vocab_size, dev)
    has_stop = state.stop_ids.shape[1] > 0
    out_tokens = torch.full((B, steps), -1, dtype=torch.long, device=dev)
    out_logprobs = torch.zeros(B, steps, dtype=torch.float32, device=dev)
    logits = _prefill_unique(runner, [r.prompt for r in requests], S)
    for step in range(steps):
        if step > 0:
            logits = runner.decode(state.tokens, state.positions, min(S + step, runner.max_seq_len), aligned)
            state.positions.add_(1).clamp_(max=runner.max_seq_len - 1)  # finished rows may run past
        tokens, logprobs = sample(logits, state.sampling, step)
        out_tokens[state.row_map, step] = tokens.masked_fill(state.done, -1)
        out_logprobs[state.row_map, step] = logprobs
        state.tokens = tokens
        state.done |= state.max_new <= step + 1
        if has_stop:
            state.done |= (tokens.unsqueeze(1) == state.stop_ids).any(dim=1)
        if step + 1 < steps and (step + 1) % sync_every == 0:
            running = (~state.done).nonzero().squeeze(1)
            n = running.numel()
            if n == 0:
                break
            if n <= state.done.numel() * compact_at:
                runner.kv_cache.copy_rows(torch.arange(n, device=dev), running, min(S + step, runner.max_seq_len))
                state = state.select(running)
    return _collect(out_tokens.cpu(), out_logprobs.cpu(), requests)


def _prefill_unique(runner: ModelRunner, prompts: list[list[int]], S: int) -> torch.Tensor:
    """Prefill each distinct prompt once, then copy its cache row to every row that shares it.

    GRPO batches hold n copies of each prompt; prefilling the U distinct ones (rows [0, U))
    and gathering cache rows costs 1/n of the prompt FLOPs. Returns logits [B, V] float32.
    """
    first: dict[tuple[int, ...], int] = {}
    src = [first.setdefault(tuple(p), len(first)) for p in prompts]
    unique = list(first)
    input_ids = torch.tensor([list(p) + [0] * (S - len(p)) for p in unique], dtype=torch.long)  # (U, S)
    lengths = torch.tensor([len(p) for p in unique], device=runner.device)
    logits = runner.prefill(input_ids.to(runner.device), lengths)
    if len(unique) == len(prompts):
        return logits
    src_rows = torch.tensor(src, device=runner.device)
    runner.kv_cache.copy_rows(torch.arange(len(prompts), device=runner.device), src_rows, S)
    return logits[src_rows]


def _initial_state(requests, lengths, steps, vocab_size, dev) -> BatchState:
    B = len(requests)
    ps = [r.params for r in requests]
    n_stop = max(len(p.stop_token_ids) for p in ps)
    stop_ids = torch.tensor([list(p.stop_token_ids) + [-1] * (n_stop - len(p.stop_token_ids)) for p in ps],
                            dtype=torch.long).view(B, n_stop)
    all_greedy = all(p.temperature == 0 for p in ps)
    sampling = SamplingTensors(
        temperature=torch.tensor([[p.temperature] for p in ps], dtype=torch.float32, device=dev),
        top_k=torch.tensor([[p.top_k if p.top_k > 0 else vocab_size] for p in ps], device=dev),
        top_p=torch.tensor([[p.top_p] for p in ps], dtype=torch.float32, device=dev),
        uniforms=torch.empty(B, 0, device=dev) if all_greedy else make_uniforms([r.seed for r in requests], steps, dev),
        all_greedy=all_greedy,
        use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in ps),
        any_greedy=any(p.temperature == 0 for p in ps),
        all_unit_temperature=all(p.temperature == 1.0 for p in ps),
    )
    return BatchState(
        row_map=torch.arange(B, device=dev), tokens=torch.zeros(B, dtype=torch.long, device=dev),
        positions=lengths.clone(), done=torch.zeros(B, dtype=torch.bool, device=dev),
        max_new=torch.tensor([r.max_new for r in requests], device=dev), stop_ids=stop_ids.to(dev),
        sampling=sampling)


def _collect(out_tokens: torch.Tensor, out_logprobs: torch.Tensor, requests: list[Request]):
    """One host transfer per tensor, then plain list slicing (per-row .tolist() is slow at B=256)."""
    counts = (out_tokens >= 0).sum(dim=1).tolist()
    all_tokens, all_logprobs = out_tokens.tolist(), out_logprobs.tolist()
    results = []
    for r, n, tokens, logprobs in zip(requests, counts, all_tokens, all_logprobs):
        tokens = tokens[:n]
        reason = "stop" if tokens and tokens[-1] in r.params.stop_token_ids else "length"
        results.append((tokens, logprobs[:n], reason))
    return results


def generate_run_to_completion(engine, prompt_token_ids: list[list[int]], params, compact: bool = True):
    """What ``RolloutEngine.generate`` did before continuous batching: chunks of
    max_batch_size, each run to completion (finished rows compacted out at 7/8 on CPU)."""
    from hybridrl.rollout.backend import expand_requests
    from hybridrl.rollout.rollouts import build_rollouts

    requests = [Request(prompt, p, seed, max_new) for prompt, p, seed, max_new
                in expand_requests(prompt_token_ids, params, engine.max_seq_len, engine.config.vocab_size)]
    cpu = engine.device.type == "cpu"
    sync_every, compact_at = (1, 7 / 8) if cpu else (8, 1 / 2)
    if not compact:
        compact_at = 0.0
    results = []
    for i in range(0, len(requests), engine.max_batch_size):
        chunk = requests[i:i + engine.max_batch_size]
        results += run_batch(engine.runner, chunk, engine.config.vocab_size, sync_every, compact_at)
    return build_rollouts([r.prompt for r in requests], [t for t, _, _ in results], [lp for _, lp, _ in results],
                          [f for _, _, f in results], engine.weight_version, engine.pad_token_id)
