"""RolloutEngine: the public face of the built-in rollout engine (see docs/interfaces.md)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from hybridrl.rollout.generation import Request, run_batch
from hybridrl.rollout.layers.linear import LinearBase, get_linear_method
from hybridrl.rollout.model_config import parse_hf_config
from hybridrl.rollout.model_runner import ModelRunner
from hybridrl.rollout.models.decoder import DecoderForCausalLM
from hybridrl.rollout.rollouts import Rollouts, build_rollouts
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.rollout.weight_loading import iter_safetensors_dir, load_weights


class RolloutEngine:
    """Fused-weight Llama/Qwen2/Qwen3 decoder + static KV cache + sampler (+ CUDA graphs).

    Weights are uninitialized until `load_weights` (or `from_pretrained`).
    """

    def __init__(self, hf_config: Any, *, max_batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quantization: str | None = None, enforce_eager: bool = False, compile_decode: bool = False):
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"RolloutEngine: max_batch_size={max_batch_size} must be >= 1 and "
                             f"max_seq_len={max_seq_len} >= 2")
        if isinstance(hf_config, str):
            from transformers import AutoConfig
            hf_config = AutoConfig.from_pretrained(hf_config, local_files_only=True)
        self.hf_config = hf_config
        self.config = parse_hf_config(hf_config)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.pad_token_id = getattr(hf_config, "pad_token_id", None) or 0
        self.model = DecoderForCausalLM(self.config, get_linear_method(quantization), max_seq_len,
                                        dtype, self.device)
        # compile_decode: torch.compile the eager decode step (CPU, or CUDA with enforce_eager).
        self.runner = ModelRunner(self.model, max_batch_size, max_seq_len, dtype, self.device, compile_decode)
        self.weight_version = 0
        # Drop finished rows from the decode batch (measured in benchmarks/rollout.py,
        # "compaction" row); off only to measure what it buys.
        self.compact_finished_rows = True
        self._use_graphs = self.device.type == "cuda" and not enforce_eager

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "RolloutEngine":
        """Config + safetensors weights from a local Hugging Face checkpoint directory."""
        from transformers import AutoConfig
        engine = cls(AutoConfig.from_pretrained(path, local_files_only=True), **kwargs)
        engine.load_weights(iter_safetensors_dir(path))
        return engine

    # ---- weights -------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors -> in-place copies through each parameter's weight_loader.

        The first load also captures the CUDA graphs (they need real weights to warm up);
        later loads (refits) keep every address the graphs hold.
        """
        loaded = load_weights(self.model, named_tensors)
        self.weight_version += 1
        if self._use_graphs and self.runner.graphs is None:
            from hybridrl.rollout.cuda_graph import graph_batch_sizes
            self.runner.capture_cuda_graphs(graph_batch_sizes(self.max_batch_size))
        return loaded

    def expected_weight_names(self) -> set[str]:
        # the name set is fixed at construction: compute it once (refit validates often)
        if getattr(self, "_expected_names", None) is None:
            self._expected_names = frozenset(self.model.hf_weight_names())
        return set(self._expected_names)

    def weight_spec(self, hf_name: str) -> tuple[torch.Size, torch.dtype]:
        """(HF shape before fusion, engine dtype) of the tensor the trainer must send for `hf_name`."""
        self.expected_weight_names()
        if hf_name not in self._expected_names:
            raise ValueError(f"weight_spec: {hf_name!r} is not a weight of this rollout model")
        name, shard_id = self.model.resolve(hf_name)
        module_name, leaf = name.rsplit(".", 1)
        module = self.model.get_submodule(module_name)
        if isinstance(module, LinearBase):
            return module.shard_shape(shard_id, leaf), self.dtype
        return self.model.get_parameter(name).shape, self.dtype

    def named_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, buffer, KV-cache and CUDA-graph tensor the engine holds."""
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()
        yield from self.runner.named_state_tensors()

    # ---- inference -----------------------------------------------------------------
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B, S] -> logits [B, S, V] float32 (no KV cache)."""
        if input_ids.shape[1] > self.max_seq_len:
            raise ValueError(f"logits: sequence length {input_ids.shape[1]} exceeds max_seq_len="
                             f"{self.max_seq_len}; build the engine with a larger max_seq_len")
        return self.runner.logits(input_ids.to(self.device), attention_mask.to(self.device))

    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> Rollouts:
        """Sample a response for every prompt (n per prompt); see `Rollouts` for the layout."""
        requests = self._make_requests(prompt_token_ids, params or SamplingParams())
        cpu = self.device.type == "cpu"
        sync_every, compact_at = (1, 7 / 8) if cpu else (8, 1 / 2)
        if not self.compact_finished_rows:
            compact_at = 0.0
        results = []
        for i in range(0, len(requests), self.max_batch_size):
            chunk = requests[i:i + self.max_batch_size]
            results += run_batch(self.runner, chunk, self.config.vocab_size, sync_every, compact_at)
        return build_rollouts([r.prompt for r in requests], [t for t, _, _ in results],
                              [lp for _, lp, _ in results], [f for _, _, f in results],
                              self.weight_version, self.pad_token_id)

    def _make_requests(self, prompts: list[list[int]], params) -> list[Request]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: got {len(params)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one SamplingParams or one per prompt")
        requests = []
        for prompt, p in zip(prompts, params):
            prompt = [int(t) for t in prompt]
            self._check_prompt(prompt)
            max_new = min(p.max_tokens, self.max_seq_len - len(prompt))
            for j in range(p.n):
                requests.append(Request(prompt, p, _request_seed(p.seed, j), max_new))
        return requests

    def _check_prompt(self, prompt: list[int]) -> None:
        if not 0 < len(prompt) < self.max_seq_len:
            raise ValueError(f"generate: prompt length {len(prompt)} must be in [1, max_seq_len="
                             f"{self.max_seq_len}); shorten the prompt or raise max_seq_len")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            raise ValueError(f"generate: prompt token ids must be in [0, vocab_size={self.config.vocab_size})")


def _request_seed(seed: int | None, j: int) -> int:
    """Seed of the j-th sample of a request; unseeded requests draw from torch's global RNG."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)))
    return seed if j == 0 else (seed * 1_000_003 + j) % 2**62
