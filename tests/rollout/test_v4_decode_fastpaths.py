"""DeepSeek-V4 decode fast paths (issue #46) are bitwise the plain formulas they replace.

- ``sinkhorn_``: numpy for small CPU batches, torch in place otherwise; both equal the
  out-of-place ``comb / (sum + eps)`` rounds transformers runs;
- ``rotate_tail`` with ``V4Rotary.tables``' signed sin (one flip) equals the
  negate-and-interleave rotation with plain tables;
- ``HyperConnection``'s scale/base applied to all mixes at once equals the per-group form.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridrl.rollout.models.deepseek_v4 import hyper_connection as hc
from hybridrl.rollout.models.deepseek_v4.attention import rotate_tail

EPS = 1e-6


def _sinkhorn_reference(comb: torch.Tensor, iters: int) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    return comb


@pytest.mark.parametrize("numpy_max", [0, hc.NUMPY_SINKHORN_MAX])
def test_sinkhorn_paths_are_bitwise_the_reference(monkeypatch, numpy_max):
    monkeypatch.setattr(hc, "NUMPY_SINKHORN_MAX", numpy_max)
    g = torch.Generator().manual_seed(0)
    for i in range(600):
        n, rows, iters = 2 + i % 7, 1 + i % 40, (3, 20)[i % 2]  # n > 4 takes torch's path
        comb = torch.softmax(torch.randn(rows, 1, n, n, generator=g) * (0.1 + i % 7), -1) + EPS
        want = _sinkhorn_reference(comb, iters)
        got = hc.sinkhorn_(comb.clone(), iters, EPS)
        assert torch.equal(got, want), (n, rows, iters)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_tail_is_the_negate_and_interleave_rotation(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 5, 24, generator=g).to(dtype)
    angle = torch.randn(5, 4, generator=g)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    rope = x[..., -8:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    c2, s2 = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    want = torch.cat([x[..., :-8], (rope.float() * c2 + half.float() * s2).to(dtype)], dim=-1)
    signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
    assert torch.equal(rotate_tail(x, c2, signed), want)
    want_conj = torch.cat([x[..., :-8], (rope.float() * c2 + half.float() * -s2).to(dtype)], dim=-1)
    assert torch.equal(rotate_tail(x, c2, -signed), want_conj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connection_mixes_are_the_per_group_form(dtype):
    n, H, eps = 4, 16, 1e-6
    m = hc.HyperConnection(n, H, 20, eps, 1e-6, dtype, "cpu")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in (m.fn, m.base, m.scale):
            p.copy_(torch.randn(p.shape, generator=g))
    streams = torch.randn(2, 3, n, H, generator=g).to(dtype)
    post, comb, collapsed = m(streams)
    mixes = F.linear(hc.unweighted_rms_norm(streams.reshape(2, 3, -1).float(), 1e-6), m.fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = m.base.split([n, n, n * n])
    s_pre, s_post, s_comb = m.scale.unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    assert torch.equal(post, 2 * torch.sigmoid(post_w * s_post + post_b))
    want = torch.softmax(comb_w.view(2, 3, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
    assert torch.equal(comb, _sinkhorn_reference(want, 20))
    assert torch.equal(collapsed, (pre.unsqueeze(-1) * streams).sum(dim=2).to(dtype))
