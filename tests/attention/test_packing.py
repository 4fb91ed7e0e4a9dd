"""Packing helpers and the varlen shim against padded references."""

import pytest
import torch
import torch.nn.functional as F

from hybridrl.attention import varlen
from hybridrl.attention.packing import make_microbatches, pad, padding_fraction, unpad, unpad_indices
from tests.attention.test_masks import random_padding


def test_unpad_pad_roundtrip_and_metadata():
    pm = random_padding(6, 11, seed=5)
    x = torch.randn(6, 11, 3)
    u = unpad_indices(pm)
    lengths = pm.sum(1)
    assert u.cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert u.max_seqlen == int(lengths.max())
    expect_pos = torch.cat([torch.arange(int(n)) for n in lengths])
    assert torch.equal(u.position_ids, expect_pos)
    packed = unpad(x, u)
    assert packed.shape == (int(lengths.sum()), 3)
    torch.testing.assert_close(pad(packed, u), x * pm[..., None])


@pytest.mark.parametrize("seed", [0, 1])
def test_make_microbatches_budget_and_cover(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 513, (40,), generator=g).tolist()
    mbs = make_microbatches(lengths, 2048)
    assert sorted(i for mb in mbs for i in mb) == list(range(40))
    for mb in mbs:
        assert len(mb) * max(lengths[i] for i in mb) <= 2048
    sorted_frac = padding_fraction(lengths, mbs)
    fixed = [list(range(s, s + len(mbs[0]))) for s in range(0, 40, len(mbs[0]))]
    assert 0.0 <= sorted_frac < padding_fraction(lengths, fixed)
    assert make_microbatches([5000, 10], 100) == [[0], [1]]  # over-long row alone
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        make_microbatches(lengths, 0)


def test_varlen_fallback_equals_per_sequence_float64(monkeypatch):
    monkeypatch.setattr(varlen, "USE_FLASH_ATTN", False)
    torch.manual_seed(0)
    lengths = [7, 1, 12, 4]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths), 4, 8, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths), 2, 8, dtype=torch.float64) for _ in range(2))
    out = varlen.varlen_attention(q, k, v, cu, max(lengths))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk, vv = (t[s:e].repeat_interleave(2, dim=1).transpose(0, 1) for t in (k, v))
        ref = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), kk, vv, is_causal=True)
        torch.testing.assert_close(out[s:e], ref.transpose(0, 1), rtol=0, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_matches_fallback():
    if varlen._flash_varlen_func() is None:
        pytest.skip("flash-attn not installed")
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 17, 20], dtype=torch.int32, device="cuda")
    q = torch.randn(20, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(20, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fast = varlen.varlen_attention(q, k, v, cu, 12)
    varlen.set_flash_attn_enabled(False)
    try:
        slow = varlen.varlen_attention(q, k, v, cu, 12)
    finally:
        varlen.set_flash_attn_enabled(True)
    torch.testing.assert_close(fast.float(), slow.float(), rtol=2e-2, atol=2e-2)
