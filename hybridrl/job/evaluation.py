"""Held-out evaluation: greedy accuracy, pass@k and maj@k with the run's reward.

- greedy accuracy: share of prompts whose greedy response scores > 0.5;
- pass@k: share of prompts with at least one of k sampled responses scoring > 0.5 (with
  exactly k samples per prompt the unbiased estimator of Chen et al. 2021 reduces to this);
- maj@k: share of prompts whose most frequent sampled answer (the stripped response text;
  ties go to the earliest) scores > 0.5 — self-consistency (Wang et al. 2022).

An agent run (``env.name``) is evaluated on *episodes* (:func:`evaluate_episodes`): greedy
episodes on the held-out rows, each final answer scored by the run's reward (an episode
with no final answer — truncated, failed — is unsolved), plus the episodes' ``agent/*``
metrics under ``eval/``; pass@k / maj@k from ``k`` sampled episodes per row, the vote
over final answers.

Sampling uses seeds drawn from ``seed``: an eval never consumes the training RNG streams,
so turning pass@k on does not change what training samples.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.trainer.prompts import PromptSet
from hybridrl.trainer.rollout_worker import RolloutWorker
from hybridrl.trainer.scoring import RewardScorer

CORRECT = 0.5  # a score above this counts as solved


@dataclass
class EvalResult:
    accuracy: float  # greedy
    pass_at_k: float | None = None
    maj_at_k: float | None = None
    k: int = 0
    samples: list[dict] = field(default_factory=list)  # one record per prompt (for a jsonl file)
    reward_calls: int = 0
    reward_failures: int = 0  # calls that failed (scored failure_reward)
    extra: dict[str, float] = field(default_factory=dict)  # more eval/* metrics (an agent's episode metrics)

    @property
    def reward_failure_rate(self) -> float:
        return self.reward_failures / max(self.reward_calls, 1)

    def metrics(self) -> dict[str, float]:
        out = {"eval/accuracy": self.accuracy, "eval/reward_failure_rate": self.reward_failure_rate}
        if self.k:
            out[f"eval/pass@{self.k}"] = self.pass_at_k
            out[f"eval/maj@{self.k}"] = self.maj_at_k
        out.update(self.extra)
        return out


def evaluate_prompts(rollout: RolloutWorker, scorer: RewardScorer, prompts: PromptSet, *, k: int = 0,
                     temperature: float = 1.0, seed: int = 0, keep_samples: bool = False) -> EvalResult:
    """Greedy accuracy, and with ``k > 0`` pass@k / maj@k from ``k`` samples per prompt."""
    if not len(prompts):
        return EvalResult(accuracy=float("nan"))
    greedy = rollout.greedy(prompts.prompts, prompts.images)
    g_texts = scorer.tokenizer.batch_decode(greedy.response_token_ids, skip_special_tokens=True)
    g_batch = scorer.runner.score(g_texts, prompts.answers, prompts.prompt_texts)
    g_scores = g_batch.scores
    result = EvalResult(accuracy=sum(s > CORRECT for s in g_scores) / len(g_scores), k=k,
                        reward_calls=len(g_scores), reward_failures=sum(g_batch.failures.values()))
    texts: list[list[str]] = [[] for _ in range(len(prompts))]
    scores: list[list[float]] = [[] for _ in range(len(prompts))]
    if k > 0:
        rng = random.Random(seed)
        import dataclasses

        sampling = rollout.sampling
        params = [dataclasses.replace(sampling, n=k, temperature=temperature, seed=rng.randrange(2**62))
                  for _ in prompts.prompts]
        vision = {"images": prompts.images} if any(i is not None for i in prompts.images) else {}
        ro = rollout.engine.generate(prompts.prompts, params, **vision)
        flat = scorer.tokenizer.batch_decode(ro.response_token_ids, skip_special_tokens=True)
        rows = [i for i in range(len(prompts)) for _ in range(k)]
        flat_batch = scorer.runner.score(flat, [prompts.answers[i] for i in rows],
                                         [prompts.prompt_texts[i] for i in rows])
        flat_scores = flat_batch.scores
        result.reward_calls += len(flat_scores)
        result.reward_failures += sum(flat_batch.failures.values())
        for i, t, s in zip(rows, flat, flat_scores):
            texts[i].append(t)
            scores[i].append(s)
        result.pass_at_k = sum(any(s > CORRECT for s in row) for row in scores) / len(prompts)
        result.maj_at_k = sum(_majority_correct(t, s) for t, s in zip(texts, scores)) / len(prompts)
    if keep_samples:
        result.samples = [{"prompt": prompts.prompt_texts[i], "answer": prompts.answers[i],
                           "greedy": g_texts[i], "greedy_score": g_scores[i],
                           **({"samples": texts[i], "scores": scores[i]} if k else {})}
                          for i in range(len(prompts))]
    return result


def evaluate_episodes(runner, scorer: RewardScorer, prompts: PromptSet, *, k: int = 0, temperature: float = 1.0,
                      seed: int = 0, keep_samples: bool = False) -> EvalResult:
    """:func:`evaluate_prompts` for an agent: ``runner`` is the run's ``EpisodeRunner``
    (its engine, environments, renderer and limits); greedy episodes give the accuracy."""
    import dataclasses

    from hybridrl.agents.episodes import EpisodeRunner
    from hybridrl.agents.trajectory import episode_metrics

    if not len(prompts):
        return EvalResult(accuracy=float("nan"))
    rows = [{"prompt": p, "answer": a} for p, a in zip(prompts.prompt_texts, prompts.answers)]
    rng = random.Random(seed)

    def episodes(temp: float, n: int):
        """(final answers, scores) per row, ``n`` episodes each, and the episodes."""
        r = EpisodeRunner(runner.engine, runner.env_pool, runner.renderer, runner.tokenizer,
                          dataclasses.replace(runner.sampling, temperature=temp), runner.limits)
        trajs = r.run(rows, n, [rng.randrange(2**62) for _ in rows])
        answered = [t for t in trajs if t.final_answer is not None]
        batch = scorer.runner.score([t.final_answer for t in answered], [rows[t.row]["answer"] for t in answered],
                                    [rows[t.row]["prompt"] for t in answered])
        score = {id(t): s for t, s in zip(answered, batch.scores)}
        texts = [[] for _ in rows]
        scores = [[] for _ in rows]
        for t in trajs:
            texts[t.row].append(t.final_answer if t.final_answer is not None else "")
            scores[t.row].append(score.get(id(t), 0.0))  # no final answer: unsolved
        return texts, scores, trajs, batch

    g_texts, g_scores, g_trajs, g_batch = episodes(0.0, 1)
    result = EvalResult(accuracy=sum(s[0] > CORRECT for s in g_scores) / len(rows), k=k,
                        reward_calls=len(g_batch.scores), reward_failures=sum(g_batch.failures.values()))
    result.extra = {f"eval/{key}": v for key, v in episode_metrics(g_trajs).items() if key != "agent/env_seconds"}
    texts: list[list[str]] = [[] for _ in rows]
    scores: list[list[float]] = [[] for _ in rows]
    if k > 0:
        texts, scores, _, batch = episodes(temperature, k)
        result.reward_calls += len(batch.scores)
        result.reward_failures += sum(batch.failures.values())
        result.pass_at_k = sum(any(s > CORRECT for s in row) for row in scores) / len(rows)
        result.maj_at_k = sum(_majority_correct(t, s) for t, s in zip(texts, scores)) / len(rows)
    if keep_samples:
        result.samples = [{"prompt": rows[i]["prompt"], "answer": rows[i]["answer"], "greedy": g_texts[i][0],
                           "greedy_score": g_scores[i][0], **({"samples": texts[i], "scores": scores[i]} if k else {})}
                          for i in range(len(rows))]
    return result


def _majority_correct(texts: list[str], scores: list[float]) -> bool:
    votes = Counter(t.strip() for t in texts)
    top = max(votes.values())
    winner = next(t for t in texts if votes[t.strip()] == top)  # earliest of the most frequent
    return scores[texts.index(winner)] > CORRECT


def write_samples(path: Path, result: EvalResult) -> None:
    """One JSON line per prompt (prompt, answer, greedy response and score, samples)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in result.samples))
    tmp.replace(path)
