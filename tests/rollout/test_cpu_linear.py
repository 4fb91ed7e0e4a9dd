"""The engine's CPU linear: oneDNN for large weights, F.linear otherwise, same values."""
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from hybridrl.rollout.layers import cpu_linear

needs_onednn = pytest.mark.skipif(not cpu_linear._onednn_serves(torch.float32), reason="no oneDNN in this build")


def _ops(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@needs_onednn
@pytest.mark.parametrize("with_bias", [False, True])
def test_large_weight_runs_onednn_and_matches_f_linear(with_bias):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = torch.randn(1200, 2 * 512, generator=g)[:, 1::2]  # strided [N, K] view of a bigger tensor
    x = torch.randn(3, 2, 512, generator=g)
    bias = torch.randn(1200, generator=g) if with_bias else None
    assert weight.numel() >= cpu_linear.ONEDNN_MIN_WEIGHT_ELEMENTS
    with torch.inference_mode():
        ops = _ops(lambda: cpu_linear.linear(x, weight, bias))
        y = cpu_linear.linear(x, weight, bias)
    assert "mkldnn::_linear_pointwise" in ops
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_small_weight_and_autograd_use_f_linear():
    x, small = torch.randn(4, 64), torch.randn(32, 64)
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: cpu_linear.linear(x, small))
    big = torch.randn(1024, 512)
    xg = torch.randn(2, 512, requires_grad=True)
    y = cpu_linear.linear(xg, big)
    assert y.grad_fn is not None  # F.linear: differentiable
    y.sum().backward()
    torch.testing.assert_close(xg.grad, big.sum(0).expand(2, -1), rtol=1e-4, atol=1e-4)
