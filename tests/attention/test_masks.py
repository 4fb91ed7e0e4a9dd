"""Masks: equality with a plain reference, SDPA vs per-sequence attention (float64),
and real peak memory (fails on the naive builder)."""


import pytest
import torch
import torch.nn.functional as F

from hybridrl.attention.masks import (
    additive_mask,
    decode_mask,
    npu_compressed_causal_mask,
    npu_fusion_attention_mask,
    sdpa_mask,
)


def random_padding(batch, seq, seed):
    """[B, S] long 0/1 with left, right, both-sided and all-pad rows."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        kind = b % 4
        n = int(torch.randint(1, seq + 1, (1,), generator=g))
        left = {0: 0, 1: seq - n, 2: int(torch.randint(0, seq - n + 1, (1,), generator=g)), 3: 0}[kind]
        if kind != 3:
            mask[b, left : left + n] = 1
    return mask


def reference_attend(padding_mask):
    """Plain loops' worth of truth: True = attend, pad query rows attend to themselves only."""
    b, s = padding_mask.shape
    valid = padding_mask.bool()
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    attend = causal & valid[:, None, :] & valid[:, :, None]
    attend |= torch.eye(s, dtype=torch.bool)
    return attend[:, None]  # (B, 1, S, S)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_formats_match_reference(seed):
    pm = random_padding(6, 37, seed)
    ref = reference_attend(pm)
    assert torch.equal(sdpa_mask(pm), ref)
    assert torch.equal(npu_fusion_attention_mask(pm), ~ref)
    add = additive_mask(pm, torch.bfloat16)
    assert add.dtype == torch.bfloat16
    assert torch.equal(add == 0, ref)
    assert torch.equal(add == torch.finfo(torch.bfloat16).min, ~ref)


def test_sdpa_output_equals_per_sequence_attention_float64():
    torch.manual_seed(0)
    pm = random_padding(8, 24, seed=3)
    q, k, v = (torch.randn(8, 2, 24, 16, dtype=torch.float64) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(pm))
    add_out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(pm, torch.float64))
    assert not out.isnan().any() and not add_out.isnan().any()
    for b in range(8):
        idx = pm[b].nonzero().squeeze(1)
        if len(idx) == 0:
            continue
        ref = F.scaled_dot_product_attention(q[b][:, idx], k[b][:, idx], v[b][:, idx], is_causal=True)
        torch.testing.assert_close(out[b][:, idx], ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(add_out[b][:, idx], ref, rtol=0, atol=1e-12)


def test_decode_mask():
    lengths = torch.tensor([3, 5, 0, 4])
    start = torch.tensor([0, 2, 0, 1])
    m = decode_mask(lengths, 6, start_positions=start)
    assert m.shape == (4, 1, 1, 6) and m.dtype == torch.bool
    expect = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0]]).bool()
    assert torch.equal(m[:, 0, 0], expect)
    assert torch.equal(decode_mask(lengths, 6, start_positions=start, kind="npu"), ~m)
    add = decode_mask(lengths, 6, start_positions=start, kind="additive", dtype=torch.float16)
    assert torch.equal(add[:, 0, 0] == 0, expect)


def test_compressed_npu_mask():
    m = npu_compressed_causal_mask()
    assert m.shape == (2048, 2048) and m.dtype == torch.bool
    assert torch.equal(m[:5, :5], torch.ones(5, 5, dtype=torch.bool).triu(1))


def test_bad_padding_mask_shape_is_one_line_valueerror():
    with pytest.raises(ValueError, match="padding_mask must be"):
        sdpa_mask(torch.ones(2, 1, 4, 4))
