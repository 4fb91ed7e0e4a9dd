"""RolloutEngine: the public face of the built-in rollout engine (see docs/interfaces.md).

Requests (``requests.py``): ``add_request`` / ``step`` / ``abort`` over the continuous-
batching scheduler (``core/scheduler.py``); ``generate`` is a loop over them. A weight update
waits for the step in flight (one lock), holds every in-flight request while it is open
(``step`` refuses; ``add_request`` queues), and after the commit the requests continue
(their KV recomputed with the new weights, or kept: ``kv_on_refit``).

Weights change only through the engine's own weight-update bracket (``weight_update.py``):
``begin_weight_update()`` -> ``load_weights(bucket)``* -> ``finish_weight_update(version=)``.
The engine records the ``weight_version`` it is handed (+1 when none is) and captures its
CUDA graphs at the first complete update, whichever path it came through (a first
``load_weights``, ``from_pretrained`` or a refit).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from hybridrl.data.vision import ImageInputs, RowImages
from hybridrl.rollout.layers.lora_adapter import adapter_dtype
from hybridrl.rollout.backend import EngineSpec, WeightUpdateBracket, expand_requests, next_weight_version
from hybridrl.rollout.derived import DerivedCache, named_derived_caches
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.tensor_parallel import SINGLE, TensorParallel
from hybridrl.rollout.core.memory import EngineMemory, check_fits
from hybridrl.rollout.model_config import parse_hf_config
from hybridrl.rollout.core.model_runner import ModelRunner
from hybridrl.rollout.models.decoder.model import DecoderForCausalLM
from hybridrl.rollout.requests import RequestOutput, StepOutput
from hybridrl.rollout.rollouts import Rollouts, rollouts_from_outputs
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.rollout.core.scheduler import Scheduler
from hybridrl.rollout.weight_routes import WeightRoutes
from hybridrl.rollout.weight_update import WeightUpdate, WeightUpdateError

DEFAULT_MAX_PREFILL_TOKENS = 2048
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20
DEFAULT_CHUNKED_PREFILL = True
"""a prompt longer than the step's prefill budget is prefilled in chunks of the budget, one per step between the
running requests' decode steps (vLLM's scheduling); ``engine.chunked_prefill = False``: whole and alone, as before."""


class RolloutEngine(WeightUpdateBracket):
    """Fused-weight Llama/Qwen2/Qwen3 decoder + static KV cache + sampler (+ CUDA graphs).

    Weights are uninitialized until the first complete weight update (`load_weights`,
    `from_pretrained` or a refit).
    """

    takes_tp_slices = True  # a tensor-parallel shard loads exactly its slices (FSDP -> TP refit)

    def __init__(self, hf_config: Any, spec: EngineSpec, *, enforce_eager: bool = False,
                 record_routing: bool = False, kv_on_refit: str = "recompute",
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, tensor_parallel: TensorParallel = SINGLE):
        """``hf_config``: a transformers config (or a checkpoint directory to read it from);
        ``spec``: capacity and numerics (quantization: None, "fp8", "fp8_block", "mxfp4"), and
        ``spec.compile_decode``: torch.compile the eager decode step.
        ``enforce_eager``: no CUDA graphs; ``record_routing``: record MoE routing for replay in the trainer.
        ``kv_on_refit``: in-flight requests after a weight update: "recompute" their KV
        (exact) or "keep" it (approximate); ``max_prefill_tokens``: new prompt tokens
        prefilled per step (a longer prompt is prefilled in chunks: ``chunked_prefill``);
        ``prefix_cache_bytes``: budget of retained conversation KV.
        ``tensor_parallel``: this rank's place in a tensor-parallel group (``layers/
        tensor_parallel.py``): every rank of the group builds its engine with the same
        arguments and must be handed the same requests in the same order (each step's
        collectives pair up across the group)."""
        if isinstance(hf_config, str):
            from transformers import AutoConfig
            hf_config = AutoConfig.from_pretrained(hf_config, local_files_only=True)
        self.hf_config = hf_config
        self.config = parse_hf_config(hf_config)
        self.spec = spec
        self.dtype, self.device = spec.dtype, resolve_device(spec.device)
        self.adapter_dtype = adapter_dtype(self.dtype, spec.exact)  # LoRA adapters: what a refit sends them in
        self.max_batch_size, self.max_seq_len = spec.max_batch_size, spec.max_seq_len
        self.pad_token_id = getattr(hf_config, "pad_token_id", None) or 0
        self.tensor_parallel = tensor_parallel
        # Count the static memory before allocating any (weights on the meta device, the cache
        # and row buffers from their shapes): too much is a one-line error, not the OOM killer.
        if spec.exact:  # refuse what cannot hold before building anything; probe this machine's GEMMs
            from hybridrl.exact.ops import check_batch_invariance
            from hybridrl.rollout.exact_support import exact_refusal

            why = exact_refusal(self.config, spec, tensor_parallel)
            if why is not None:
                raise ValueError(f"exact numerics: {why}; build the engine with exact=False")
            check_batch_invariance(self.dtype, device=self.device)
        meta_model = build_model(self.config, spec.quantization, 2, self.dtype, torch.device("meta"), tensor_parallel)
        self.memory = EngineMemory.of(spec, self.config, meta_model, tensor_parallel=tensor_parallel,
                                      record_routing=record_routing)
        check_fits(self.memory, self.max_batch_size, self.max_seq_len, self.device)
        self.model = build_model(self.config, spec.quantization, self.max_seq_len, self.dtype, self.device,
                                 tensor_parallel, exact=spec.exact)
        # spec.compile_decode: torch.compile the eager decode step (CPU, or CUDA with enforce_eager).
        self.runner = ModelRunner(self.model, self.max_batch_size, self.max_seq_len, self.dtype, self.device,
                                  spec.compile_decode)
        # MoE: record every token's experts for routing replay in the trainer (before any
        # graph capture, so captured decode steps write the record buffers too)
        self.routing_recorder = None
        if record_routing:
            from hybridrl.rollout.routing import enable_routing_record

            self.routing_recorder = enable_routing_record(self)
        if spec.lora is not None:  # LoRA adapters in the layers they target, then routes that include them
            from hybridrl.rollout.layers.lora_adapter import attach_adapters

            attach_adapters(self.model, WeightRoutes(self.model), spec.lora)
        self.weight_routes = WeightRoutes(self.model)  # HF name -> slot, built once (load, refit, verify)
        self._update = WeightUpdate(self.model, self.weight_routes)
        self._weight_version = 0  # written only by _commit_weight_update (and load_state_dict)
        self._use_graphs = (self.device.type == "cuda" and not enforce_eager and self.config.v4 is None
                            and not spec.exact)
        self.scheduler = Scheduler(self.runner, self.config.vocab_size, lambda: self._weight_version,
                                   max_prefill_tokens=max_prefill_tokens,
                                   prefix_cache_bytes=prefix_cache_bytes, kv_on_refit=kv_on_refit,
                                   chunked_prefill=DEFAULT_CHUNKED_PREFILL)
        # one step or one bracket call at a time: a weight update waits for the step in flight
        self._lock = threading.Lock()
        self._generate_calls = itertools.count()

    # ---- weights: the update bracket ------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The version the last complete update recorded (0 = never loaded); stamped on every `Rollouts`."""
        return self._weight_version

    @property
    def weight_update_in_progress(self) -> bool:
        """True between `begin_weight_update()` and `finish_weight_update()` / `abort_weight_update()`."""
        return self._update.is_open

    def begin_weight_update(self, required: Iterable[str] | None = None) -> None:
        """Open an update: every linear back in loading layout, in place. Raises if one is open.
        Waits for a step in flight; in-flight requests hold until the update closes.
        ``required``: a partial update writing exactly these names (LoRA refits)."""
        with self._lock:
            self._update.begin(required)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors -> in-place writes through each parameter's `weight_loader`.

        Inside an open update: one bucket of it. Otherwise a complete one-shot update
        (begin, load, finish): every name of `expected_weight_names()` must be among them.
        A tied `lm_head.weight` is accepted and ignored. Returns the names written.
        """
        if self._update.is_open:
            return self._update.load(named_tensors)
        with self.weight_update():
            return self._update.load(named_tensors)

    def finish_weight_update(self, check: Callable[[], None] | None = None, *, version: int | None = None) -> int:
        """Close the update: inference layouts, then derived caches, in place; then require
        every expected name written and run `check()` (e.g. refit's verifier). Only if all
        pass: `weight_version` = `version` (the publisher's; None: += 1), returned, and, the
        first time, CUDA-graph capture. On any error the update is closed and nothing is committed.
        """
        with self._lock:
            try:
                new_version = next_weight_version(self._weight_version, version)
            except ValueError:
                self._update.abort()
                raise
            self._update.finish(check)
            return self._commit_weight_update(new_version)

    def abort_weight_update(self) -> None:
        """Close an open update without committing (layouts and caches made consistent);
        held requests continue with the weights they had."""
        with self._lock:
            self._update.abort()

    def _commit_weight_update(self, version: int) -> int:
        self._weight_version = version
        self.scheduler.on_weights_changed(self._weight_version)
        # Graphs capture real weights' kernels (the warm-up runs them), so they wait for the
        # first complete update; later updates write in place and keep every captured address.
        if self._use_graphs and self.runner.graphs is None:
            from hybridrl.rollout.core.cuda_graph import graph_batch_sizes
            self.runner.capture_cuda_graphs(graph_batch_sizes(self.max_batch_size))
        return self._weight_version

    # ---- weights: what they are ------------------------------------------------------
    def named_derived_caches(self) -> Iterator[tuple[str, DerivedCache]]:
        """Every derived cache (a tensor computed from weights, refreshed in place by an update)."""
        return named_derived_caches(self.model)

    def named_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, buffer, KV-cache and CUDA-graph tensor the engine holds."""
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()
        yield from self.runner.named_state_tensors()

    # ---- inference -----------------------------------------------------------------
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               images: RowImages | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, S] -> logits [B, S, V] float32 (no KV cache).
        ``images``: a vision-language model's images of each row (None: every row text-only)."""
        if input_ids.shape[1] > self.max_seq_len:
            raise ValueError(f"logits: sequence length {input_ids.shape[1]} exceeds max_seq_len="
                             f"{self.max_seq_len}; build the engine with a larger max_seq_len")
        return self.runner.logits(input_ids.to(self.device), attention_mask.to(self.device), images)

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams | None = None, *,
                    parent: str | None = None, retain: bool = False, images: ImageInputs | None = None,
                    placeholders: Sequence[bool] | None = None) -> None:
        """Queue one sample (``params.n == 1``). ``parent``: the id of a finished, retained
        request whose prompt + response ``token_ids`` extends (its KV is reused); ``retain``:
        keep this request's KV after it finishes for a continuation. Allowed during a
        weight update (it waits in the queue).
        Vision-language models: ``images``, every image of ``token_ids`` in order (those of
        a parent's prefix too; the cached ones are not encoded again); ``placeholders``: which
        positions may be image tokens (default all; a sampled ``<|image_pad|>`` of an earlier
        turn is text). Images that do not fit the image tokens raise ``ImageTokenMismatch``
        (one line) and nothing is queued."""
        with self._lock:
            self.scheduler.add(request_id, token_ids, params or SamplingParams(), parent=parent, retain=retain,
                               images=images, placeholders=placeholders)

    def step(self) -> StepOutput:
        """One decode step of every running request, then admission of waiting ones."""
        with self._lock:
            if self._update.is_open:
                raise WeightUpdateError("step: a weight update is in progress; in-flight requests hold until "
                                        "finish_weight_update() or abort_weight_update()")
            if self._weight_version == 0:
                raise WeightUpdateError("step: the engine has no weights yet; load_weights() or refit first")
            if not self.spec.exact:
                return self.scheduler.step()
            # Exact layers call their batch-invariant kernels themselves: a caller's
            # ``hybridrl.exact.batch_invariant()`` mode (the trainer's step) would only add Python per op.
            with torch._C.DisableTorchFunction():
                return self.scheduler.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a waiting or running request: its output so far (finish_reason "abort"), or
        None if no such request is waiting or running (e.g. it already finished)."""
        with self._lock:
            return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> bool:
        """Free the retained KV of a finished request (its conversation ends)."""
        with self._lock:
            return self.scheduler.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def chunked_prefill(self) -> bool:
        """Whether a prompt longer than ``max_prefill_tokens`` is prefilled in chunks of the budget,
        one per step between the running requests' decode steps; False (``DEFAULT_CHUNKED_PREFILL``):
        whole, in one step, alone (every running request waits for it). DeepSeek-V4 never chunks (its state
        cannot extend). Settable between steps; a chunked prefill under way finishes in chunks."""
        return self.scheduler.chunked

    @chunked_prefill.setter
    def chunked_prefill(self, on: bool) -> None:
        with self._lock:
            self.scheduler.chunked = bool(on) and self.scheduler.chunks.usable

    @property
    def kv_on_refit(self) -> str:
        return self.scheduler.kv_on_refit

    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 images: list[ImageInputs | None] | None = None) -> Rollouts:
        """Sample a response for every prompt (n per prompt); see `Rollouts` for the layout.
        A loop of ``add_request`` + ``step``; requests added by others progress meanwhile.
        ``images``: a vision-language model's images of each prompt (None: all text-only)."""
        samples = expand_requests(prompt_token_ids, params or SamplingParams(), self.max_seq_len,
                                  self.config.vocab_size)
        call = next(self._generate_calls)
        ids = [f"generate-{call}-{i}" for i in range(len(samples))]
        with self._lock:
            self.scheduler.add_samples(ids, samples, sample_images(images, prompt_token_ids, params))
        outputs = self.run_until_finished(ids)
        return rollouts_from_outputs([outputs[i] for i in ids], self.pad_token_id)

    def run_until_finished(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        """Step until every one of ``request_ids`` finished; their outputs by id."""
        pending, outputs = set(request_ids), {}
        while pending:
            for r in self.step().finished:
                if r.request_id in pending:
                    pending.discard(r.request_id)
                    outputs[r.request_id] = r
        return outputs



def sample_images(images: list[ImageInputs | None] | None, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams] | None) -> list[ImageInputs | None] | None:
    """Each prompt's images repeated for its ``n`` samples (``expand_requests``' order)."""
    if images is None:
        return None
    if len(images) != len(prompts):
        raise ValueError(f"generate: got images for {len(images)} prompts, not {len(prompts)}; pass one entry "
                         "per prompt (None for a text-only one)")
    params = params or SamplingParams()
    ns = [params.n] * len(prompts) if isinstance(params, SamplingParams) else [p.n for p in params]
    return [im for im, n in zip(images, ns) for _ in range(n)]


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with its index made explicit: ``"cuda"`` means the *current* device at
    construction (``torch.cuda.set_device(rank)`` in a multi-process job), fixed from then
    on, so graph capture, replay and synchronization all name the device the tensors are on."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build_model(config, quantization: str | None, max_seq_len: int, dtype: torch.dtype, device,
                tensor_parallel: TensorParallel = SINGLE, exact: bool = False) -> torch.nn.Module:
    """The engine's model for a parsed ``ModelConfig``: DeepSeek-V4's decoder or the shared one
    (``hybridrl plan`` builds the same on the meta device to count its weights), over the one
    ``LayerContext`` every layer of it is built with (``layers/context.py``; ``exact``: batch-invariant layers)."""
    ctx = LayerContext.for_quantization(quantization, dtype=dtype, device=device, tp=tensor_parallel, exact=exact)
    if config.v4 is not None:
        from hybridrl.rollout.models.deepseek_v4.model import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM(config, config.v4, max_seq_len, ctx)
    if config.vl is not None:
        from hybridrl.rollout.models.vision_language.model import VisionLanguageForCausalLM

        return VisionLanguageForCausalLM(config, max_seq_len, ctx)
    return DecoderForCausalLM(config, max_seq_len, ctx)
