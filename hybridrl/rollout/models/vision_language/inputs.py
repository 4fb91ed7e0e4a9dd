"""A request's image layout (checked once, at ``add_request``) and a forward's visual inputs.

``ImageLayout``: where each image's tokens sit in the prompt (``split_runs``), the prompt's
3-D rotary positions and its ``delta`` (``mrope_positions``; ``hybridrl/data/vision.py`` is
the one implementation the trainer shares). A token past the prompt (a generated one, even
a sampled ``<|image_pad|>``, which is text) sits at ``index + delta`` on every axis; the KV
slot of a token is always its sequence index.

``MultimodalBatch``: for a prefill or an extend of rows whose new tokens are ``[start,
start + width)`` of their sequences, the ``[3, B, width]`` positions and the image features
to write over the embeddings of the image tokens among them. Only images with tokens in
the new part are encoded (a continued conversation's cached images are not), all of them
in one tower call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hybridrl.data.vision import ImageInputs, RowImages, VisionTokens, mrope_positions, positions_of, split_runs
from hybridrl.rollout.models.vision_language.vision_tower import ImageFeatures

ImageSpan = tuple[int, int, str]
"""(first token, end token, content key) of one image in a sequence."""


@dataclass(frozen=True, eq=False)
class ImageLayout:
    images: ImageInputs | None
    spans: tuple[tuple[int, int], ...]
    """each image's tokens ``[start, stop)`` in the prompt, in image order."""
    positions: torch.Tensor
    """``[3, len(prompt)]`` long mRoPE positions of the prompt."""
    delta: int
    """a token at index ``i >= len(prompt)`` sits at ``i + delta``."""

    @property
    def annotations(self) -> tuple[ImageSpan, ...]:
        """What prefix reuse and deduplication compare besides the ids."""
        keys = self.images.keys if self.images is not None else ()
        return tuple((a, b, k) for (a, b), k in zip(self.spans, keys))


def image_layout(prompt: Sequence[int], images: ImageInputs | None, tokens: VisionTokens,
                 placeholders: Sequence[bool] | None = None) -> ImageLayout:
    """Check and lay out one prompt's images (``ImageTokenMismatch``, one line, if they do not fit)."""
    spans = split_runs(prompt, images, tokens, placeholders)
    positions, delta = mrope_positions(prompt, images, tokens, placeholders)
    return ImageLayout(images if images is not None and images.n_images else None, tuple(spans), positions, delta)


def shared_image_prefix(parent: tuple[ImageSpan, ...], child: tuple[ImageSpan, ...], limit: int) -> int:
    """How much of a ``limit``-token common id prefix the parent's cached KV may serve: up to
    the first image (starting before ``limit``) that the two do not share, same place, same content."""
    p = {s for s in parent if s[0] < limit}
    c = {s for s in child if s[0] < limit}
    return min([limit] + [s[0] for s in p ^ c])


@dataclass
class VisualEmbeds:
    index: torch.Tensor
    """``[N]`` long: flat indices into the batch's ``B * S`` tokens that are image features."""
    features: torch.Tensor
    """``[N, hidden]``: what those tokens are embedded as."""
    deepstack: list[torch.Tensor]
    """per deepstack layer ``[N, hidden]``, added to that decoder layer's output (Qwen3-VL)."""


@dataclass
class MultimodalBatch:
    positions: torch.Tensor
    """``[3, B, S]`` long mRoPE positions of the batch's tokens."""
    visual: VisualEmbeds | None
    """None when no new token is an image token."""


Encoder = Callable[[ImageInputs], ImageFeatures]


def build_batch(layouts: Sequence[ImageLayout], starts: Sequence[int], width: int, encode: Encoder,
                max_position: int, device: torch.device) -> MultimodalBatch:
    """Rows ``b`` of a right-padded ``[B, width]`` forward hold tokens ``[starts[b], ...)`` of
    sequences laid out by ``layouts[b]``; pad positions are clamped to ``max_position``."""
    positions = torch.stack([positions_of(lay.positions, lay.delta, s, s + width)
                             for lay, s in zip(layouts, starts)], dim=1).clamp_(max=max_position)  # (3, B, width)
    wanted = []  # (row, image, its first new feature, where it goes in the row, how many)
    for b, (lay, s) in enumerate(zip(layouts, starts)):
        for k, (a, e) in enumerate(lay.spans):
            if e > s:
                lo = max(a, s)
                wanted.append((b, k, lo - a, lo - s, e - lo))
    if not wanted:
        return MultimodalBatch(positions.to(device), None)
    feats = encode(ImageInputs.concat([layouts[b].images.select(k, k + 1) for b, k, *_ in wanted]))
    index = torch.cat([torch.arange(b * width + at, b * width + at + n) for b, _, _, at, n in wanted])
    rows = [(i, f0, n) for i, (_, _, f0, _, n) in enumerate(wanted)]
    return MultimodalBatch(positions.to(device), _visual(index, feats, rows, device))


def _visual(index: torch.Tensor, feats: ImageFeatures, rows: list[tuple[int, int, int]],
            device: torch.device) -> VisualEmbeds:
    """The features ``[f0, f0 + n)`` of image ``i`` for each ``(i, f0, n)`` in ``rows``, stacked."""
    features = torch.cat([feats.features[i][f0:f0 + n] for i, f0, n in rows])
    layers = len(feats.deepstack[0]) if feats.deepstack else 0
    deepstack = [torch.cat([feats.deepstack[i][j][f0:f0 + n] for i, f0, n in rows]) for j in range(layers)]
    return VisualEmbeds(index.to(device), features, deepstack)


def logits_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: RowImages | None,
                 tokens: VisionTokens, encode: Encoder) -> MultimodalBatch:
    """The visual inputs of a no-cache forward over ``[B, S]`` ids with any padding: row b's
    valid tokens (``attention_mask``) are its sequence, laid out with ``rows[b]``'s images."""
    B, S = input_ids.shape
    positions = torch.zeros(3, B, S, dtype=torch.long)
    mask = attention_mask.bool().cpu()
    ids = input_ids.cpu()
    wanted, index = [], []
    for b in range(B):
        valid = mask[b].nonzero().view(-1)
        lay = image_layout(ids[b, valid].tolist(), rows.rows[b] if rows is not None else None, tokens)
        positions[:, b, valid] = lay.positions
        for k, (a, e) in enumerate(lay.spans):
            wanted.append(lay.images.select(k, k + 1))
            index.append(valid[a:e] + b * S)
    if not wanted:
        return MultimodalBatch(positions.to(input_ids.device), None)
    feats = encode(ImageInputs.concat(wanted))
    spans = [(i, 0, len(ix)) for i, ix in enumerate(index)]
    return MultimodalBatch(positions.to(input_ids.device), _visual(torch.cat(index), feats, spans, input_ids.device))
