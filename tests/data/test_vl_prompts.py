"""Vision-language prompts from data files (data/vl_prompts.py through data/files.py): images
as paths relative to the data file, inline items, base64, bytes and a `datasets` Image
column; text-only rows beside them; every bad-image reason skipped and counted with file:row."""

import base64
import io
import json
import random

import pytest
import torch

from hybridrl.config import ModelConfig
from hybridrl.data import vl_prompts
from hybridrl.data.files import load_prompt_files
from hybridrl.data.vision import VisionTokens, split_runs
from hybridrl.data.vl_prompts import VLPromptRenderer
from hybridrl.job.model_factory import builtin_tokenizer, qwen2_5_vl_config, qwen3_vl_config
from tests._seeds import fresh_seed

MAX_PIXELS = 84 * 84


def _renderer(arch: str, max_images: int = 2):
    tokenizer = builtin_tokenizer(arch)
    spec = ModelConfig(arch=arch, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    config = (qwen2_5_vl_config if arch == "qwen2_5_vl" else qwen3_vl_config)(tokenizer, spec, 128)
    return tokenizer, VLPromptRenderer.for_model(tokenizer, config, min_pixels=28 * 28, max_pixels=MAX_PIXELS,
                                                 max_images=max_images)


def _png(rng: random.Random, size: tuple[int, int] | None = None) -> bytes:
    from PIL import Image

    w, h = size or (rng.randint(28, 84), rng.randint(28, 84))
    image = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    image.putpixel((w // 2, h // 2), (255, 255, 255))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _chat(n_images: int, text: str = "how many?", inline=None):
    items = [{"type": "image"} if inline is None else {"type": "image", "image": inline}] * n_images
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


def _check(record, renderer, n_images: int):
    tokens = renderer.tokens
    assert record.images is not None and record.images.n_images == n_images
    spans = split_runs(record.prompt_ids, record.images, tokens)  # image tokens == image features
    assert [b - a for a, b in spans] == record.images.features_per_image(tokens.spatial_merge_size)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_images_from_paths_inline_base64_and_text_rows_in_one_file(tmp_path, arch):
    seed = fresh_seed()
    rng = random.Random(seed)
    tokenizer, renderer = _renderer(arch)
    (tmp_path / "img").mkdir()
    pngs = [_png(rng) for _ in range(3)]
    for i, data in enumerate(pngs):
        (tmp_path / "img" / f"{i}.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(pngs[2]).decode()
    rows = [{"prompt": _chat(2), "images": ["img/0.png", "img/1.png"], "answer": 2},
            {"prompt": _chat(1, inline="img/2.png"), "answer": 1},
            {"prompt": _chat(1), "images": uri, "answer": 1},
            {"prompt": "1+1=", "answer": 2},
            {"prompt": [{"role": "user", "content": "plain chat"}], "answer": 0}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    records, report = load_prompt_files([str(path)], tokenizer, prompt_key="prompt", answer_key="answer",
                                        max_prompt_length=512, vision=renderer)
    assert report.loaded == 5 and not report.skipped, f"seed {seed}: {report.summary()}"
    _check(records[0], renderer, 2)
    _check(records[1], renderer, 1)
    assert records[2].images.keys == records[1].images.keys, f"seed {seed}: same picture, same key"
    assert records[3].images is None and records[4].images is None
    # the processor's own output for the same pictures, in order
    from PIL import Image

    direct = renderer.process([Image.open(io.BytesIO(d)).convert("RGB") for d in pngs[:2]])
    assert torch.equal(direct.pixel_values, records[0].images.pixel_values)
    assert torch.equal(direct.grid_thw, records[0].images.grid_thw)
    text = tokenizer.decode(records[0].prompt_ids)
    assert text.startswith("<|user|><|vision_start|><|image_pad|>") and text.endswith("how many?<|end|><|assistant|>")


def test_every_bad_image_reason_is_counted_with_its_row(tmp_path):
    seed = fresh_seed()
    rng = random.Random(seed)
    tokenizer, renderer = _renderer(rng.choice(["qwen2_5_vl", "qwen3_vl"]))
    (tmp_path / "ok.png").write_bytes(_png(rng))
    (tmp_path / "broken.png").write_bytes(_png(rng)[:40])
    (tmp_path / "big.png").write_bytes(_png(rng, (100, 90)))
    rows = [{"prompt": _chat(1), "images": ["ok.png"]},
            {"prompt": _chat(1), "images": ["missing.png"]},
            {"prompt": _chat(1), "images": ["broken.png"]},
            {"prompt": _chat(1), "images": ["big.png"]},
            {"prompt": _chat(3), "images": ["ok.png"] * 3},
            {"prompt": _chat(2), "images": ["ok.png"]},
            {"prompt": _chat(1), "images": ["ok.png", "ok.png"]},
            {"prompt": _chat(1), "images": "data:image/png;base64,!!notbase64"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    records, report = load_prompt_files([str(path)], tokenizer, prompt_key="prompt", answer_key="answer",
                                        max_prompt_length=512, vision=renderer)
    assert report.loaded == 1 and records[0].images.n_images == 1
    expected = {vl_prompts.IMAGE_NOT_FOUND: (1, 2), vl_prompts.IMAGE_UNDECODABLE: (2, 3),
                vl_prompts.IMAGE_TOO_LARGE: (1, 4), vl_prompts.TOO_MANY_IMAGES: (1, 5),
                vl_prompts.IMAGE_MISMATCH: (2, 6)}
    for reason, (count, row) in expected.items():
        assert report.skipped[reason] == count and report.first[reason] == f"{path}:{row}", report.summary()


def test_bytes_and_datasets_image_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    seed = fresh_seed()
    rng = random.Random(seed)
    tokenizer, renderer = _renderer("qwen2_5_vl")
    pngs = [_png(rng) for _ in range(2)]
    prompt = _chat(1)
    # parquet as `datasets` writes an Image column: {"bytes", "path"} structs (bytes first, else the path)
    table = pa.table({"prompt": [prompt] * 3,
                      "images": [[{"bytes": pngs[0], "path": None}], [{"bytes": None, "path": "x.png"}],
                                 [{"bytes": pngs[1], "path": "y.png"}]]})
    (tmp_path / "x.png").write_bytes(pngs[1])
    pq.write_table(table, tmp_path / "rows.parquet")
    ds = datasets.Dataset.from_dict({"prompt": [prompt, prompt], "images": [[pngs[0]], [pngs[1]]]})
    ds = ds.cast_column("images", datasets.Sequence(datasets.Image()))  # decodes to PIL images on read
    ds.save_to_disk(str(tmp_path / "ds"))
    records, report = load_prompt_files([str(tmp_path / "rows.parquet"), str(tmp_path / "ds")], tokenizer,
                                        prompt_key="prompt", answer_key="answer", max_prompt_length=512,
                                        vision=renderer)
    assert report.loaded == 5 and [r.images.n_images for r in records] == [1] * 5, f"seed {seed}: {report.summary()}"
    keys = [r.images.keys for r in records]
    assert keys[0] == keys[3] and keys[1] == keys[2] == keys[4] and keys[0] != keys[1], f"seed {seed}"


def test_text_tokenizer_ids_unchanged():
    from hybridrl.data.char_tokenizer import build_char_tokenizer

    assert builtin_tokenizer().get_vocab() == build_char_tokenizer().get_vocab()
    tokens = VisionTokens.from_hf_config(qwen2_5_vl_config(builtin_tokenizer("qwen2_5_vl"),
                                                           ModelConfig(arch="qwen2_5_vl"), 128))
    vocab = builtin_tokenizer("qwen2_5_vl").convert_ids_to_tokens(list(tokens.special_ids))
    assert vocab == ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
