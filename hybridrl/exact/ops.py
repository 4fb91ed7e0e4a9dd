"""Batch-invariant numerics on CPU: a torch function mode under which one row's result
never depends on how many rows were computed with it, or where in the tensor it sat.

Why each op needs it (measured on torch 2.13 CPU, MKL / oneDNN, 2 threads):

- ``F.linear``: MKL's GEMM picks its kernel and blocking from the shape. On an AVX2 host
  (AMD EPYC) M in 1-7 and 9 gave other bits than the same rows inside M >= 16 while every
  multiple of 16 agreed; on an AVX-512 host (Intel Xeon with AMX) *no* two row counts
  agreed at Qwen2.5-0.5B's widths (K = 896: 1, 16, 100 rows vs 720, float32 and bf16),
  although the small models' widths did. What holds on both: one GEMM shape. So the rows
  are zero-padded to a multiple of ``GEMM_TILE`` and computed ``GEMM_TILE`` rows per call
  (``padded_linear``): a decode step of 3 rows and the trainer's 4000 run the same
  ``[GEMM_TILE, K] x [K, N]`` kernel on every tile, and a row's bits do not depend on its
  place in the tile (probed). The backward is one GEMM per gradient (its values need not
  match anything). Cost (Qwen2.5-0.5B's MLP, 720 rows, AVX-512): 1.9x one whole GEMM;
  a 3-row decode step pays for 32 rows.
- transcendental elementwise ops (silu, sigmoid, cos, sin, ...): torch's vectorized
  loop computes the tail of a buffer (and of each thread's chunk) with the scalar
  formula, which differs from the SIMD one in the last bit for ~4% of inputs; so the
  same value gets other bits at another offset. They run here on buffers padded to a
  whole number of ``UNARY_PIECE`` elements, one piece per call: every element takes the
  SIMD path.
- ``logsumexp`` / ``log_softmax`` / ``softmax``: over the vocabulary one row alone is split
  across threads, many rows are not. All of them run as fixed ``VOCAB_PIECE``-wide partial
  reductions (one piece for shorter rows), combined in a fixed order, so the engine's
  sampler and the trainer's scorer compute the same ``z - logsumexp(z)``.

- a patch embedding (``Conv3d`` / ``Conv2d`` whose kernel covers its whole input: the vision
  towers of Qwen2.5-VL / Qwen3-VL, kernel == stride): oneDNN's convolution picks its kernel
  from the patch count too (bf16, 1280 filters of 3x2x14x14: 4 patches alone gave other bits
  than inside 1500). It runs as ``padded_linear`` over the flattened patches (``patch_conv``),
  on both sides alike.

Everything else (embedding lookups, elementwise add/mul/div, short-row means, bmm over
fixed shapes) is already shape-independent here; ``check_batch_invariance`` probes the
ops that matter on this machine and says so in one line if the BLAS disagrees.
Backward passes are untouched (autograd dispatches below the mode): only forward values
must match.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hybridrl.rollout.layers import cpu_linear

ROW_TILE = 16  # attention query rows are padded to a multiple of it (attention.py)
GEMM_TILE = 32  # rows per F.linear call
UNARY_PIECE = 16384  # elements per call: a multiple of every SIMD width, below torch's grain (32768)
VOCAB_PIECE = 2048   # columns per partial reduction of a long row

_UNARY = {
    F.silu: F.silu, torch.sigmoid: torch.sigmoid, torch.Tensor.sigmoid: torch.sigmoid,
    torch.exp: torch.exp, torch.Tensor.exp: torch.exp, torch.cos: torch.cos, torch.Tensor.cos: torch.cos,
    torch.sin: torch.sin, torch.Tensor.sin: torch.sin, torch.tanh: torch.tanh, torch.Tensor.tanh: torch.tanh,
    torch.rsqrt: torch.rsqrt, torch.Tensor.rsqrt: torch.rsqrt, torch.log: torch.log, torch.Tensor.log: torch.log,
    F.gelu: F.gelu, torch.erf: torch.erf, torch.Tensor.erf: torch.erf,
}
_SOFTMAX = {torch.log_softmax: True, F.log_softmax: True, torch.Tensor.log_softmax: True,
            torch.softmax: False, F.softmax: False, torch.Tensor.softmax: False}  # -> is log

_state = threading.local()


def active() -> bool:
    """Whether this thread runs under :func:`batch_invariant`."""
    return getattr(_state, "depth", 0) > 0


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the rows (all leading dims flattened) zero-padded to a multiple of
    ``GEMM_TILE`` and computed one ``GEMM_TILE``-row GEMM at a time; differentiable."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    flat = x.reshape(rows, k)
    pad = -rows % GEMM_TILE
    if pad or rows == 0:
        pad = pad or GEMM_TILE
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    out = _TiledLinear.apply(flat, weight, bias)
    return out[:rows].reshape(*lead, out.shape[-1])


class _TiledLinear(torch.autograd.Function):
    """Forward: one GEMM per ``GEMM_TILE`` rows (``flat`` has a multiple of them). Backward:
    one GEMM per gradient, as ``F.linear``'s (only forward values must be batch-invariant)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # the input is kept only for the weight's gradient (a frozen LoRA base needs none)
        ctx.save_for_backward(flat if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        # (no graph: a Function) oneDNN's inner product for large weights, as the engine's default path
        return torch.cat([cpu_linear.linear(tile, weight, bias) for tile in flat.split(GEMM_TILE)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ flat if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def patch_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0,
               dilation=1, groups: int = 1) -> torch.Tensor | None:
    """``F.conv2d`` / ``F.conv3d`` of a kernel that covers the whole input (one output per
    input: a patch embedding) as ``padded_linear`` over the flattened patches; None for any
    other convolution (left to torch)."""
    spatial = weight.dim() - 2
    flat_pad = [padding] if isinstance(padding, (int, str)) else list(padding)
    flat_dil = [dilation] if isinstance(dilation, int) else list(dilation)
    whole = (x.dim() == weight.dim() and tuple(x.shape[2:]) == tuple(weight.shape[2:]) and groups == 1
             and all(p in (0, "valid") for p in flat_pad) and all(d == 1 for d in flat_dil))
    if not whole:
        return None
    out = padded_linear(x.reshape(x.shape[0], -1), weight.reshape(weight.shape[0], -1), bias)
    return out.view(x.shape[0], weight.shape[0], *([1] * spatial))


def pieced_unary(fn, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``fn(x)`` elementwise with every element on the SIMD path (see the module doc)."""
    n = x.numel()
    if n == 0 or not x.is_floating_point():
        return fn(x, *args, **kwargs)
    flat = x.reshape(-1)
    pad = -n % UNARY_PIECE if n > UNARY_PIECE else -n % 64
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    pieces = [fn(p, *args, **kwargs) for p in flat.split(UNARY_PIECE)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:n].view(x.shape)


def exact_logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """``logsumexp`` over ``dim`` computed as ``VOCAB_PIECE``-wide partial sums in a fixed
    order: a row's value does not depend on the other rows."""
    dim = dim % x.dim()
    if dim != x.dim() - 1:
        moved = exact_logsumexp(x.movedim(dim, -1), -1, keepdim)
        return moved.movedim(-1, dim) if keepdim else moved
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows stay -inf below
    z = x - m
    n = z.shape[-1]
    piece = VOCAB_PIECE if n > VOCAB_PIECE else n + (-n % 64)  # a function of the row length only
    pad = -n % piece
    if pad:
        z = torch.cat([z, z.new_full((*z.shape[:-1], pad), float("-inf"))], dim=-1)
    parts = pieced_unary(torch.exp, z).unflatten(-1, (-1, piece)).sum(-1)  # (..., pieces)
    out = parts.sum(-1, keepdim=True).log() + m
    return out if keepdim else out.squeeze(-1)


def exact_log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x - exact_logsumexp(x, dim, keepdim=True)


def exact_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return pieced_unary(torch.exp, exact_log_softmax(x, dim))


class BatchInvariantMode(TorchFunctionMode):
    """Routes the ops named in the module doc to their batch-invariant forms."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return padded_linear(*args, **kwargs)
        if func in (F.conv2d, F.conv3d):
            out = patch_conv(*args, **kwargs)
            if out is not None:
                return out
        unary = _UNARY.get(func)
        if unary is not None:
            x, *rest = args
            return pieced_unary(unary, x, *rest, **kwargs)
        if func in (torch.logsumexp, torch.Tensor.logsumexp):
            x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else -1)
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            if not isinstance(dim, (tuple, list)) or len(dim) == 1:
                return exact_logsumexp(x, dim[0] if isinstance(dim, (tuple, list)) else dim, keepdim)
        if func in _SOFTMAX:
            x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            dtype = kwargs.get("dtype")
            at = 3 if func in (F.softmax, F.log_softmax) else 2  # F.*(input, dim, _stacklevel, dtype)
            dtype = args[at] if dtype is None and len(args) > at else dtype
            if dim is not None and x.is_floating_point():
                x = x.to(dtype) if dtype is not None else x
                return exact_log_softmax(x, dim) if _SOFTMAX[func] else exact_softmax(x, dim)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the block with batch-invariant numerics (nests; thread-local)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with BatchInvariantMode():
            yield
    finally:
        _state.depth -= 1


class BatchInvarianceError(RuntimeError):
    """This machine's kernels give a row other bits in another batch even in the padded form."""


def check_batch_invariance(dtype: torch.dtype, hidden: int = 256, seed: int = 0, device="cpu") -> None:
    """Probe the row-padded GEMM and the batched attention GEMM on this machine's kernels in
    ``dtype``: rows computed alone, inside a few rows and inside many must carry the same
    bits. Raises :class:`BatchInvarianceError` (one line) when they do not."""
    g = torch.Generator().manual_seed(seed)
    for k in (hidden, 896):  # 896: a width where the AVX-512 GEMM varied with the row count (module doc)
        w = torch.randn(3 * k, k, generator=g).to(device, dtype)
        x = torch.randn(300, k, generator=g).to(device, dtype)
        many = padded_linear(x, w)
        for rows, start in ((1, 0), (3, 0), (9, 0), (17, 0), (40, 5), (40, 11)):
            if not torch.equal(padded_linear(x[start:start + rows], w), many[start:start + rows]):
                raise BatchInvarianceError(
                    f"rollout.exact: this machine's {device} {dtype} GEMM gives rows {start}..{start + rows - 1} other "
                    f"bits than the same rows among 300, even in {GEMM_TILE}-row tiles; exact mode cannot hold here "
                    "(set rollout.exact=false)")
    q = torch.randn(4, 8 * ROW_TILE, 32, generator=g).to(device, dtype)
    k = torch.randn(4, 32, 64, generator=g).to(device, dtype)
    if not torch.equal(torch.matmul(q[:1, :ROW_TILE], k[:1]), torch.matmul(q, k)[:1, :ROW_TILE]):
        raise BatchInvarianceError(f"rollout.exact: this machine's batched {dtype} GEMM depends on the batch; "
                                   "exact mode cannot hold here (set rollout.exact=false)")
