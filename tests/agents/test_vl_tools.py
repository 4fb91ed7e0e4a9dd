"""A tool that returns a picture: its message carries an image item (in this process and
through the env workers), and a VL policy's episode renderer turns it into ids with the
image's feature count of ``<|image_pad|>`` and the processed image; a text policy's renderer
refuses it in one line (the episode fails, not the run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.agents.chat_render import TemplateError
from hybridrl.agents.env_pool import EnvPool
from hybridrl.agents.tool_env import ToolEnvironment
from hybridrl.config.io import load_config
from hybridrl.data.chat_tokenizer import build_chat_char_tokenizer
from hybridrl.data.vision import split_runs
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
from hybridrl.pipeline.engines import chat_renderer

PAINTER = f"{Path(__file__).parent / 'vl_tools_for_tests.py'}:Painter"


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _image_items(messages: list[dict]) -> list[dict]:
    return [it for m in messages if isinstance(m["content"], list) for it in m["content"] if it["type"] == "image"]


def test_a_tool_picture_becomes_image_items_in_process_and_in_workers():
    env = ToolEnvironment(PAINTER, max_tool_calls=2)
    env.reset({"prompt": "draw"})
    step = env.step(call("draw", colour="red") + call("caption", colour="blue"))
    assert [len(_image_items([m])) for m in step.messages] == [1, 1]
    assert step.messages[1]["content"][1] == {"type": "text", "text": "a blue shape"}
    with EnvPool(PAINTER, workers=1, max_tool_calls=2) as pool:
        pool.reset(["e"], [{"prompt": "draw"}])
        (remote,) = pool.step([("e", call("draw", colour="red"))])
    assert remote.failure is None and not remote.tool_errors, remote
    (item,) = _image_items(remote.messages)
    assert item["image"].tobytes() == step.messages[0]["content"][0]["image"].tobytes()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_a_vl_renderer_expands_the_tool_picture(arch: str):
    cfg = load_config(None, [f"model.arch={arch}", "data.task=shapes"])
    tokenizer = builtin_tokenizer(arch)
    model = builtin_model(tokenizer, cfg.model)
    env = ToolEnvironment(PAINTER, max_tool_calls=1)
    env.reset({"prompt": "draw"})
    messages = env.step(call("draw", colour="green")).messages
    renderer = chat_renderer(cfg, tokenizer, model.config, env.schemas())
    ids, images = renderer.continuation_images(messages)
    assert images is not None and images.n_images == 1
    (span,) = split_runs(ids, images, renderer.vision.prompts.tokens)  # exactly the image's features, enclosed
    assert span[1] - span[0] == images.features_per_image(model.config.vision_config.spatial_merge_size)[0]
    chat = build_chat_char_tokenizer()
    text_cfg = load_config(None, [])
    text = chat_renderer(text_cfg, chat, builtin_model(chat, text_cfg.model).config, env.schemas())
    with pytest.raises(TemplateError, match="the policy is a text model"):
        text.continuation_images(messages)
