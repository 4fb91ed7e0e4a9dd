"""A reward model as a reward: ``{name: reward_model, path: DIR, weight: 1.0, normalize: running}``.

``path`` is a local ``*ForSequenceClassification`` checkpoint with one label (the shape of
Skywork-Reward); the score of a sample is that label's logit for the conversation
``[user: prompt, assistant: response]``, rendered with the reward model's own tokenizer and
chat template (``sequence_scorer.py``). It is a batched reward: one call scores a whole
batch in token-budgeted micro-batches.

Placement decides trust, per instance: ``colocated`` (default) runs inline in the trainer
process (trusted: no process hop, the model loaded once when the runner starts);
``worker`` runs in the reward runner's worker pool, isolated, under ``reward.timeout_s``
per batch (a pool of one worker for a batched reward, which loads the model itself: the
reward pickles by its options).

``normalize``: ``none`` (the raw logit); ``group`` (within one call, ``(s - mean) / (std +
eps)``; the runner calls once per group of samples of a prompt); ``running`` (against the
mean and std of every score seen so far, this call's included, updated with Welford's
algorithm; ``state_dict()`` / ``load_state_dict()`` carry it across a resume). Std is the
population std. With ``placement: worker`` the running statistics live in the worker.

``offload`` (CUDA only; nothing to move on CPU): the model waits on the CPU between calls
and the CUDA cache is emptied, so its memory is free while the policy trains; each call
copies it to the device and back.
"""

from __future__ import annotations

import math
from typing import Any

from hybridrl.rewards.registry import register_reward_factory
from hybridrl.rewards.sequence_scorer import DTYPE_NAMES, check_checkpoint, load_scorer, render, score_rows

NORMALIZE = ("none", "running", "group")
PLACEMENTS = ("colocated", "worker")
EPS = 1e-6  # added to the std: a group whose scores are all equal normalizes to zeros


class RunningMoments:
    """Count, mean and sum of squared deviations of every score seen (Welford, 1962)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        for x in values:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


def standardize(values: list[float], mean: float, std: float) -> list[float]:
    return [(x - mean) / (std + EPS) for x in values]


class RewardModel:
    """``fn(responses, answers, prompts) -> scores`` from a sequence-classification checkpoint."""

    hybridrl_batched = True
    hybridrl_label = "reward_model"

    def __init__(self, *, path: str, dtype: str = "float32", device: str = "cpu",
                 max_tokens_per_microbatch: int = 8192, normalize: str = "none", placement: str = "colocated",
                 offload: bool = False, padding_side: str = "right"):
        self.path = check_checkpoint(path)
        _check_choice("dtype", dtype, DTYPE_NAMES)
        _check_choice("normalize", normalize, NORMALIZE)
        _check_choice("placement", placement, PLACEMENTS)
        _check_choice("padding_side", padding_side, ("left", "right"))  # not a config option: no score depends on it
        if isinstance(max_tokens_per_microbatch, bool) or not isinstance(max_tokens_per_microbatch, int) \
                or max_tokens_per_microbatch < 1:
            raise ValueError(f"reward_model: max_tokens_per_microbatch={max_tokens_per_microbatch!r} must be an "
                             f"integer >= 1 (padded tokens per forward)")
        if not isinstance(offload, bool):
            raise ValueError(f"reward_model: offload={offload!r} must be true or false")
        _check_device(device)
        self.options = dict(path=self.path, dtype=dtype, device=device, normalize=normalize, placement=placement,
                            max_tokens_per_microbatch=max_tokens_per_microbatch, offload=offload,
                            padding_side=padding_side)
        self.device, self.normalize, self.max_tokens = device, normalize, max_tokens_per_microbatch
        self.offload = offload and device != "cpu"
        self.hybridrl_trusted = placement == "colocated"  # per instance: the runner reads it
        self.moments = RunningMoments()
        self._scorer = None

    def hybridrl_warmup(self) -> None:
        """Load the model (the runner calls this once: inline, or in each worker)."""
        if self._scorer is None:
            o = self.options
            self._scorer = load_scorer(self.path, o["dtype"], "cpu" if self.offload else self.device, o["padding_side"])

    def __call__(self, responses: list[str], answers: list, prompts: list[str]) -> list[float]:
        self.hybridrl_warmup()
        scorer = self._scorer
        rows = [render(scorer.tokenizer, p, r) for p, r in zip(prompts, responses)]
        unique = {tuple(r): None for r in rows}  # a group often repeats a response: score it once
        if self.offload:
            scorer.model.to(self.device)
        try:
            values = score_rows(scorer, [list(r) for r in unique], self.max_tokens, self.device)
        finally:
            if self.offload:
                _release(scorer.model)
        by_row = dict(zip(unique, values))
        return self._normalized([by_row[tuple(r)] for r in rows])

    def _normalized(self, scores: list[float]) -> list[float]:
        if self.normalize == "group" and scores:
            mean = math.fsum(scores) / len(scores)
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in scores) / len(scores))
            return standardize(scores, mean, std)
        if self.normalize == "running":
            self.moments.update(scores)
            return standardize(scores, self.moments.mean, self.moments.std)
        return scores

    def state_dict(self) -> dict[str, float]:
        """The running statistics (``normalize: running``), to save with a checkpoint."""
        return {"count": self.moments.count, "mean": self.moments.mean, "m2": self.moments.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.moments.count, self.moments.mean, self.moments.m2 = int(state["count"]), state["mean"], state["m2"]

    def __reduce__(self):  # to a worker: its options (the worker loads the model itself)
        return _rebuild, (self.options,)

    def __repr__(self) -> str:
        return f"RewardModel({self.path!r}, placement={self.options['placement']!r})"


def _rebuild(options: dict[str, Any]) -> RewardModel:
    return RewardModel(**options)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"reward_model: {key}={value!r} is not one of {', '.join(choices)}; pick one")


def _check_device(device: Any) -> None:
    if not isinstance(device, str) or not (device == "cpu" or device.split(":")[0] == "cuda"):
        raise ValueError(f"reward_model: device={device!r}; use cpu, cuda or cuda:N")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"reward_model: device={device!r} but CUDA is not available here; use device: cpu")


def _release(model) -> None:
    import torch

    model.to("cpu")
    torch.cuda.empty_cache()  # the cached blocks go back to the device, for the policy (or another process)


@register_reward_factory("reward_model")
def reward_model(path: str = "", dtype: str = "float32", device: str = "cpu", max_tokens_per_microbatch: int = 8192,
                 normalize: str = "none", placement: str = "colocated", offload: bool = False) -> RewardModel:
    """The ``reward_model`` reward: scores from the sequence classifier saved at ``path``."""
    return RewardModel(path=path, dtype=dtype, device=device, max_tokens_per_microbatch=max_tokens_per_microbatch,
                       normalize=normalize, placement=placement, offload=offload)
