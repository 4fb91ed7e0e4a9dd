"""Partial rollouts through the real engine: requests in flight when the trainer publishes
an update pause, then continue under the new weights — every token carries the version
that sampled it, and its engine log-prob is that version's (checked against Hugging Face
transformers with each version's weights, teacher-forced on the sampled sequence)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import torch
import transformers

from hybridrl.pipeline.coordinator import Pipeline
from hybridrl.pipeline.producers import LocalProducer
from hybridrl.pipeline.source import SourceSettings
from hybridrl.pipeline.tasks import SingleTurnGroups
from hybridrl.pipeline.work import WorkRunner
from hybridrl.rewards import RewardBatch
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.trainer.prompts import PromptSet
from hybridrl.trainer.rollout_worker import RolloutWorker
from hybridrl.trainer.weight_sync import WeightSyncSpec


def _model(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[start - 1:, 0]


def test_requests_in_flight_continue_under_each_new_version() -> None:
    rng = random.Random(random.randrange(2**31))
    models = {v: _model(rng.randrange(1000)) for v in (3, 4, 5)}  # the policy's weights at versions 3, 4, 5
    P, n, L = 2, 2, 24
    prompts = [[rng.randrange(1, 32) for _ in range(rng.randint(3, 6))] for _ in range(20)]
    train_set = PromptSet(prompts, [None] * 20, [""] * 20)
    sampling = SamplingParams(n=n, max_tokens=L, temperature=1.0)  # no stop token: every answer is L long

    def worker(engine):
        return RolloutWorker(engine, sampling, device=torch.device("cpu"),
                             sync=WeightSyncSpec(bucket_bytes=1 << 20, verify=True))

    def make(i, sink, wake):
        engine = RolloutEngine(models[3].config, EngineSpec(max_batch_size=16, max_seq_len=32), kv_on_refit="recompute")
        runner = WorkRunner(engine, step_latency_s=0.02)  # >= 0.48 s per answer
        return LocalProducer(i, worker(engine), runner, sink, wake)

    def draw(r):
        rows = r.sample(range(20), P)
        return rows, [r.randrange(2**62) for _ in rows]

    scorer = SimpleNamespace(score=lambda resp, ans, txt: RewardBatch(scores=[0.0] * len(resp)))
    trainer_engine = RolloutEngine(models[3].config, EngineSpec(max_batch_size=2, max_seq_len=32))
    pipe = Pipeline(settings=SourceSettings(overlapped=True, groups_per_step=P, max_staleness=1, partial=True,
                                            workers=1, timeout_s=60, restarts=0),
                    groups=SingleTurnGroups(train_set, scorer, sampling, pad_id=0), local=worker(trainer_engine),
                    make_producer=make, weights=lambda model: model, device=torch.device("cpu"),
                    console=lambda line: None)
    for _ in range(3):  # the source decides the versions: models[3] is the third publication
        pipe.publish(models[3])
    pipe.start(models[3], draw=draw, rng=random.Random(rng.random()), first_step=1)
    try:
        pipe.take(models[3])  # step 1 (steps 1 and 2 were generated together, under version 3)
        pipe.publish(models[4])  # admits step 3: it starts under version 4
        pipe.take(models[4])  # step 2
        time.sleep(0.2)  # training step 2: step 3's answers are ~10 tokens in
        pipe.publish(models[5])  # version 5 reaches them mid-way
        batch = pipe.take(models[5])
    finally:
        pipe.close()
    ro = batch.step_batch.rollouts
    mixed = 0
    for row in range(ro.input_ids.shape[0]):
        mask = ro.response_mask[row].bool()
        versions = ro.token_versions[row][mask].tolist()
        assert versions == sorted(versions) and set(versions) <= {4, 5}
        mixed += len(set(versions)) == 2
        ids = ro.input_ids[row][ro.attention_mask[row].bool()].tolist()
        start = int(ro.prompt_lengths[row])
        engine_lp = ro.logprobs[row][mask]
        for version, model in models.items():
            at = torch.tensor(versions) == version
            if at.any():
                ref = _logprobs(model, ids, start)
                torch.testing.assert_close(engine_lp[at], ref[at], atol=1e-4, rtol=1e-4)
    assert mixed > 0, "no answer spanned the refit: the test did not exercise partial rollouts"
    assert batch.metrics["async/staleness_max"] == 1 and batch.stale
