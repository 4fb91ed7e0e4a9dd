"""CUDA-graph capture and replay of the decode step (CUDA only).

Capture happens once, at engine start, for a fixed set of batch sizes (largest first,
all sharing one memory pool, as nano-vllm does). A batch of B rows replays the graph of
the smallest captured size >= B; rows [B, size) are padding that write into cache rows
nobody reads. A graph records raw addresses, so everything it touches is allocated once
here or at construction and only ever written in place: the static input buffers below,
the KV cache, the rope tables, the weights (refit copies into them) and `logits`.
Each graph attends over all max_seq_len slots (the mask hides unwritten ones), so the
shape never depends on the step.
"""

from __future__ import annotations

import torch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in DEFAULT_BATCH_SIZES if b < max_batch_size]
    return sizes + [max_batch_size]


class CudaGraphRunner:
    def __init__(self, runner, batch_sizes: list[int]):
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        n, vocab, device = max(batch_sizes), runner.model.config.vocab_size, runner.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.logits = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):
            self._step(bs)  # warm-up outside the graph: lazy cuBLAS/kernel init must not be captured
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _step(self, bs: int) -> None:
        out = self.runner.decode_eager(self.input_ids[:bs], self.positions[:bs], self.runner.max_seq_len)
        self.logits[:bs].copy_(out)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B] -> logits [B, V] float32 (a view of the static output buffer)."""
        B = tokens.shape[0]
        bs = next(b for b in self.batch_sizes if b >= B)
        self.input_ids[:B].copy_(tokens)
        self.positions[:B].copy_(positions)
        self.positions[B:bs].zero_()  # padding rows: a valid slot in an unused cache row
        self.graphs[bs].replay()
        return self.logits[:B]

    def named_tensors(self):
        yield "cuda_graph.input_ids", self.input_ids
        yield "cuda_graph.positions", self.positions
        yield "cuda_graph.logits", self.logits
