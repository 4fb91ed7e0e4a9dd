"""CUDA-graph capture and replay of the decode step (CUDA only).

Capture happens once, at the engine's first complete weight update, for a fixed set of
batch sizes (largest first, all sharing one memory pool, as nano-vllm does). A batch of
B rows replays the graph of the smallest captured size >= B; rows [B, size) are padding
that write into cache rows nobody reads. A graph records raw addresses, so everything it
touches is allocated once here or at construction and only ever written in place: the
static input buffers below, the KV cache, the rope tables, the weights (refit copies into
them) and `logits`. Each graph runs the step with kv_len = max_seq_len, so its shapes
never depend on the step; the decode attention then either reads each row's own length
from the device (`cache_seqlens`, flash-attn: cost ~ the live length) or masks the unused
slots (the SDPA fallback: cost ~ max_seq_len), see ``layers/attention.py``.

**The engine's device, everywhere.** Kernels go to the *current stream of the device
their tensors live on*, but a capture only records the stream it was begun on. An
engine on ``cuda:N`` (N != 0; one engine per device in a multi-process job) whose graph
were captured on the current device's stream (``cuda:0`` unless someone switched) would
record an empty graph, and every replay would return stale logits, silently. So capture
and replay run inside ``torch.cuda.device(dev)``, the capture stream is created on
``dev`` (``torch.cuda.graph``'s default side stream is one process-wide stream made on
whatever device was current first), and every drain is ``torch.cuda.synchronize(dev)``.
``tests/rollout/test_cuda_graph_device.py`` checks that call order with fakes on CPU.
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
        self.device = torch.device(runner.device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"CUDA graphs need a CUDA device with an index, got {self.device} "
                             "(RolloutEngine resolves 'cuda' to the current device)")
        self.batch_sizes = sorted(batch_sizes)
        n, vocab = max(batch_sizes), runner.model.config.vocab_size
        where = runner.slot_ids.device  # next to the runner's other static tensors (on self.device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=where)
        self.positions = torch.zeros(n, dtype=torch.long, device=where)
        self.logits = torch.zeros(n, vocab, dtype=torch.float32, device=where)
        # vision-language: each row's rope offset (rotary position = slot + delta), static like the rest
        self.rope_deltas = torch.zeros(n, dtype=torch.long, device=where) if runner.vl is not None else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # graph launches so far (checked by scripts/gpu_check.sh's end-to-end run)
        self.stream = None  # the capture stream, on self.device (kept alive with the graphs)
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        dev = self.device
        with torch.cuda.device(dev):
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))  # weights just written on it
            pool = None
            for bs in reversed(self.batch_sizes):
                # Warm-up outside the graph, on the capture stream: lazy cuBLAS / kernel /
                # torch.compile initialization must not happen inside a capture.
                with torch.cuda.stream(stream):
                    self._step(bs)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._step(bs)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
            torch.cuda.synchronize(dev)
        self.stream = stream

    def _step(self, bs: int) -> None:
        deltas = {} if self.rope_deltas is None else {"rope_deltas": self.rope_deltas[:bs]}
        out = self.runner.decode_eager(self.input_ids[:bs], self.positions[:bs], self.runner.max_seq_len, **deltas)
        self.logits[:bs].copy_(out)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor,
               rope_deltas: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions [B] (and a vision-language model's rope deltas [B]) -> logits
        [B, V] float32 (a view of the static output buffer)."""
        B = tokens.shape[0]
        bs = next(b for b in self.batch_sizes if b >= B)
        with torch.cuda.device(self.device):  # the copies and the launch on dev's current stream
            self.input_ids[:B].copy_(tokens)
            self.positions[:B].copy_(positions)
            self.positions[B:bs].zero_()  # padding rows: a valid slot in an unused cache row
            if self.rope_deltas is not None:
                self.rope_deltas[:B].copy_(rope_deltas)
                self.rope_deltas[B:bs].zero_()
            self.graphs[bs].replay()
        self.replays += 1
        return self.logits[:B]

    def named_tensors(self):
        yield "cuda_graph.input_ids", self.input_ids
        yield "cuda_graph.positions", self.positions
        yield "cuda_graph.logits", self.logits
        if self.rope_deltas is not None:
            yield "cuda_graph.rope_deltas", self.rope_deltas
