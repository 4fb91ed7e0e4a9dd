"""Llama / Qwen2 / Qwen3 dense decoders (and the decoder the MoE and DeepSeek-V3 families
compose into): ``model.py``."""
