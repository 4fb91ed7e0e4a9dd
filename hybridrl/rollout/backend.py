"""What both rollout backends (the built-in ``RolloutEngine``,
``hybridrl.vllm_backend.VllmEngine``) implement and share: the interface the trainer uses
(``RolloutBackend``), what an engine is built to hold (``EngineSpec``), the weight-update
bracket and the weights it must be sent (``WeightUpdateBracket``), the validation of a
bucket of trainer tensors (``bucket_problems``, also refit's), and how ``generate`` turns
prompts and ``SamplingParams`` into per-sample requests (``expand_requests``)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from hybridrl.rollout.rollouts import Rollouts
from hybridrl.rollout.sampling_params import SamplingParams

TRAINER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Float dtypes a trainer may send a weight in (the engine casts to its own dtype)."""


class RolloutBackend(Protocol):
    @property
    def weight_version(self) -> int:
        """The version of the weights held: the one the last complete update was handed
        (``finish_weight_update(version=...)``; +1 when none was); 0 = never loaded."""

    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> Rollouts: ...

    def begin_weight_update(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def finish_weight_update(self, check=None, *, version: int | None = None) -> int: ...

    def abort_weight_update(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """What a rollout engine is built to hold, whichever backend: its capacity (static KV
    cache / vLLM's ``max_num_seqs`` x ``max_model_len``) and its numerics. Each backend
    validates ``dtype`` / ``quantization`` against what it supports."""

    max_batch_size: int
    """rows sampled together (more requests run in chunks of this many)."""
    max_seq_len: int
    """prompt + response tokens of one row (responses are capped to fit)."""
    dtype: torch.dtype = torch.float32
    """the engine's weight and activation dtype."""
    device: str | torch.device = "cpu"
    """``"cuda"`` means the current device when the engine is built."""
    quantization: str | None = None
    """None, or a backend's weight quantization ("fp8", ...)."""
    lora: Any = None
    """an ``AdapterSpec`` (``layers/lora_adapter.py``): the LoRA adapters the engine applies
    over its base weights (``rollout.lora_mode=adapter``); None: plain weights."""
    exact: bool = False
    """batch-invariant numerics (``rollout.exact``): the built-in engine's log-probs are bitwise the
    trainer's recomputation under ``hybridrl.exact`` (``rollout/exact_support.py`` says where it holds)."""
    compile_decode: bool = False
    """built-in engine: ``torch.compile`` its eager decode step (CPU, or CUDA with
    ``enforce_eager``); the vLLM backend refuses it (vLLM compiles by its own settings)."""

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_seq_len < 2:
            raise ValueError(f"EngineSpec: max_batch_size={self.max_batch_size} must be >= 1 and "
                             f"max_seq_len={self.max_seq_len} >= 2")

    @classmethod
    def pop_from(cls, spec: "EngineSpec | None", kwargs: dict[str, Any]) -> "EngineSpec":
        """``spec``, or one built from (and removed from) the spec fields among ``kwargs``
        (``from_pretrained(path, max_batch_size=..., max_seq_len=..., dtype=...)``)."""
        fields = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls) if f.name in kwargs}
        if spec is None:
            return cls(**fields)
        if fields:
            raise TypeError(f"pass either an EngineSpec or its fields, not both (got spec and {sorted(fields)})")
        return spec


