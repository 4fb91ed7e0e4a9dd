"""Our samples as vLLM requests, and vLLM's outputs back as ``Rollouts``.

Each sample (``rollout/backend.py: expand_requests``) becomes one ``n=1`` vLLM request from
token ids, tagged for the log-prob processor (full_vocab_logprobs.py), which reports the
sampled token's raw logit (``logprobs_mode="raw_logits"``); its log-prob is then
``raw logit / T - logsumexp(logits / T)`` from the processor's records.
"""

from __future__ import annotations

from hybridrl.rollout.rollouts import Rollouts, build_rollouts
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.vllm_backend import full_vocab_logprobs as fvl


def vllm_request(vllm_sampling_params, p: SamplingParams, seed: int, max_new: int, tag: int):
    """vLLM ``SamplingParams`` of one sample of ``p`` (``vllm_sampling_params``: vLLM's class)."""
    return vllm_sampling_params(
        n=1, temperature=p.temperature, top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p,
        max_tokens=max_new, stop_token_ids=list(p.stop_token_ids), ignore_eos=True,
        seed=seed, logprobs=0, detokenize=False, extra_args={fvl.TAG: tag})


def rollouts_from_outputs(prompts: list[list[int]], outputs, temperatures: list[float],
                          lse: dict[tuple[int, int], float], first_tag: int, weight_version: int,
                          pad_token_id: int) -> Rollouts:
    """Token ids, finish reasons, and log_softmax(logits / T)[token] = raw logit / T -
    logsumexp(logits / T) of every sampled token (full_vocab_logprobs.py)."""
    responses, finish, raw, temps, sums = [], [], [], [], []
    for row, out in enumerate(outputs):
        tag = first_tag + row
        c = out.outputs[0]
        tokens = list(c.token_ids)
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with reason {c.finish_reason!r}")
        missing = [i for i in range(len(tokens)) if (tag, i) not in lse]
        if missing:
            raise RuntimeError(f"VllmEngine: no logsumexp recorded for request {row} at positions {missing[:8]}; "
                               "the full-vocabulary log-prob bookkeeping lost track of a request")
        responses.append(tokens)
        finish.append(c.finish_reason)
        raw += [c.logprobs[i][t].logprob for i, t in enumerate(tokens)]  # raw logits (logprobs_mode)
        temps += [temperatures[row]] * len(tokens)
        sums += [lse[(tag, i)] for i in range(len(tokens))]
    flat, logprobs, start = fvl.sampled_logprobs(raw, temps, sums), [], 0
    for tokens in responses:
        logprobs.append(flat[start:start + len(tokens)])
        start += len(tokens)
    return build_rollouts(prompts, responses, logprobs, finish, weight_version, pad_token_id)
