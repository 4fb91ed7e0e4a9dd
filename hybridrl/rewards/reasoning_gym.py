"""The ``reasoning_gym`` reward: reasoning-gym's own verifier for its generated prompts.

The ground truth is a :class:`~hybridrl.data.reasoning_gym.ReasoningGymAnswer` (dataset
name, generator settings, entry). The model's answer is what reasoning-gym's training
recipes read: the last ``<answer>...</answer>`` (its ``extract_answer``); when the prompt
did not ask for the tags, a response without them is taken whole (stripped). The score is
``score_answer(answer, entry)`` of that dataset built with the same settings (some
verifiers read their config), usually in [0, 1].

Not trusted: a verifier parses model output (sympy, regexes), so it runs in the reward
worker processes with the runner's timeout; one that raises costs that sample only.
reasoning-gym is imported at the first call, inside the worker.
"""

from __future__ import annotations

from typing import Any

from hybridrl.rewards.registry import register_reward

_VERIFIERS: dict[tuple[str, str], Any] = {}  # (dataset, settings) -> dataset object, per process


@register_reward("reasoning_gym")
def reasoning_gym_reward(response: str, answer: Any, prompt: str = "") -> float:
    """``score_answer`` of the answer's dataset on the response's final answer."""
    from hybridrl.data.reasoning_gym import ReasoningGymAnswer, import_reasoning_gym

    if not isinstance(answer, ReasoningGymAnswer):
        raise TypeError(f"the reasoning_gym reward needs data.task=reasoning_gym:<dataset> prompts, got a "
                        f"{type(answer).__name__} ground truth; pick another reward.functions")
    import_reasoning_gym()
    from reasoning_gym.utils import extract_answer

    found = extract_answer(response)
    if found is None and not answer.tagged:
        found = response.strip()
    return float(_verifier(answer.dataset, answer.settings).score_answer(found, answer.entry))


def _verifier(name: str, settings: dict[str, Any]):
    key = (name, repr(sorted(settings.items())))
    if key not in _VERIFIERS:
        import reasoning_gym

        _VERIFIERS[key] = reasoning_gym.create_dataset(name, seed=0, size=1, **settings)
    return _VERIFIERS[key]
