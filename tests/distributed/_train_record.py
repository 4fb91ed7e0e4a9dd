"""What a training run fed its actor's AdamW, recorded for the "N ranks == 1 process" tests
(``_same_training`` compares two records).

Per optimizer step: the gradients AdamW received (after clipping; FSDP2 shards gathered into
full tensors), the learning rate, the weights after the step and which update (RL step) it
belonged to; per update: the rows trained on (prompt + sampled tokens, sorted); once: the
weights before the first step, AdamW's betas / eps / weight decay and the clipping norm.
Each rank writes ``<dir>/rank<r>.pt`` after every update (its own share of the rows; the
tensors are whole on every rank), so nothing depends on how the process ends.

Test-only instrumentation: :func:`install` wraps ``Actor.reset_optimizer`` (hooks on the
actor's AdamW only: not the warm start's, not the critic's) and ``Actor.update`` (the rows). A
launched run gets it through :func:`main`, which has the elastic launcher start
:func:`rank_main` instead of hybridrl's own (spawned ranks import this module from the
parent's ``sys.path``).
"""

from __future__ import annotations

import os

import torch

RECORD_DIR_ENV = "HYBRIDRL_TEST_RECORD_DIR"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A full float32 copy (a DTensor shard: gathered — a collective every rank makes);
    None stays None (a parameter without a gradient, which AdamW leaves alone)."""
    if t is None:
        return None
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().float().clone()


def install(out_dir: str, setattr=setattr) -> None:  # noqa: A002 - pytest's monkeypatch.setattr fits here
    from hybridrl.trainer.actor import Actor

    record: dict = {"steps": [], "rows": []}
    reset, update = Actor.reset_optimizer, Actor.update

    def named(actor):
        return [(n, p) for n, p in actor.model.named_parameters() if p.requires_grad]

    def reset_optimizer(actor):
        reset(actor)
        opt = actor.optimizer
        assert len(opt.param_groups) == 1, "the recorded lr / betas are those of AdamW's one parameter group"

        def before(optimizer, args, kwargs):  # on every rank: the gathers are collectives
            group = optimizer.param_groups[0]
            if not record["steps"]:
                record.update(weights_before={n: _full(p) for n, p in named(actor)}, betas=tuple(group["betas"]),
                              eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                              grad_clip=float(actor.grad_clip))
            record["steps"].append({"update": len(record["rows"]) - 1, "lr": float(group["lr"]),
                                    "grads": {n: _full(p.grad) for n, p in named(actor)}})

        def after(optimizer, args, kwargs):
            record["steps"][-1]["weights"] = {n: _full(p) for n, p in named(actor)}

        opt.register_step_pre_hook(before)
        opt.register_step_post_hook(after)

    def update_recording_rows(actor, batch, **kwargs):
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        record["rows"].append(sorted(tuple(r[m].tolist()) for r, m in zip(ids, mask)))
        out = update(actor, batch, **kwargs)
        os.makedirs(out_dir, exist_ok=True)
        torch.save(record, os.path.join(out_dir, f"rank{_rank()}.pt"))
        return out

    setattr(Actor, "reset_optimizer", reset_optimizer)
    setattr(Actor, "update", update_recording_rows)


def rank_main(config_yaml: str, error_dir: str) -> None:
    """A launched rank: the recorder, then hybridrl's own rank entry point."""
    from hybridrl.launch import elastic

    install(os.environ[RECORD_DIR_ENV])
    elastic.rank_main(config_yaml, error_dir)


def main(out_dir: str, argv: list[str]) -> int:
    """``hybridrl <argv>`` with every rank (or this process, unlaunched) recording into ``out_dir``."""
    from hybridrl.cli import main as cli_main
    from hybridrl.launch import elastic

    os.environ[RECORD_DIR_ENV] = out_dir
    install(out_dir)
    elastic.rank_main = rank_main  # launch_local starts whatever this name holds when it launches
    return cli_main(argv)
