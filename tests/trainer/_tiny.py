"""The tiny model and data overrides shared by the end-to-end trainer tests (seconds per run)."""

TINY_MODEL = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.intermediate_size=64",
    "rollout.n=4", "rollout.max_tokens=4", "batch.prompts_per_step=4", "warm_start.batch_size=8",
    "logging.progress=false",
]


def sampled_batch(step, seed: int, *, random_advantages: bool = False):
    """One step's batch through the step's own phases (the source's batch: sampled and
    scored; reward shaping, log-probs, advantages, corrections), its prompts drawn from
    ``seed`` (the source starts at step 1 on ``random.Random(seed)``). ``random_advantages``:
    a fresh random advantage per row over its response instead — a tiny policy often scores
    all-zero (no gradient), and an update test does not care where the advantages come from."""
    import random

    import torch

    step.start(random.Random(seed), 1)
    batch = step.source.take(step.actor.model)
    sb = batch.step_batch
    step.shape_rewards(sb)
    step.log_probs(sb)
    step.advantages(sb)
    step.corrections(sb, stale=batch.stale)
    if random_advantages:
        mask = sb.loss_mask
        sb.tensors["advantages"] = torch.randn(mask.shape[0], 1, dtype=torch.float64).float() * mask
    return sb
