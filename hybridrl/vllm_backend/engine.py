"""VllmEngine: vLLM (in-process) behind the interface the trainer uses on ``RolloutEngine``.

    engine = VllmEngine(hf_config, EngineSpec(max_batch_size=256, max_seq_len=64))
    refit_from_model(engine, model, verify=True)      # the same refit protocol, unchanged
    ro = engine.generate(prompt_token_ids, SamplingParams(temperature=1.0, n=8, seed=0))
    ro.logprobs, ro.weight_version

**Weights** change only through the bracket ``begin_weight_update()`` ->
``load_weights(bucket)``* -> ``finish_weight_update(check)`` (or ``abort``), like the
built-in engine's:

- ``load_weights`` validates the whole bucket (known name, not sent twice, HF shape, float
  dtype) *before* keeping any of it, and stages the tensors: by reference, or a copy for a
  view into a larger buffer (a transport bucket that is reused).
- ``finish_weight_update`` requires every expected name, then runs **vLLM's own reload
  path** once (``reload_weights`` with the staged pairs: its layer-wise loaders, then its
  packing), then checks the reload (below), then the caller's ``check`` (refit's
  verifier); only then ``weight_version = version`` (+1 when none is handed). An
  incomplete update (or ``abort``) never touched vLLM: the engine keeps serving the
  previous weights, version unchanged.
- **A reload is checked every time** (reload_check.py; it reads each weight twice): each
  packed linear layer's output on a fixed input must match ``x @ Wᵀ`` of what it must hold
  (fused shards in their rows; FP8: the sent weight's quantization), and every other weight
  must equal what was sent, bit for bit. If the reload raises or this check (or the
  caller's) fails, the engine holds weights it cannot vouch for: it refuses to generate
  (``WeightUpdateError`` naming the failure) until a complete update succeeds.
- **FP8** (``quantization="fp8"``): vLLM's online per-channel FP8 (fp8.py); its reload
  re-quantizes from the bf16 tensors sent, into the same storage.
- **Colocation** (``free_cache_engine=True``): :meth:`sleep` frees the KV cache and offloads
  the weights for the trainer's update; ``finish_weight_update`` wakes the weights before the
  reload and the KV cache after it (sleep.py).

**Requests** (request_api.py): ``add_request`` / ``step`` / ``abort`` / ``release``, the
built-in engine's request API, on vLLM's own scheduler (``llm.llm_engine``). A weight update
holds the requests in flight (``step`` refuses; new ones wait outside vLLM); after it
commits they continue, their KV recomputed with the new weights or kept (``kv_on_refit``).

**Starting vLLM** (launch.py): the platform check, a config-only model directory and the KV
cache size from the ``EngineSpec``. **Requests and outputs** (requests.py): one tagged
``n=1`` vLLM request per sample, outputs back as ``Rollouts``.

**Sampling log-probs**: ``log_softmax(logits / T)`` of the full vocabulary *before* top-k /
top-p — our definition (docs/interfaces.md) — and ``log_softmax(logits)`` for greedy rows:
vLLM reports the sampled token's raw logit (``logprobs_mode="raw_logits"``) and a logits
processor records each row's ``logsumexp(logits / T)`` (full_vocab_logprobs.py, requests.py).

**Process state**: vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
Every call into it restores torch's thread count, ``torch.set_num_threads`` and the global
RNG states (``isolation.py``). The KV cache is sized from ``max_batch_size x max_seq_len``
(``kv_cache_memory_bytes``), never from free host memory. vLLM's V1 model runner is selected
(``VLLM_USE_V2_MODEL_RUNNER=0``, _import.py): the logits processor above is a V1 one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from hybridrl.rollout.backend import (EngineSpec, WeightUpdateBracket, bucket_problems, describe_problems,
                                      expand_requests, listing, next_weight_version)
from hybridrl.rollout.compile import keyed_inductor_cache
from hybridrl.rollout.requests import RequestOutput, StepOutput
from hybridrl.rollout.rollouts import Rollouts
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.rollout.weight_update import WeightUpdateError
from hybridrl.vllm_backend import full_vocab_logprobs as fvl
from hybridrl.vllm_backend._import import import_vllm
from hybridrl.vllm_backend.fp8 import vllm_quantization
from hybridrl.vllm_backend.isolation import preserve_environ, preserve_torch_state, shutdown_llm
from hybridrl.vllm_backend.launch import (VLLM_DTYPES, check_platform, cpu_shm_segments, llm_args, served_config,
                                          write_config_dir)
from hybridrl.vllm_backend.lora import base_layers_in_place
from hybridrl.vllm_backend.mla import mla_derived_caches
from hybridrl.vllm_backend.reload_check import check_reload, refresh_tied_head
from hybridrl.vllm_backend.request_api import VllmRequests, check_kv_on_refit
from hybridrl.vllm_backend.requests import rollouts_from_outputs, vllm_request
from hybridrl.vllm_backend.routes import VllmWeightRoutes
from hybridrl.vllm_backend.sleep import EngineSleep
from hybridrl.vllm_backend.state_tensors import named_state_tensors


class VllmEngine(WeightUpdateBracket):
    """vLLM's ``LLM`` in this process, driven from token ids; weights through the bracket.

    ``hf_config``: a transformers config (or a checkpoint directory to read it from). The
    engine starts with placeholder weights (``load_format="dummy"``) and ``weight_version``
    0; the first complete update (``load_weights``, ``from_pretrained`` or a refit) makes it 1.
    ``spec``: capacity and numerics; ``spec.quantization``: None or "fp8" (vLLM's online
    per-channel FP8; bf16 / fp16 only).
    ``enforce_eager``: False captures vLLM's CUDA graphs (CUDA only; CPU always runs eager).
    ``free_cache_engine``: :meth:`sleep` frees the KV cache until the next weight update.
    ``seed``: vLLM's seed. ``check_reload``: check every reload (reload_check.py).
    ``kv_on_refit``: requests in flight at a weight update: "recompute" their KV with the new
    weights (default) or "keep" the old-weight KV (approximate); see request_api.py.
    ``llm_kwargs``: passed to ``vllm.LLM`` over ours (``launch.llm_args``: e.g.
    ``enable_prefix_caching``, True here, or ``kv_cache_memory_bytes``, sized from the spec).
    """

    def __init__(self, hf_config: Any, spec: EngineSpec, *, enforce_eager: bool = True,
                 free_cache_engine: bool = False, seed: int = 0, check_reload: bool = True,
                 kv_on_refit: str = "recompute", tensor_parallel: Any = None, **llm_kwargs):
        check_kv_on_refit(kv_on_refit)
        if spec.lora is not None and kv_on_refit != "recompute":
            raise ValueError("VllmEngine: LoRA adapter mode needs kv_on_refit=recompute (requests kept across "
                             "a refit would hold the removed adapter id); use rollout.lora_mode=merged")
        if spec.compile_decode:
            raise ValueError("VllmEngine: EngineSpec.compile_decode is the built-in engine's; vLLM compiles by its "
                             "own compilation_config (pass it as an llm_kwargs keyword)")
        tp_size = 1 if tensor_parallel is None else tensor_parallel.size
        vllm_quantization(spec.quantization, spec.dtype, torch.device(spec.device).type == "cpu")  # one line, first
        if spec.dtype not in VLLM_DTYPES:
            raise ValueError(f"VllmEngine: dtype {spec.dtype} not supported; use one of {list(VLLM_DTYPES)}")
        hf_config = served_config(hf_config)  # a directory's config; vision-language ones refused (launch.py)
        self.hf_config, self.spec = hf_config, spec
        self.dtype, self.device, self.quantization = spec.dtype, torch.device(spec.device), spec.quantization
        self.max_batch_size, self.max_seq_len = spec.max_batch_size, spec.max_seq_len
        self.vocab_size = int(hf_config.vocab_size)
        self.pad_token_id = getattr(hf_config, "pad_token_id", None) or 0
        self.check_reload = check_reload
        with preserve_environ():
            vllm = import_vllm()
        keyed_inductor_cache()  # vLLM's CPU kernels go through inductor too (rollout/compile.py)
        check_platform(hf_config, self.device)
        self._config_dir = write_config_dir(hf_config)
        shm_before = set(cpu_shm_segments())
        try:
            args = llm_args(hf_config, spec, self._config_dir, seed=seed, enforce_eager=enforce_eager,
                            free_cache_engine=free_cache_engine, tp_size=tp_size)
            args.update(llm_kwargs)
            with preserve_torch_state(), preserve_environ():
                self.llm = vllm.LLM(**args)
        except BaseException:
            shutil.rmtree(self._config_dir, ignore_errors=True)
            raise
        self._shm_segments = sorted(set(cpu_shm_segments()) - shm_before) if tp_size > 1 else []
        self._vllm_sampling_params = vllm.SamplingParams
        self.model = self.llm.apply_model(lambda m: m)[0]  # in-process: the live vLLM module
        self.adapter = None  # LoRA adapter mode: the policy's adapter in vLLM (lora.py)
        try:
            self.weight_routes = VllmWeightRoutes(hf_config, self.model, self.dtype)
            if spec.lora is not None:
                from hybridrl.vllm_backend.lora import VllmAdapterSlot

                self.adapter = VllmAdapterSlot(self.llm, spec.lora, self.dtype)
                routes = self.weight_routes
                routes.add(self.adapter.routes(self.model, routes))
        except BaseException:
            self.close()  # vLLM holds a torch.distributed group: the next engine could not start
            raise
        self.sleep_state = EngineSleep(self.llm, free_cache_engine)
        self._weight_version = 0
        self._staged: dict[str, torch.Tensor] | None = None  # open update: name -> tensor to load
        self._required: frozenset[str] | None = None  # a partial update's names (None: every weight)
        self._broken: str | None = None  # why the weights vLLM holds cannot be trusted
        self.last_reload_seconds = 0.0
        self._requests = 0  # requests sent so far: each one's tag for the log-prob processor
        self.requests = VllmRequests(self, kv_on_refit)  # add_request / step / abort

    def close(self) -> None:
        """Shut vLLM down and remove the config directory (the engine is unusable after)."""
        shutdown_llm(self.__dict__.pop("llm", None))
        shutil.rmtree(self._config_dir, ignore_errors=True)
        if getattr(self, "adapter", None) is not None:
            self.adapter.close()
        for path in self.__dict__.pop("_shm_segments", []):  # tensor parallel: vLLM's CPU segments (__init__)
            with contextlib.suppress(OSError):
                os.remove(path)

    def __del__(self):
        with contextlib.suppress(Exception):
            shutil.rmtree(self._config_dir, ignore_errors=True)
            if self.adapter is not None:
                self.adapter.close()

    # ---- weights: the update bracket ------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The version the last complete update recorded (0 = placeholder weights); on every `Rollouts`."""
        return self._weight_version

    @property
    def weight_update_in_progress(self) -> bool:
        return self._staged is not None

    def begin_weight_update(self, required: Iterable[str] | None = None) -> None:
        """Open an update (nothing reaches vLLM before ``finish_weight_update``); requests in
        flight hold until it closes (``step`` refuses meanwhile). ``required``: a partial
        update writing exactly these names (LoRA merged refits: the targeted weights; vLLM's
        loaders write what they are given and leave the rest)."""
        if self._staged is not None:
            raise WeightUpdateError("a weight update of this engine is already in progress; finish or abort it first")
        if self._weight_version == 0 and required is not None:
            raise WeightUpdateError("a partial weight update needs weights to update: load every weight first")
        self._required = None if required is None else frozenset(required)
        self._staged = {}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Inside an open update: validate one bucket as a whole, then stage it. Outside: a
        complete one-shot update (every name of ``expected_weight_names()``). A tied
        ``lm_head.weight`` is accepted and ignored. Returns the names staged."""
        if self._staged is not None:
            return self._stage(named_tensors)
        with self.weight_update():
            return self._stage(named_tensors)

    def finish_weight_update(self, check: Callable[[], None] | None = None, *, version: int | None = None) -> int:
        """Completeness, then vLLM's reload, then the reload check, then ``check()``; only if
        all pass ``weight_version = version`` (the publisher's; None: += 1), returned. The
        update is closed whatever happens."""
        if self._staged is None:
            raise WeightUpdateError("finish: no weight update in progress; call engine.begin_weight_update() first")
        staged, self._staged = self._staged, None
        try:
            new_version = next_weight_version(self._weight_version, version)
            self._reload(staged, check)
        except BaseException:
            # nothing committed: held requests continue (or, if the weights broke, wait: step refuses)
            self.requests.after_update(committed=False)
            raise
        self._weight_version = new_version
        # recompute / keep the requests in flight, reset vLLM's prefix cache (its cached KV
        # blocks were computed with the old weights) when vLLM allows it, submit held requests
        self.requests.after_update(committed=True)
        return self._weight_version

    def _reload(self, staged: dict[str, torch.Tensor], check: Callable[[], None] | None) -> None:
        """Completeness, vLLM's reload, its check and ``check()``; raises if any fails."""
        required = self.weight_routes.expected if self._required is None else self._required
        if self._required is not None:
            from hybridrl.vllm_backend.reload_check import partial_group_problems

            split = partial_group_problems(self.weight_routes, staged.keys())
            if split:
                raise WeightUpdateError(f"partial weight update splits {len(split)} fused layer(s): {listing(split)}; "
                                        "vLLM reloads a fused layer from all its shards: send q/k/v together and "
                                        "gate/up together (LoRA: target whole groups)")
        missing = required - staged.keys()
        if missing:
            raise WeightUpdateError(f"weight update incomplete: {len(missing)} weights never loaded: "
                                    f"{listing(missing)}; nothing was written to vLLM and weight_version was "
                                    "not advanced; load every name of engine.expected_weight_names()")
        self.weight_routes.clear_readback()
        try:
            self.sleep_state.wake("weights")  # the reload writes into the weights' storage
            adapter_names = staged.keys() & self.adapter.names if self.adapter is not None else set()
            base = [(n, t) for n, t in staged.items() if n not in adapter_names]
            t0 = time.perf_counter()
            with preserve_torch_state(), torch.no_grad():
                if base:  # an adapter-only refit (LoRA adapter mode) leaves the base as it is
                    # LoRA adapter mode: the reload sees vLLM's base layers, not its LoRA wrappers (lora.py)
                    with contextlib.nullcontext() if self.adapter is None else base_layers_in_place(self.model):
                        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": base})
                    refresh_tied_head(self.model, self.weight_routes)
                if adapter_names:  # a new adapter id in vLLM's LoRA slot (lora.py)
                    self.adapter.load({n: staged[n] for n in adapter_names})
                elif base and self.adapter is not None:  # vLLM's reload dropped the adapter: register it again
                    self.adapter.reregister()
            self.last_reload_seconds = time.perf_counter() - t0
            if self.check_reload:
                check_reload(self.model, self.weight_routes, staged, self.dtype)
            if check is not None:
                check()
        except BaseException as e:
            self._broken = f"the last weight update failed after vLLM's reload began ({type(e).__name__}: {e})"
            raise
        finally:
            self.weight_routes.clear_readback()
        self._broken = None
        self.sleep_state.wake("kv_cache")  # after the weights are final: nothing read it meanwhile

    def sleep(self) -> None:
        """Sampling is done until the next weight update: free the KV cache and offload the
        weights to host memory (vLLM ``sleep(level=1)``) so the trainer's update has the GPU.
        ``finish_weight_update`` wakes the weights before vLLM's reload and the KV cache after
        it; ``generate`` wakes whatever still sleeps. A no-op unless ``free_cache_engine``."""
        if self._staged is not None:
            raise WeightUpdateError("sleep: a weight update is in progress; finish or abort it first")
        if self.sleep_state.enabled and self.requests.in_vllm:
            raise RuntimeError(f"sleep: {self.requests.in_vllm} requests of add_request are in flight and sleeping "
                               "frees their KV cache; step() them to completion or abort() them first")
        self.sleep_state.sleep()

    def abort_weight_update(self) -> None:
        """Close an open update without touching vLLM (it keeps the previous weights); held
        requests continue."""
        self._staged = None
        self.requests.after_update(committed=False)

    def _stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        kept, problems = bucket_problems(self.weight_routes, named_tensors, self._staged)
        described = describe_problems(problems)
        if described:
            raise WeightUpdateError("weight bucket rejected, nothing of it staged — " + described
                                    + "; send each name of engine.expected_weight_names() once with the "
                                    "shape of engine.weight_spec(name)")
        for name, t in kept:
            self._staged[name] = _own(t.detach())
        return {n for n, _ in kept}

    # ---- weights: what they are ------------------------------------------------------
    def named_derived_caches(self) -> Iterator[tuple[str, Any]]:
        """MLA's ``W_UK_T`` / ``W_UV`` (derived from ``kv_b_proj``, mla.py), checked by refit's
        verifier against a fresh split. vLLM's packed GEMM buffers are checked through
        ``held()`` (read back through the layers' own matmuls) and the post-reload check."""
        return mla_derived_caches(self.model)

    def named_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What refit's address check snapshots (state_tensors.py)."""
        return named_state_tensors(self.llm, self.model)

    # ---- inference -----------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> Rollouts:
        """Sample ``n`` responses per prompt (rows prompt-major); see ``Rollouts``. Refuses while
        requests of ``add_request`` are in vLLM (``LLM.generate`` would step them too)."""
        self._check_can_run("generate")
        if self.requests.in_vllm:  # LLM.generate would run them too and swallow their outputs
            raise RuntimeError(f"generate: {self.requests.in_vllm} requests of add_request are in flight; step() "
                               "them to completion or abort() them first")
        samples = expand_requests(prompt_token_ids, params or SamplingParams(), self.max_seq_len, self.vocab_size)
        prompts = [prompt for prompt, _, _, _ in samples]
        temperatures = [p.temperature for _, p, _, _ in samples]
        requests = [vllm_request(self._vllm_sampling_params, p, seed, max_new, self._requests + i)
                    for i, (_, p, seed, max_new) in enumerate(samples)]
        first_tag, self._requests = self._requests, self._requests + len(requests)  # unique across calls
        self.sleep_state.ensure_awake()  # a sleeping engine's scheduler would never run a request
        with preserve_torch_state():
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], requests, use_tqdm=False,
                                        lora_request=self.lora_request)
            lse = self.llm.collective_rpc(fvl.take_records)[0]
        return rollouts_from_outputs(prompts, outputs, temperatures, lse, first_tag, self.weight_version,
                                     self.pad_token_id)

    def _check_can_run(self, what: str) -> None:
        """vLLM may run a step: the engine is open, no update is open, its weights are trusted."""
        if "llm" not in self.__dict__:
            raise RuntimeError(f"{what}: this VllmEngine was closed")
        if self._staged is not None:
            raise WeightUpdateError(f"{what}: a weight update is in progress; finish or abort it first")
        if self._broken is not None:
            raise WeightUpdateError(f"{what}: {self._broken}; run a complete weight update (refit) first")

    # ---- requests (request_api.py; the built-in RolloutEngine's signatures) ----------------
    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams | None = None, *,
                    parent: str | None = None, retain: bool = False) -> None:
        """Queue one sample (``params.n == 1``). ``parent``: a finished request added with
        ``retain=True`` whose prompt + response ``token_ids`` extends (vLLM's prefix cache
        reuses its KV by itself; the parent is only validated). Allowed during a weight update:
        the request reaches vLLM when the update closes."""
        if "llm" not in self.__dict__:
            raise RuntimeError("add_request: this VllmEngine was closed")
        self.requests.add(request_id, token_ids, params, parent=parent, retain=retain,
                          hold=self._staged is not None)

    def step(self) -> StepOutput:
        """One step of vLLM's scheduler: the requests that finished in it (complete outputs),
        ``running``: those that got a token and continue."""
        if self._staged is not None:
            raise WeightUpdateError("step: a weight update is in progress; in-flight requests hold until "
                                    "finish_weight_update() or abort_weight_update()")
        self._check_can_run("step")
        self.sleep_state.ensure_awake()  # a sleeping engine's scheduler would never run a request
        return self.requests.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a waiting or running request: its output so far (finish_reason "abort"), or
        None if no such request is waiting or running (e.g. it already finished)."""
        return self.requests.abort(request_id)

    def release(self, request_id: str) -> bool:
        """Forget a retained finished request (its conversation ends); True if it was retained."""
        return self.requests.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.requests.has_unfinished()

    @property
    def lora_request(self):
        """The ``LoRARequest`` of the policy's current adapter (adapter mode), else None."""
        return None if self.adapter is None else self.adapter.request

    @property
    def kv_on_refit(self) -> str:
        return self.requests.kv_on_refit


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it owns its storage; a copy if it is a view into a larger buffer (a transport
    bucket that will be refilled before the update finishes)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()

