"""The trainer forward of a Qwen2.5-VL / Qwen3-VL policy: image features merged into the
packed (or padded) input embeddings, multimodal rotary positions built per sequence.

transformers' ``Qwen*VLModel.forward`` would do three things wrong for a packed batch: it
passes the attention kwargs (``cu_seq_lens_q``...) on to the vision tower, builds mRoPE
positions from a padded batch with ``get_rope_index``, and takes every ``<|image_pad|>`` in
the ids for a placeholder — a sampled one included. So the trainer calls the parts itself:

1. the vision tower (``get_image_features``) on the micro-batch's images, outside any
   attention override (only the language model runs packed);
2. per sequence (never from the padded batch), its image placeholders and its positions,
   ``hybridrl.data.vision.split_runs`` / ``mrope_positions`` — the image bookkeeping is
   checked there: image tokens == image features, one line naming the row otherwise;
3. the language model on ``inputs_embeds`` with the features at the placeholders, positions
   ``[4, 1, T]`` (per-sequence text positions, then the 3 mRoPE rows: transformers' packed
   form) or ``[3, n, L]`` (bucketed, right-padded), and Qwen3-VL's deepstack features
   (``visual_pos_masks`` / ``deepstack_visual_embeds``).

Placeholders are the image-token runs enclosed by ``<|vision_start|>`` / ``<|vision_end|>``
(as every processor lays out an image): a ``<|image_pad|>`` the policy sampled is never one
(the engines stop a VL sample at a sampled vision token, so it is never enclosed); like the
engine that decoded it, the trainer embeds it as text at its text position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.data.vision import (ImageInputs, ImageTokenMismatch, RowImages, VisionTokens, mrope_positions,
                                  split_runs)


def vision_tokens_of(model: torch.nn.Module) -> VisionTokens | None:
    """The vision token ids of a Qwen VL model (None for a text model)."""
    return VisionTokens.of(model.config)


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder of a VL model (``model.model.language_model``): where attention overrides go."""
    return model.model.language_model


@dataclass
class VLRows:
    """The packed image bookkeeping of a micro-batch's rows (real tokens, unpad order).

    positions: ``[3, T]`` long mRoPE positions, per sequence.
    slots: ``[F]`` long, the packed index of each image feature, in feature order.
    images: the rows' images in row order (the vision tower's input), or None.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    images: ImageInputs | None


def vl_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, images: RowImages | None,
            tokens: VisionTokens, batch_rows: list[int] | None = None) -> VLRows:
    """:class:`VLRows` of ``[n, L]`` rows (any padding); one-line ``ImageTokenMismatch`` naming
    the row (its index in the batch: ``batch_rows[r]``) when its image tokens and image
    features do not match."""
    real = attention_mask != 0
    rows = images.rows if images is not None else [None] * input_ids.shape[0]
    if len(rows) != input_ids.shape[0]:
        raise ValueError(f"compute_logprobs_entropy: {len(rows)} image rows for {input_ids.shape[0]} token rows")
    positions, slots, offset = [], [], 0
    for r, (ids_r, keep) in enumerate(zip(input_ids.tolist(), real.tolist())):
        ids = [t for t, k in zip(ids_r, keep) if k]
        try:
            spans = split_runs(ids, rows[r], tokens)
        except ImageTokenMismatch as e:
            row = r if batch_rows is None else batch_rows[r]
            raise ImageTokenMismatch(f"compute_logprobs_entropy: row {row}: {e}") from None
        positions.append(mrope_positions(ids, rows[r], tokens)[0])
        slots += [offset + i for a, b in spans for i in range(a, b)]
        offset += len(ids)
    device = input_ids.device
    return VLRows(torch.cat(positions, dim=1).to(device), torch.tensor(slots, dtype=torch.long, device=device),
                  ImageInputs.concat(rows))


def image_features(model: torch.nn.Module, images: ImageInputs | None
                   ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The vision tower's features ``[F, D]`` of ``images`` and Qwen3-VL's deepstack features
    (one ``[F, D]`` per deepstack layer; empty for Qwen2.5-VL). Runs with the vision tower's
    own attention (call it outside any packed-attention override)."""
    if images is None:
        return None, []
    vl = model.model
    device = vl.get_input_embeddings().weight.device
    out = vl.get_image_features(images.pixel_values.to(device), images.grid_thw.to(device), return_dict=True)
    features = torch.cat(out.pooler_output, dim=0)
    deepstack = [torch.cat(f, dim=0) for f in (getattr(out, "deepstack_features", None) or [])]
    return features, deepstack