class WeightUpdateBracket:
    """``with engine.weight_update(check=...): engine.load_weights(bucket) ...`` for any
    backend with ``begin_weight_update`` / ``finish_weight_update`` / ``abort_weight_update``:
    finish on a clean exit, abort on an exception. Also what a complete update must send
    (from the backend's route table ``weight_routes`` and its ``dtype``) and
    ``from_pretrained`` (a first complete update from a checkpoint)."""

    @classmethod
    def from_pretrained(cls, path: str, spec: EngineSpec | None = None, **kwargs):
        """Config + safetensors weights of a local Hugging Face checkpoint directory (version 1).
        ``spec`` or its fields as keywords; the other keywords go to the backend's constructor."""
        from transformers import AutoConfig

        from hybridrl.rollout.hf_checkpoint import checkpoint_names, iter_model_weights, model_weight_names

        spec = EngineSpec.pop_from(spec, kwargs)
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        engine = cls(hf_config, spec, **kwargs)
        on_disk = checkpoint_names(path)  # the headers, read once
        names, routes = model_weight_names(on_disk, hf_config), engine.weight_routes
        missing = routes.missing(names) if hasattr(routes, "missing") else set(routes.expected) - names
        if missing:  # checked from the headers, before anything is written
            raise ValueError(f"checkpoint {path} lacks {len(missing)} weight(s) the {hf_config.model_type} engine "
                             f"needs: {listing(missing)}; save the checkpoint again or fix its config.json")
        engine.load_weights(iter_model_weights(path, hf_config, on_disk))
        return engine

    def expected_weight_names(self) -> set[str]:
        """Every HF name a complete update writes exactly once (a tied `lm_head.weight` is not one)."""
        return set(self.weight_routes.expected)

    def weight_spec(self, hf_name: str) -> tuple[torch.Size, torch.dtype]:
        """(HF shape before fusion, engine dtype) of the tensor the trainer must send for `hf_name`."""
        if hf_name not in self.weight_routes:
            raise ValueError(f"weight_spec: {hf_name!r} is not a weight of this rollout model")
        return self.weight_routes[hf_name].shape, self.dtype

    def state_dict(self) -> dict[str, int]:
        """What a resume needs of the engine (its weights come back by refit): the version."""
        return {"weight_version": self.weight_version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the version numbering of a resumed run (call after its first refit):
        the engine stays the only writer of ``weight_version``."""
        if self.weight_update_in_progress:
            raise RuntimeError("load_state_dict during a weight update; finish or abort it first")
        self._weight_version = int(state["weight_version"])

    @contextlib.contextmanager
    def weight_update(self, check: Callable[[], None] | None = None, *,
                      version: int | None = None) -> Iterator["WeightUpdateBracket"]:
        self.begin_weight_update()
        try:
            yield self
        except BaseException:
            self.abort_weight_update()
            raise
        self.finish_weight_update(check, version=version)


def next_weight_version(current: int, version: int | None) -> int:
    """The version a complete weight update records: ``version`` as handed down by its one
    owner (the trainer's batch source, which publishes the weights), or ``current + 1``
    when none is (standalone use: tests, ``from_pretrained``)."""
    if version is None:
        return current + 1
    check_weight_version(version)
    return version


def check_weight_version(version: int) -> None:
    """A weight version handed to an engine is an int >= 1 (0 means "never loaded")."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"weight update: version={version!r} must be an int >= 1 (the published weight "
                         "version) or None (the engine's version + 1)")


def bucket_problems(routes, named_tensors: Iterable[tuple[str, torch.Tensor]], written
                 ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Judge a whole bucket against a route table before any of it is written: returns the
    pairs to load (ignored names dropped) and the problems by kind — ``unknown`` names,
    ``duplicate`` ones (within the bucket or among ``written``), ``mismatched`` HF shapes or
    non-float dtypes — each empty when fine (``describe_problems`` words them)."""
    seen, dup, unknown, bad = set(), set(), set(), []
    kept = []
    for name, t in named_tensors:
        if name in routes.ignored:
            continue
        if name not in routes:
            unknown.add(name)
            continue
        if name in seen or name in written:
            dup.add(name)
        seen.add(name)
        shape = routes[name].shape
        local = getattr(routes[name], "local_shape", shape)  # a tensor-parallel rank's part
        if tuple(t.shape) not in (tuple(shape), tuple(local)):
            bad.append(f"{name} shape {tuple(t.shape)} != {tuple(shape)}")
        elif t.dtype not in TRAINER_DTYPES and not _same_integer_slot(routes[name], t):
            bad.append(f"{name} dtype {t.dtype} is not a trainer float dtype {TRAINER_DTYPES}")
        kept.append((name, t))
    return kept, {"unknown": unknown, "duplicate": dup, "mismatched": bad}


def describe_problems(problems: dict[str, Any]) -> str:
    """``unknown (2): a, b; duplicate (1): c`` of the non-empty kinds ("" if none)."""
    return "; ".join(f"{kind} ({len(v)}): {listing(v)}" for kind, v in problems.items() if v)


def _same_integer_slot(route, t: torch.Tensor) -> bool:
    """An integer table sent into an integer slot of the same dtype (DeepSeek-V4's frozen
    ``tid2eid`` token -> expert map)."""
    param = getattr(route, "param", None)
    return param is not None and not t.dtype.is_floating_point and t.dtype == param.dtype


def listing(items, limit: int = 8) -> str:
    """``a, b, c (+N more)`` for error messages that name offending weights."""
    items = sorted(map(str, items))
    head = ", ".join(items[:limit])
    return head + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def expand_requests(prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                    max_seq_len: int, vocab_size: int) -> list[tuple[list[int], SamplingParams, int, int]]:
    """``(prompt, params, seed, max_new_tokens)`` of every sample ``generate`` runs, prompt-major
    (``n`` consecutive rows per prompt); each prompt is checked first."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"generate: got {len(params)} SamplingParams for {len(prompts)} prompts; "
                         "pass one SamplingParams or one per prompt")
    samples = []
    for prompt, p in zip(prompts, params):
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, max_seq_len, vocab_size)
        max_new = min(p.max_tokens, max_seq_len - len(prompt))
        for j in range(p.n):
            samples.append((prompt, p, request_seed(p.seed, j), max_new))
    return samples


def check_request(request_id: str, token_ids, params: SamplingParams, live, max_seq_len: int,
                  vocab_size: int) -> list[int]:
    """``add_request``'s checks, both backends: one sample, a fresh id (``live``: the ids
    waiting or running), a prompt that fits; returns the token ids as ints. One-line errors."""
    if params.n != 1:
        raise ValueError(f"add_request {request_id!r}: SamplingParams.n={params.n}; a request is one sample "
                         "(add n requests with their own seeds, as generate() does)")
    if request_id in live:
        raise ValueError(f"add_request {request_id!r}: a request with this id is already waiting or running")
    token_ids = [int(t) for t in token_ids]
    try:
        check_prompt(token_ids, max_seq_len, vocab_size)
    except ValueError as e:
        raise ValueError(f"add_request {request_id!r}: {str(e).removeprefix('generate: ')}") from None
    return token_ids


def check_parent(request_id: str, parent: str, retained: bool, live) -> None:
    """A ``parent`` must be a finished request added with ``retain=True`` (``retained``: the
    backend still knows it, held or evicted); one still in ``live`` has not finished."""
    from hybridrl.rollout.requests import UnknownRequestError

    if retained:
        return
    if parent in live:
        raise ValueError(f"add_request {request_id!r}: parent {parent!r} has not finished yet; add the next "
                         "turn after its output arrived")
    raise UnknownRequestError(f"add_request {request_id!r}: unknown parent {parent!r}: no finished request "
                              "with that id was retained (finish the parent turn with retain=True)")


def check_prompt(prompt: list[int], max_seq_len: int, vocab_size: int) -> None:
    if not 0 < len(prompt) < max_seq_len:
        raise ValueError(f"generate: prompt length {len(prompt)} must be in [1, max_seq_len="
                         f"{max_seq_len}); shorten the prompt or raise max_seq_len"
                         + (" (an empty prompt: did the tokenizer encode it to nothing?)" if not prompt else ""))
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"generate: prompt token ids must be in [0, vocab_size={vocab_size})")


def request_seed(seed: int | None, j: int) -> int:
    """Seed of the j-th sample of a request; unseeded requests draw from torch's global RNG,
    so ``torch.manual_seed`` makes a run reproducible."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)))
    return seed if j == 0 else (seed * 1_000_003 + j) % 2**62


def pad_step(started: float, latency_s: float) -> None:
    """Sleep until ``latency_s`` seconds after ``started`` (``time.perf_counter()``): the
    emulated decode-step latency of ``rollout.step_latency_ms`` (benchmarks); 0 = return."""
    if latency_s > 0:
        import time

        left = latency_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
