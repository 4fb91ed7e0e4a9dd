"""The built-in visual task's data (``data.task=shapes``): prompt sets whose prompts are a
picture and a question rendered by the policy's own prompt renderer (chat template, image
processor, one ``<|image_pad|>`` per feature), and the warm start's pairs with the teacher's
count-everything slip (``data/shapes.py``)."""

from __future__ import annotations

from hybridrl.config import Config
from hybridrl.trainer.prompts import PromptSet

SFTPairs = tuple[list[list[int]], list[list[int]], list[list[int] | None]]


def shapes_data(cfg: Config, tokenizer, hf_config) -> tuple[PromptSet, PromptSet, SFTPairs]:
    """``(train, held-out, (prompts, answers, slips))``: one picture per prompt, its board
    cells one language-model token each (``patch * merge`` pixels)."""
    from hybridrl.data.shapes import shapes_splits
    from hybridrl.data.vl_prompts import VLPromptRenderer

    d = cfg.data
    if getattr(hf_config, "vision_config", None) is None:
        raise ValueError(f"data.task=shapes asks questions about pictures: use a vision-language model "
                         f"(model.arch=qwen2_5_vl or qwen3_vl, or a Qwen-VL model.path), not {hf_config.model_type}")
    v = hf_config.vision_config
    cell = v.patch_size * v.spatial_merge_size
    train, held_out = shapes_splits(train_size=d.train_size, eval_size=d.eval_size, seed=d.seed, cell=cell)
    renderer = VLPromptRenderer.for_model(tokenizer, hf_config, min_pixels=min(d.min_pixels, (4 * cell) ** 2),
                                          max_pixels=d.max_pixels)

    def to_set(examples) -> PromptSet:
        rendered = [renderer.render([{"role": "user", "content": [{"type": "image"},
                                                                  {"type": "text", "text": x.question}]}], [x.image])
                    for x in examples]
        return PromptSet([ids for ids, _ in rendered], [x.answer for x in examples], [x.question for x in examples],
                         [images for _, images in rendered])

    def answer_ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    tr = to_set(train)
    sft = (tr.prompts, [answer_ids(a) for a in tr.answers],
           [None if x.slip is None else answer_ids(x.slip) for x in train])
    return tr, to_set(held_out), sft
