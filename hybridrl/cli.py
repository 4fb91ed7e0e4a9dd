"""``hybridrl`` command line: train, config, generate."""

from __future__ import annotations

import argparse
import os
import sys


def _train(args: argparse.Namespace) -> int:
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    from hybridrl.checkpoint.atomic import CheckpointWriteError
    from hybridrl.job.interrupt import TrainingInterrupted

    from hybridrl.distributed.context import launched_distributed

    cfg = load_config(args.config, args.overrides)
    t = cfg.trainer
    try:
        if cfg.launcher.name == "ray" and not launched_distributed():
            from hybridrl.launch.ray_cluster import launch_ray

            launch_ray(cfg)
        elif cfg.launcher.nproc_per_node > 1 and not launched_distributed():
            from hybridrl.launch.elastic import launch_local

            launch_local(cfg, nproc=cfg.launcher.nproc_per_node)
        else:
            train(cfg)
    except TrainingInterrupted as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        return e.exit_code
    except CheckpointWriteError as e:
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return 1
    return 0


def _config(args: argparse.Namespace) -> int:
    from hybridrl.config.io import config_to_yaml, load_config

    print(config_to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from hybridrl.rollout import RolloutEngine, SamplingParams
    from hybridrl.trainer.pretrained import check_checkpoint, checkpoint_errors, load_tokenizer

    check_checkpoint(args.model, "--model")
    tok = load_tokenizer(args.model, "--model")
    ids = [tok.encode(p, add_special_tokens=True) for p in args.prompts]
    with checkpoint_errors(args.model, "--model", "cannot load the model"):
        engine = RolloutEngine.from_pretrained(args.model, max_batch_size=max(1, len(ids)),
                                               max_seq_len=max(map(len, ids)) + args.max_tokens, dtype=torch.float32)
    stop = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    out = engine.generate(ids, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                              stop_token_ids=stop, seed=args.seed))
    for prompt, resp in zip(args.prompts, out.response_token_ids):
        print(f"{prompt}{tok.decode(resp, skip_special_tokens=True)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridrl.config.io import load_config
    from hybridrl.job.eval_job import evaluate_checkpoint

    cfg = load_config(args.config, args.overrides)
    if args.k is not None:
        cfg.eval.k = args.k
    out = Path(args.out) if args.out else None
    result = evaluate_checkpoint(cfg, args.model, out)
    line = f"greedy accuracy {result.accuracy:.3f}"
    if result.k:
        line += f"  pass@{result.k} {result.pass_at_k:.3f}  maj@{result.k} {result.maj_at_k:.3f}"
    print(line + (f"  (samples: {out})" if out else ""))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hybridrl.config.io import load_config
    from hybridrl.distributed.plan import EngineLoad, plan_memory, shape_config
    from hybridrl.job.model_factory import DTYPES

    cfg = load_config(args.config, args.overrides)
    t, r = cfg.trainer, cfg.rollout
    if args.shape:
        hf_config = shape_config(args.shape)
    elif cfg.model.path:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"model.path={cfg.model.path}: no readable config.json ({type(e).__name__}); "
                             "point it at a local Hugging Face checkpoint directory") from None
    else:
        from hybridrl.job.model_factory import builtin_model, builtin_tokenizer

        m = cfg.model
        hf_config = builtin_model(builtin_tokenizer(), m).config
    world = cfg.launcher.nnodes * cfg.launcher.ranks
    dtype = DTYPES[cfg.model.dtype]
    engine = EngineLoad(dtype=dtype, quantization=r.quantization,
                        batch=min(cfg.batch.prompts_per_step * r.n // world or 1, 256),
                        seq_len=cfg.data.max_prompt_length + r.max_tokens, tensor_parallel_size=r.tensor_parallel_size)
    plan = plan_memory(hf_config, world_size=world, trainer_dtype=dtype, bucket_bytes=cfg.refit.bucket_mb << 20,
                       engine=engine)
    if r.kv_cache_mb:  # the engine runs only the rows whose KV cache fits the budget
        import dataclasses

        from hybridrl.distributed.plan import kv_cache_bytes

        row = kv_cache_bytes(hf_config, batch=1, seq_len=cfg.data.max_prompt_length + r.max_tokens, dtype=dtype,
                             tensor_parallel_size=r.tensor_parallel_size)
        plan = dataclasses.replace(plan, kv_cache=min(plan.kv_cache, (r.kv_cache_mb << 20) // row * row))
    print(plan.table(args.device_gib))
    return 0


def _export(args) -> int:
    from hybridrl.lora.export import export_lora

    out = export_lora(args.checkpoint, args.out, merged=args.merged)
    parts = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported {args.checkpoint} -> {out} ({parts})")
    return 0


def _doctor(args) -> int:
    from hybridrl.config.io import load_config
    from hybridrl.doctor.run import doctor_mismatch

    cfg = load_config(args.config, args.overrides)
    _, out = doctor_mismatch(cfg, args.out, seed=args.seed, engine_temperature=args.engine_temperature,
                             warm_start=not args.no_warm_start)
    print(f"\nwrote {out}/mismatch.json, mismatch.png, mismatch.txt")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hybridrl.config.io import help_text

    p = argparse.ArgumentParser(prog="hybridrl", description="RL post-training of language models on a hybrid engine.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (("train", _train, "run RL training (default: the built-in arithmetic task)"),
                               ("config", _config, "print the resolved configuration as YAML")):
        _config_command(sub, name, fn, "trainer.total_steps=200 algo.kl.coef=0", help=helptext,
                        epilog="overrides: group.key=value, groups and keys:\n" + help_text())
    ev = _config_command(sub, "eval", _eval, "data.val_files=[val.jsonl]",
                         help="greedy accuracy, pass@k and maj@k of a local checkpoint on held-out prompts",
                         epilog="e.g. hybridrl eval --model runs/default/checkpoint data.val_files=[val.jsonl] "
                                "reward.functions=gsm8k --k 8 --out samples.jsonl")
    ev.add_argument("--model", required=True, help="local HF checkpoint directory")
    ev.add_argument("--k", type=int, default=None, help="samples per prompt for pass@k / maj@k (eval.k)")
    ev.add_argument("--out", help="write one JSON line per prompt (greedy and sampled responses, scores)")
    pl = _config_command(sub, "plan", _plan, "launcher.nproc_per_node=8",
                         help="per-device memory of a (data-parallel) job, from the real sharding code",
                         epilog="e.g. hybridrl plan --shape qwen2.5-7b launcher.nnodes=8 launcher.nproc_per_node=8 "
                                "model.dtype=bfloat16 --device-gib 80")
    pl.add_argument("--shape", help="a built-in model shape instead of model.path: qwen2.5-0.5b | qwen2.5-7b | qwen2.5-32b")
    pl.add_argument("--device-gib", type=float, default=None, help="device memory to check the plan against")
    ex = sub.add_parser("export", help="a LoRA run's checkpoint as a peft adapter folder (+ its base, + merged)",
                        epilog="e.g. hybridrl export runs/default/checkpoint exported --merged")
    ex.add_argument("checkpoint", help="a LoRA run's checkpoint directory (runs/NAME/checkpoint)")
    ex.add_argument("out", help="output directory (created; must not exist)")
    ex.add_argument("--merged", action="store_true", help="also write OUT/merged: the adapter merged into the base")
    ex.set_defaults(fn=_export)
    doc = sub.add_parser("doctor", help="diagnose a job: `doctor mismatch` measures the rollout/trainer log-prob "
                                        "gap and how much each cause explains")
    dsub = doc.add_subparsers(dest="what", required=True)
    mm = _config_command(dsub, "mismatch", _doctor, "rollout.quantization=fp8",
                         help="the rollout/trainer gap of one batch, by cause; table, JSON and plot",
                         epilog="e.g. hybridrl doctor mismatch rollout.quantization=fp8 --out fp8-doctor")
    mm.add_argument("--out", help="output folder (new; default: trainer.output_dir/RUN_NAME-doctor)")
    mm.add_argument("--seed", type=int, default=0, help="which batch of prompts to draw")
    mm.add_argument("--engine-temperature", type=float, default=None,
                    help="sample at this temperature instead of rollout.temperature (inject a mismatch)")
    mm.add_argument("--no-warm-start", action="store_true", help="diagnose the model as built, before its warm start")
    g = sub.add_parser("generate", help="sample from a local HF checkpoint with the built-in engine")
    g.add_argument("--model", required=True, help="local HF checkpoint directory")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("prompts", nargs="+")
    g.set_defaults(fn=_generate)
    return p


def _config_command(sub, name: str, fn, example: str, **parser_kw) -> argparse.ArgumentParser:
    """A subcommand that reads a config: ``--config FILE`` and the dotted overrides (``example``
    shows one), its epilog printed as written, ``fn`` run on the parsed arguments."""
    parser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **parser_kw)
    parser.add_argument("--config", help="YAML file with groups of keys")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")
    parser.set_defaults(fn=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # user mistakes: one line, no traceback (HYBRIDRL_DEBUG=1 shows it)
        if os.environ.get("HYBRIDRL_DEBUG"):
            raise
        message = " ".join(str(e).split())  # one line even when a library's message has several
        print(f"hybridrl: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
