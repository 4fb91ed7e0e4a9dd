"""GPU: decode graphs captured once stay valid across refits (bf16 and FP8 engines), and a
refit-only start (no load_weights) captures them too.

Comparisons: replay vs eager *at the same batch size* (the captured size 4, padding rows
included) must be bitwise equal — same kernels on the same shapes. Across sizes (3 rows
replayed through the size-4 graph vs eager on 3 rows) cuBLAS may pick another GEMM kernel
for M=3 than for M=4, so that is compared with a stated tolerance: bf16 logits within
TOL_ACROSS_SIZES * (max|eager| + |eager|) (a few bf16 roundings, 2^-8 relative each,
through 2 layers and the head).
"""
import pytest
import torch

from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine
from tests.refit.helpers import hf_model, perturb, qwen2_config

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL_ACROSS_SIZES = 3e-2
PADDED = 4  # the captured size that 3 rows replay through


def _compare(runner, tokens, positions):
    """Replay vs eager: bitwise at the padded size, within tolerance across sizes; returns the replay."""
    B = tokens.shape[0]
    pad = PADDED - B
    tokens_p = torch.cat([tokens, tokens.new_zeros(pad)])
    positions_p = torch.cat([positions, positions.new_zeros(pad)])
    replay_p = runner.graphs.replay(tokens_p, positions_p).clone()
    with torch.inference_mode():
        eager_p = runner.decode_eager(tokens_p, positions_p, runner.max_seq_len)
    torch.testing.assert_close(replay_p, eager_p, atol=0, rtol=0)  # same size: bitwise
    replay = runner.graphs.replay(tokens, positions).clone()  # 3 rows through the size-4 graph
    with torch.inference_mode():
        eager = runner.decode_eager(tokens, positions, runner.max_seq_len)  # M = 3
    torch.testing.assert_close(replay, eager, rtol=TOL_ACROSS_SIZES,
                               atol=TOL_ACROSS_SIZES * float(eager.abs().max()))
    return replay


@pytest.mark.parametrize("quantization", [None, "fp8", "fp8_block"])
def test_graph_replay_equals_eager_after_each_refit(quantization):
    cfg = qwen2_config()
    hf = hf_model(cfg).float()
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32, dtype=torch.bfloat16, device="cuda",
                                        quantization=quantization))
    eng.load_weights((n, p.detach().cuda()) for n, p in hf.named_parameters())  # captures graphs
    runner = eng.runner
    assert runner.graphs is not None
    tokens = torch.tensor([5, 7, 11], device="cuda")
    positions = torch.zeros(3, dtype=torch.long, device="cuda")
    previous = None
    for k in range(3):
        perturb(hf, seed=k)
        refit_from_model(eng, [(n, p.detach().cuda()) for n, p in hf.named_parameters()], verify=True)
        replay = _compare(runner, tokens, positions)
        if previous is not None:
            assert not torch.equal(replay, previous), "graph kept reading the old weights"
        previous = replay


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_refit_only_start_captures_graphs(quantization):
    """No load_weights: the first (verified, CUDA-tensor) refit is the first complete update."""
    cfg = qwen2_config()
    hf = hf_model(cfg).float()
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=32, dtype=torch.bfloat16, device="cuda",
                                        quantization=quantization))
    refit_from_model(eng, [(n, p.detach().cuda()) for n, p in hf.named_parameters()], verify=True)
    graphs = eng.runner.graphs
    assert graphs is not None, "a refit-only start must capture the decode graphs"
    perturb(hf, seed=7)
    refit_from_model(eng, [(n, p.detach().cuda()) for n, p in hf.named_parameters()], verify=True)
    assert eng.runner.graphs is graphs, "captured once, never again"
    tokens = torch.tensor([5, 7, 11], device="cuda")
    positions = torch.zeros(3, dtype=torch.long, device="cuda")
    _compare(eng.runner, tokens, positions)
