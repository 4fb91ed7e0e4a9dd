"""The tiny model and data overrides shared by the end-to-end trainer tests (seconds per run)."""

TINY_MODEL = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.intermediate_size=64",
    "rollout.n=4", "rollout.max_tokens=4", "batch.prompts_per_step=4", "warm_start.batch_size=8",
    "logging.progress=false",
]
