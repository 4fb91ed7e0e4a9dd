"""Qwen2/Qwen3-MoE and DeepSeekMoE blocks: routers, top-k selection and the routing tap
(``block.py``); the fused experts they call are a shared layer (``layers/fused_moe.py``)."""
