"""Images of a vision-language prompt, and the bookkeeping every part of hybridrl shares:
which token ids stand for image features, how many each image takes, and the multimodal
rotary positions (mRoPE) of a token sequence.

One ``ImageInputs`` travels with a prompt (and with every sample of it) from the data set
through the engine's request, the finished sample and the trainer's forward: the engine
and the trainer see the same ``pixel_values``, so the same features. Its ``keys`` (one
content hash per image) are what the prefix cache and a group's identical-prompt
deduplication compare, never the token ids alone (two prompts with the same text and other
pictures have the same ids).

Qwen2-VL / Qwen2.5-VL / Qwen3-VL layout (transformers' processors and ``get_rope_index``):
an image of ``grid_thw = (t, h, w)`` patches is ``t * h * w // merge**2`` consecutive
``image_token_id`` tokens in the ids (``merge = spatial_merge_size``); its 3-D positions are
``(start + t_i, start + h_i, start + w_i)`` over its ``(t, h // merge, w // merge)`` grid,
and the text after it continues at ``start + max(t, h // merge, w // merge)``. Text tokens
have the same position on all three axes. Past the last image a token at sequence index
``i`` sits at position ``i + delta`` (``delta <= 0``): that is all decode needs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch


class ImageTokenMismatch(ValueError):
    """The ids hold another number of image tokens than the images have features (the
    "Image features and image tokens do not match" class of bug): one line, with counts."""


@dataclass(frozen=True)
class VisionTokens:
    """The token ids and merge size a VL model's ids are laid out with."""

    image_token_id: int
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    spatial_merge_size: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "VisionTokens":
        """From a transformers Qwen2-VL / Qwen2.5-VL / Qwen3-VL config."""
        return cls(image_token_id=int(cfg.image_token_id), video_token_id=int(cfg.video_token_id),
                   vision_start_id=int(cfg.vision_start_token_id),
                   vision_end_id=int(getattr(cfg, "vision_end_token_id", cfg.vision_start_token_id + 1)),
                   spatial_merge_size=int(cfg.vision_config.spatial_merge_size))

    @classmethod
    def of(cls, cfg: Any) -> "VisionTokens | None":
        """A model config's vision tokens; None for a text model (no ``vision_config``)."""
        if getattr(cfg, "vision_config", None) is None or getattr(cfg, "image_token_id", None) is None:
            return None
        return cls.from_hf_config(cfg)

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids a policy must never be trained to emit as features: a sampled one is masked
        out of the loss and never reaches a forward as an image placeholder."""
        return (self.image_token_id, self.video_token_id, self.vision_start_id, self.vision_end_id)


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """The processor's output for the images of one prompt, in prompt order.

    pixel_values: ``[P, C * temporal_patch * patch * patch]`` float32 patches of every image,
        concatenated (P = sum of t * h * w over the images).
    grid_thw: ``[N, 3]`` long, each image's (t, h, w) patch grid.
    keys: N content hashes (sha256 of each image's patches and grid), for prefix reuse and
        deduplication.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    keys: tuple[str, ...]

    @classmethod
    def of(cls, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> "ImageInputs":
        """Build one, hashing each image's content."""
        grid_thw = grid_thw.to(torch.long).reshape(-1, 3).cpu()
        pixel_values = pixel_values.float().cpu().contiguous()
        sizes = grid_thw.prod(-1).tolist()
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"ImageInputs: pixel_values has {pixel_values.shape[0]} patches, the grids "
                             f"{grid_thw.tolist()} make {sum(sizes)}")
        keys, start = [], 0
        for size, grid in zip(sizes, grid_thw.tolist()):
            h = hashlib.sha256(str(grid).encode())
            h.update(pixel_values[start:start + size].numpy().tobytes())
            keys.append(h.hexdigest()[:32])
            start += size
        return cls(pixel_values, grid_thw, tuple(keys))

    @property
    def n_images(self) -> int:
        return self.grid_thw.shape[0]

    def patches_per_image(self) -> list[int]:
        return self.grid_thw.prod(-1).tolist()

    def features_per_image(self, merge: int) -> list[int]:
        """Image tokens (= vision-tower output rows) of each image."""
        return [p // (merge * merge) for p in self.patches_per_image()]

    def select(self, start: int, stop: int) -> "ImageInputs | None":
        """Images ``[start, stop)`` (None when empty)."""
        if stop <= start:
            return None
        sizes = self.patches_per_image()
        p0, p1 = sum(sizes[:start]), sum(sizes[:stop])
        return ImageInputs(self.pixel_values[p0:p1], self.grid_thw[start:stop], self.keys[start:stop])

    @staticmethod
    def concat(parts: Sequence["ImageInputs | None"]) -> "ImageInputs | None":
        """Several prompts' images as one (in order); None when there are none."""
        parts = [p for p in parts if p is not None and p.n_images]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.grid_thw for p in parts]),
                           tuple(k for p in parts for k in p.keys))

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


