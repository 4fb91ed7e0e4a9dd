"""Vision-language prompts: a chat whose message content mixes ``{"type": "image"}`` and
``{"type": "text", "text": ...}`` items, with its images, rendered into ``(ids, ImageInputs)``.

What transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors do, without their video
processor (it needs torchvision, which the CPU install does not have):

1. the chat template renders each image item as ``<|vision_start|><|image_pad|><|vision_end|>``
   (the checkpoint's template, or the built-in ``VL_CHAT_TEMPLATE``);
2. the PIL image processor (``Qwen2VLImageProcessorPil``: resize within
   ``[min_pixels, max_pixels]`` to multiples of ``patch * merge``, normalize, cut into
   patches) gives ``pixel_values [P, C * temporal_patch * patch**2]`` and ``grid_thw [N, 3]``;
3. the i-th ``<|image_pad|>`` becomes ``t * h * w // merge**2`` of them.

Images come from a file path (relative to the data file), raw bytes, a ``data:image/...;base64``
string, a ``datasets`` ``Image`` value (``{"bytes", "path"}`` or a PIL image), either inline
(``{"type": "image", "image": ...}``) or, in order, from the row's image column. What makes an
image unusable is a :class:`BadImage` whose message is the reason a row is skipped for.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from hybridrl.data.vision import ImageInputs, ImageTokenMismatch, VisionTokens, split_runs

# Reasons a row is skipped for (counted like bad rows, with file:row; see files.py)
IMAGE_NOT_FOUND = "image file not found"
IMAGE_UNDECODABLE = "undecodable image"
IMAGE_TOO_LARGE = "image larger than data.max_pixels"
TOO_MANY_IMAGES = "more images than data.max_images"
IMAGE_MISMATCH = "image items and images differ"

DEFAULT_MIN_PIXELS = 56 * 56  # transformers' Qwen2-VL image processor defaults
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


class BadImage(ValueError):
    """An image (or the row's images) that cannot be used; ``str(e)`` is the skip reason."""


def load_image(value: Any, base_dir: Path):
    """One image as an RGB PIL image, decoded; :class:`BadImage` when it cannot be."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return _decoded(value)
    if isinstance(value, dict):  # a datasets Image value: the bytes when stored, else the path
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open(io.BytesIO(bytes(value)))
    if isinstance(value, str) and value.startswith("data:image/"):
        try:
            return _open(io.BytesIO(base64.b64decode(value.split(",", 1)[1], validate=True)))
        except (IndexError, ValueError):
            raise BadImage(IMAGE_UNDECODABLE) from None
    if isinstance(value, str) and value:
        path = Path(value) if Path(value).is_absolute() else base_dir / value
        if not path.is_file():
            raise BadImage(IMAGE_NOT_FOUND)
        return _open(path)
    raise BadImage(IMAGE_MISMATCH)


def _open(source):
    from PIL import Image

    try:
        return _decoded(Image.open(source))
    except BadImage:
        raise
    except Image.DecompressionBombError:
        raise BadImage(IMAGE_TOO_LARGE) from None
    except Exception:  # noqa: BLE001 - UnidentifiedImageError, truncated data, OSError: undecodable
        raise BadImage(IMAGE_UNDECODABLE) from None


def _decoded(image):
    try:
        image.load()  # decode now: a truncated file fails here, not in the processor
        return image.convert("RGB")
    except Exception:  # noqa: BLE001 - see _open
        raise BadImage(IMAGE_UNDECODABLE) from None


class VLPromptRenderer:
    """Renders vision-language prompts for one model: its tokenizer (with a chat template
    that handles image items), its image processor, and its vision token ids.

    image_key: the row column holding the images (a list, or one image).
    max_pixels: an image with more pixels (width * height, before resizing) is skipped;
        also the processor's resize bound. min_pixels: the processor's lower bound.
    max_images: a row with more images is skipped.
    """

    def __init__(self, tokenizer, image_processor, tokens: VisionTokens, *, image_key: str = "images",
                 max_pixels: int = DEFAULT_MAX_PIXELS, max_images: int = 16):
        self.tokenizer, self.image_processor, self.tokens = tokenizer, image_processor, tokens
        self.image_key, self.max_pixels, self.max_images = image_key, max_pixels, max_images
        self.image_pad = tokenizer.convert_ids_to_tokens(tokens.image_token_id)

    @classmethod
    def for_model(cls, tokenizer, hf_config, *, image_key: str = "images", min_pixels: int = DEFAULT_MIN_PIXELS,
                  max_pixels: int = DEFAULT_MAX_PIXELS, max_images: int = 16,
                  processor_dir: str | None = None) -> "VLPromptRenderer":
        """The renderer of a Qwen VL model: the image processor of ``processor_dir`` (a
        checkpoint's ``preprocessor_config.json``: mean, std, patch sizes) or, without one,
        transformers' defaults at the model's patch and merge sizes."""
        from transformers import Qwen2VLImageProcessorPil

        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        if processor_dir is not None and (Path(processor_dir) / "preprocessor_config.json").is_file():
            processor = Qwen2VLImageProcessorPil.from_pretrained(processor_dir, size=size, local_files_only=True)
        else:
            vision = hf_config.vision_config
            processor = Qwen2VLImageProcessorPil(size=size, patch_size=vision.patch_size,
                                                 merge_size=vision.spatial_merge_size,
                                                 temporal_patch_size=vision.temporal_patch_size)
        return cls(tokenizer, processor, VisionTokens.from_hf_config(hf_config), image_key=image_key,
                   max_pixels=max_pixels, max_images=max_images)

    def row_images(self, messages: list, column: Any, base_dir: Path) -> list:
        """The PIL images of a chat prompt, one per image item in order: an item's own
        ``image`` value, else the next entry of the image column."""
        column = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
        items = [it for m in messages if isinstance(m.get("content"), list) for it in m["content"]
                 if isinstance(it, dict) and (it.get("type") == "image" or "image" in it)]
        queue, values = list(column), []
        for item in items:
            if item.get("image") is not None:
                values.append(item["image"])
            elif queue:
                values.append(queue.pop(0))
            else:
                raise BadImage(IMAGE_MISMATCH)
        if queue:
            raise BadImage(IMAGE_MISMATCH)
        if len(values) > self.max_images:
            raise BadImage(TOO_MANY_IMAGES)
        images = [load_image(v, base_dir) for v in values]
        if any(im.width * im.height > self.max_pixels for im in images):
            raise BadImage(IMAGE_TOO_LARGE)
        return images

    def render(self, messages: list, images: list) -> tuple[list[int], ImageInputs | None]:
        """``(ids, images)`` of a chat prompt and its PIL images (``row_images``), with the
        generation prompt; each image's placeholder expanded to its feature count."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        pieces = text.split(self.image_pad)
        if len(pieces) - 1 != len(images):
            raise BadImage(IMAGE_MISMATCH)
        inputs = self.process(images)
        counts = inputs.features_per_image(self.tokens.spatial_merge_size) if inputs is not None else []
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids += self.tokenizer.encode(piece, add_special_tokens=False) if piece else []
            if i < len(counts):
                ids += [self.tokens.image_token_id] * counts[i]
        try:
            split_runs(ids, inputs, self.tokens)  # the template's text must not hold image tokens of its own
        except ImageTokenMismatch:
            raise BadImage(IMAGE_MISMATCH) from None
        return ids, inputs

    def process(self, images: list) -> ImageInputs | None:
        """The image processor's patches and grids of ``images`` (None when there are none)."""
        if not images:
            return None
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except ValueError:  # e.g. an aspect ratio over 200 (smart_resize)
            raise BadImage(IMAGE_UNDECODABLE) from None
        return ImageInputs.of(out["pixel_values"], out["image_grid_thw"])
