"""Qwen2.5-VL and Qwen3-VL: a vision tower (transformers' own module, full precision) in
front of our decoder (mRoPE, Qwen3-VL's deepstack). Config: ``config.py``; the tower:
``vision_tower.py``; per-request image layout and a batch's visual inputs: ``inputs.py``;
the model: ``model.py``."""