def image_token_runs(ids: Sequence[int], tokens: "VisionTokens",
                     placeholders: Sequence[bool] | None = None) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of each placeholder run of image tokens in ``ids``: a maximal run
    of ``image_token_id`` enclosed by ``vision_start_id`` and ``vision_end_id``, as every
    processor lays out an image (or, with ``placeholders``, every run where it is True)."""
    runs, start = [], None
    for i, t in enumerate(list(ids) + [None]):
        if t == tokens.image_token_id and (placeholders is None or placeholders[i]):
            if start is None:
                start = i
        elif start is not None:
            enclosed = start > 0 and ids[start - 1] == tokens.vision_start_id and t == tokens.vision_end_id
            if placeholders is not None or enclosed:
                runs.append((start, i))
            start = None
    return runs


def split_runs(ids: Sequence[int], images: ImageInputs | None, tokens: VisionTokens,
               placeholders: Sequence[bool] | None = None) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of each image's tokens in ``ids``, one per image in order.

    ``placeholders``: which positions may stand for image features (default: the runs
    enclosed by vision start / end tokens, see ``image_token_runs``). A token the policy
    sampled is never a placeholder: the engines stop a VL request at a sampled vision token
    (it is the response's last token, so never enclosed) and the pipeline masks that
    sample out of the loss; it is embedded as text at a text position, in the engine and
    in the trainer alike.

    Adjacent images with nothing between them form one run, split by the images' feature
    counts. Raises ``ImageTokenMismatch`` unless the placeholders hold exactly the images'
    features (and no video tokens)."""
    if any(t == tokens.video_token_id and i and ids[i - 1] == tokens.vision_start_id for i, t in enumerate(ids)):
        raise ImageTokenMismatch("the prompt holds video tokens; videos are not supported (images only)")
    runs = image_token_runs(ids, tokens, placeholders)
    counts = images.features_per_image(tokens.spatial_merge_size) if images is not None else []
    n_tokens = sum(b - a for a, b in runs)
    if n_tokens != sum(counts):
        raise ImageTokenMismatch(f"image tokens and image features do not match: the ids hold {n_tokens} image "
                                 f"tokens, the {len(counts)} image(s) have {sum(counts)} features {counts}")
    spans, k = [], 0
    for a, b in runs:
        while a < b:
            if k >= len(counts) or a + counts[k] > b:
                raise ImageTokenMismatch(f"image tokens and image features do not match: a run of {b - a} image "
                                         f"tokens at {a} does not split into the images' feature counts {counts}")
            spans.append((a, a + counts[k]))
            a += counts[k]
            k += 1
    return spans


def mrope_positions(ids: Sequence[int], images: ImageInputs | None, tokens: VisionTokens,
                    placeholders: Sequence[bool] | None = None) -> tuple[torch.Tensor, int]:
    """3-D rotary positions ``[3, len(ids)]`` long of one sequence, and its ``delta``: a token
    at index ``i >= len(ids)`` appended later sits at ``i + delta`` on every axis.

    Checks the image bookkeeping first (``split_runs``; ``placeholders`` as there)."""
    spans = split_runs(ids, images, tokens, placeholders)
    merge = tokens.spatial_merge_size
    pieces, pos, cursor = [], 0, 0
    grids = images.grid_thw.tolist() if images is not None else []
    for (a, b), (t, h, w) in zip(spans, grids):
        if a > cursor:
            pieces.append(torch.arange(pos, pos + a - cursor).expand(3, -1))
            pos += a - cursor
        gh, gw = h // merge, w // merge
        tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).reshape(-1)
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).reshape(-1)
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).reshape(-1)
        pieces.append(torch.stack([tt, hh, ww]) + pos)
        pos += max(t, gh, gw)
        cursor = b
    if len(ids) > cursor:
        pieces.append(torch.arange(pos, pos + len(ids) - cursor).expand(3, -1))
        pos += len(ids) - cursor
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return positions.contiguous(), pos - len(ids)


def positions_of(prompt_positions: torch.Tensor, delta: int, start: int, stop: int) -> torch.Tensor:
    """Positions ``[3, stop - start]`` of sequence indices ``[start, stop)`` of a sequence whose
    first ``prompt_positions.shape[1]`` tokens have ``prompt_positions`` and the rest follow at
    ``i + delta``."""
    n = prompt_positions.shape[1]
    head = prompt_positions[:, start:min(stop, n)]
    if stop <= n:
        return head
    tail = torch.arange(max(start, n), stop).expand(3, -1) + delta
    return torch.cat([head, tail], dim=1)


class RowImages:
    """Per-row images of a batch (``None`` for a text-only row), indexable like the batch's
    ``[B, L]`` tensors (``rows[idx]`` with a slice, a list or a long/bool tensor), so a batch
    dict ``{name: value[rows]}`` carries them through micro-batching and row filters."""

    def __init__(self, rows: Sequence[ImageInputs | None]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, idx) -> "RowImages":
        if isinstance(idx, slice):
            return RowImages(self.rows[idx])
        if isinstance(idx, torch.Tensor):
            idx = idx.nonzero().view(-1) if idx.dtype == torch.bool else idx.view(-1)
            idx = idx.tolist()
        return RowImages([self.rows[int(i)] for i in idx])

    @property
    def any(self) -> bool:
        return any(r is not None for r in self.rows)

    def concat(self) -> ImageInputs | None:
        """Every row's images in row order (the order of their tokens in a packed batch)."""
        return ImageInputs.concat(self.rows)

    def to(self, *_args, **_kwargs) -> "RowImages":  # kept on the host; the forward moves pixels once
        return self


def hf_vision_kwargs(input_ids: torch.Tensor, rows: Sequence[ImageInputs | None],
                     tokens: VisionTokens) -> dict[str, torch.Tensor]:
    """What a transformers Qwen-VL forward takes beside ``input_ids [B, L]`` (any padding) for
    the rows' images: ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (1 at
    the placeholders, which transformers' own ``get_rope_index`` reads); {} without images.
    The warm start and the tests' references run the model this way."""
    images = ImageInputs.concat(rows)
    if images is None:
        return {}
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for b, row in enumerate(rows):
        ids = input_ids[b].tolist()
        for a, z in split_runs(ids, row, tokens):
            types[b, a:z] = 1
    dev = input_ids.device
    return {"pixel_values": images.pixel_values.to(dev), "image_grid_thw": images.grid_thw.to(dev),
            "mm_token_type_ids": types}
