"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), as transformers computes them.

The residual stream is ``hc_mult`` parallel streams ``X [B, S, N, H]``. Before a block
(attention or MoE) a :class:`HyperConnection` reads all N streams (flattened, unweighted-RMS
normed, one float32 linear) and returns

- ``collapsed [B, S, H]``: the block's input, ``sum_n pre_n X_n`` (``pre = sigmoid(.) + eps``);
- ``post [B, S, N]``: how the block's output is spread back (``2 sigmoid(.)``);
- ``comb [B, S, N, N]``: a Sinkhorn-normalised (near doubly stochastic) mixing of the input
  streams (one column normalisation, then ``hc_sinkhorn_iters - 1`` row + column rounds);

and the layer forms ``X_k <- post_k * block(collapsed) + sum_j comb[j, k] X_j``.
:class:`HyperHead` collapses the N streams once more before the final norm. Every
parameter is a plain engine-dtype tensor loaded by copy (``fn``, ``base``, ``scale``,
``hc_fn``, ``hc_base``, ``hc_scale``: transformers' names); the math runs in float32.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.rollout.layers.norm import copy_loader


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` over the last dim; the rsqrt is computed in float32 and
    cast to x's dtype *before* the multiply (transformers' ``DeepseekV4UnweightedRMSNorm``)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def loaded_param(*shape, dtype, device) -> nn.Parameter:
    """A plain engine tensor loaded by copy (routed under its Hugging Face name)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = copy_loader
    return p


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 dtype, device):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = loaded_param((2 + n) * n, n * hidden_size, dtype=dtype, device=device)
        self.base = loaded_param((2 + n) * n, dtype=dtype, device=device)
        self.scale = loaded_param(3, dtype=dtype, device=device)
        # which of the 3 scales (pre, post, comb) each of the (2 + n) * n mixes takes; a constant
        # of the shape, not of the weights (refit never touches it)
        self.register_buffer("scale_index", torch.tensor([0] * n + [1] * n + [2] * n * n, device=device),
                             persistent=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, N, H] -> (post [B, S, N] fp32, comb [B, S, N, N] fp32, collapsed [B, S, H])."""
        B, S = streams.shape[:2]
        n, eps = self.n, self.hc_eps
        mixes = F.linear(unweighted_rms_norm(streams.reshape(B, S, -1).float(), self.norm_eps), self.fn.float())
        # each mix times its group's scale plus its base, all (2 + n) * n at once: per element
        # the same multiply and add as one group at a time (bitwise), in 3 ops instead of 9
        z = mixes * self.scale[self.scale_index] + self.base
        pre = torch.sigmoid(z[..., :n]) + eps
        post = 2 * torch.sigmoid(z[..., n:2 * n])
        comb = torch.softmax(z[..., 2 * n:].view(B, S, n, n), dim=-1) + eps
        sinkhorn_(comb, self.iters, eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


# At most this many N x N matrices go through numpy on the CPU (a decode step's B rows);
# numpy's per-row reductions grow faster than torch's (2 cores, N = 4, 20 iterations, numpy
# vs torch: 4 matrices 85 vs 182 us, 32: 168 vs 223, 64: even, 128: 435 vs 347).
NUMPY_SINKHORN_MAX = 32


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-normalise ``comb [..., N, N]`` (float32, this call's own tensor) in place: one
    column round, then ``iters - 1`` row + column rounds, each ``x / (sum + eps)``.

    Every op is a few N x N matrices, so on the CPU the cost is per-op dispatch (~2 us in
    torch, 117 ops at 20 iterations, 12 calls per V4 decode step ~ 1/3 of a step's ops):
    small batches run the same ops in numpy on the same memory (~0.7 us each), bitwise equal
    to torch's for N <= 4 (V4's hc_mult is 4): the same float32 adds in order and divide
    (``tests/rollout/test_v4_decode_fastpaths.py``; at N = 5..8 the two sum in another order
    and differ in the last bit, so those take torch). Elsewhere: torch, in place (no
    allocation per op)."""
    n = comb.shape[-1]
    if comb.device.type == "cpu" and comb.dtype == torch.float32 and n <= 4 and comb.is_contiguous() and \
            comb.numel() <= NUMPY_SINKHORN_MAX * n * n:
        a, e = comb.numpy(), np.float32(eps)  # a view: the in-place ops write comb
        total = np.add.reduce  # ndarray.sum without its Python wrapper (~10% less per call)
        a /= total(a, -2, keepdims=True) + e
        for _ in range(iters - 1):
            a /= total(a, -1, keepdims=True) + e
            a /= total(a, -2, keepdims=True) + e
        return comb
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return comb


def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The layer's stream update: ``post_k * block_out + sum_j comb[j, k] streams_j`` -> [B, S, N, H]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                  streams)


class HyperHead(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float, dtype, device):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = loaded_param(hc_mult, hc_mult * hidden_size, dtype=dtype, device=device)
        self.hc_base = loaded_param(hc_mult, dtype=dtype, device=device)
        self.hc_scale = loaded_param(1, dtype=dtype, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [B, S, N, H] -> [B, S, H]."""
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
