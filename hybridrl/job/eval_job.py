"""``hybridrl eval --model DIR``: evaluate a local checkpoint on held-out prompts with the
configured reward (greedy accuracy, pass@k, maj@k) and write the samples as jsonl."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hybridrl.config import Config
from hybridrl.job.evaluation import EvalResult, evaluate_prompts, write_samples


def evaluate_checkpoint(cfg: Config, model_dir: str, out: Path | None, console=print) -> EvalResult:
    import torch

    from hybridrl.rewards import RewardRunner
    from hybridrl.rollout import RolloutEngine
    from hybridrl.job.build import prompt_set_from_files
    from hybridrl.job.model_factory import DTYPES
    from hybridrl.trainer.pretrained import check_checkpoint, load_tokenizer
    from hybridrl.trainer.weight_sync import WeightSyncSpec
    from hybridrl.trainer.rollout_worker import RolloutWorker, sampling_params
    from hybridrl.trainer.scoring import RewardScorer

    files = cfg.data.val_files or cfg.data.train_files
    if not files:
        raise ValueError("hybridrl eval: give the prompts with data.val_files=[file.jsonl] (jsonl, parquet or a "
                         "datasets directory)")
    check_checkpoint(model_dir, "--model")
    tokenizer = load_tokenizer(model_dir, "--model")
    from transformers import AutoConfig

    from hybridrl.pipeline.engines import vision_ids, vl_prompt_renderer

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_dir))  # its image processor
    prompts = prompt_set_from_files(list(files), tokenizer, cfg.data, console,
                                    vl_prompt_renderer(cfg, tokenizer, hf_config))
    if not len(prompts):
        raise ValueError(f"data files {files}: no usable prompts (see the skip counts above)")
    r = cfg.rollout
    longest = max(len(p) for p in prompts.prompts)
    engine = RolloutEngine.from_pretrained(model_dir, max_batch_size=min(256, max(1, len(prompts)) * max(1, cfg.eval.k)),
                                           max_seq_len=longest + r.max_tokens, dtype=DTYPES[cfg.model.dtype],
                                           device=cfg.trainer.device)
    worker = RolloutWorker(engine, sampling_params(r, tokenizer.eos_token_id, vision_ids(hf_config)),
                           device=torch.device(cfg.trainer.device),
                           sync=WeightSyncSpec(bucket_bytes=1 << 26, verify=False))
    runner = RewardRunner.from_config(cfg.reward)
    try:
        result = evaluate_prompts(worker, RewardScorer(runner, tokenizer), prompts, k=cfg.eval.k,
                                  temperature=cfg.eval.temperature, seed=cfg.eval.seed, keep_samples=out is not None)
    finally:
        runner.close()
    if out is not None:
        write_samples(out, result)
    return result