def merged_embeddings(model: torch.nn.Module, ids: torch.Tensor, slots: torch.Tensor,
                      features: torch.Tensor | None, deepstack: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """``inputs_embeds`` of ``ids`` (any shape ``[..., L]``; ``slots`` index its flattening)
    with ``features`` at ``slots``, and the deepstack kwargs of the language model."""
    embeds = model.model.get_input_embeddings()(ids)  # (..., D)
    n_features = 0 if features is None else features.shape[0]
    if n_features != slots.numel():  # vl_rows matched them; a vision tower of another merge size would not
        raise ImageTokenMismatch(f"image tokens and image features do not match: {slots.numel()} image tokens, "
                                 f"{n_features} features from the vision tower")
    if features is None:
        return embeds, {}
    flat = embeds.flatten(0, -2).index_put((slots,), features.to(embeds.dtype))
    extra = {}
    if deepstack:  # Qwen3-VL adds these to the first decoder layers' outputs at the visual positions
        mask = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
        mask[slots] = True
        order = torch.argsort(slots)  # the language model reads them in mask (position) order
        extra = dict(visual_pos_masks=mask.view(embeds.shape[:-1]),
                     deepstack_visual_embeds=[d[order].to(embeds.dtype) for d in deepstack])
    return flat.view(embeds.shape), extra


def vl_packed_hidden(model, ids: torch.Tensor, text_positions: torch.Tensor, rows: VLRows, features,
                     attn_kwargs: dict) -> torch.Tensor:
    """Hidden states ``[T, D]`` of one packed row ``ids [T]`` (varlen / block-diagonal)."""
    feats, deepstack = features
    embeds, extra = merged_embeddings(model, ids[None], rows.slots, feats, deepstack)
    positions = torch.cat([text_positions[None], rows.positions]).unsqueeze(1)  # (4, 1, T): text row first
    out = language_model(model)(inputs_embeds=embeds, position_ids=positions, use_cache=False, **attn_kwargs, **extra)
    return out.last_hidden_state[0]


def vl_dense_hidden(model, dense_ids: torch.Tensor, flat: torch.Tensor, rows: VLRows, features,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states ``[n * L, D]`` of ``dense_ids [n, L]`` whose real tokens (packed order)
    sit at ``flat`` (right-aligned bucket: no mask; any padding: with ``attention_mask``)."""
    n, width = dense_ids.shape
    feats, deepstack = features
    embeds, extra = merged_embeddings(model, dense_ids, flat[rows.slots], feats, deepstack)
    positions = torch.ones(3, n * width, dtype=torch.long, device=dense_ids.device)
    positions[:, flat] = rows.positions
    out = language_model(model)(inputs_embeds=embeds, position_ids=positions.view(3, n, width),
                                attention_mask=attention_mask, use_cache=False, **extra)
    return out.last_hidden_state.flatten(0, 1)


def vl_group_hidden(model, ids_g: torch.Tensor, mask_g: torch.Tensor, images_g: RowImages | None,
                    tokens: VisionTokens, backend: str, batch_rows: list[int]) -> torch.Tensor:
    """Hidden states ``[T_g, D]`` of one micro-batch's real tokens (unpad order): the VL twin
    of ``forward._packed_hidden`` for the ``varlen`` / ``block_diagonal`` / ``bucketed``
    backends. ``batch_rows``: the group's rows in the batch (for error messages)."""
    from hybridrl.attention.packing import unpad, unpad_indices

    u = unpad_indices(mask_g)
    rows = vl_rows(ids_g, mask_g, images_g, tokens, batch_rows)
    features = image_features(model, rows.images)
    ids = unpad(ids_g, u)  # (T_g,)
    if backend == "bucketed":  # right-aligned to the group's longest row: is_causal, no mask
        lengths = u.cu_seqlens.diff().long()
        row = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
        flat = row * u.max_seqlen + u.position_ids  # (T_g,) into (n, L_g)
        dense = ids.new_zeros(len(lengths) * u.max_seqlen).index_put_((flat,), ids).view(len(lengths), u.max_seqlen)
        return vl_dense_hidden(model, dense, flat, rows, features)[flat]
    kwargs = {}
    if backend == "varlen":
        kwargs = dict(cu_seq_lens_q=u.cu_seqlens, cu_seq_lens_k=u.cu_seqlens, max_length_q=u.max_seqlen,
                      max_length_k=u.max_seqlen)
    return vl_packed_hidden(model, ids, u.position_ids, rows, features, kwargs)


def vl_padded_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: RowImages | None,
                     tokens: VisionTokens) -> torch.Tensor:
    """Hidden states ``[B * L, D]`` of the plain padded forward (every position; the mask
    handles any padding side)."""
    from hybridrl.attention.packing import unpad_indices

    rows = vl_rows(input_ids, attention_mask, images, tokens)
    features = image_features(model, rows.images)
    flat = unpad_indices(attention_mask).indices
    return vl_dense_hidden(model, input_ids, flat, rows, features, attention_mask=attention_mask)
