"""``judge``: a generative model that grades each response, served by our engine.

    reward:
      functions:
        - {name: judge, path: runs/judge_arith, parser: verdict}
        - {name: judge, path: /models/Qwen3-8B, parser: number, rubric: "Grade 0-10 ...", max_tokens: 64}

Each sample's judge prompt is ``template`` rendered with the policy's prompt, its response,
the sample's reference answer and the ``rubric`` (``judge_prompt.py``), tokenized with the
judge's own tokenizer (its chat template when it has one). One server thread owns the
judge's engine and serves every request as it arrives, decoding them together
(``judge_server.py``). ``parser`` reads the answer (``judge_parse.py``): ``number`` — the
grade in the greedy answer text, divided by ``scale``; ``verdict`` — ``P(yes) / (P(yes) +
P(no))`` of the verdict words' first differing token, from one forward, nothing sampled.

Failures cost their sample only, with a counted reason in ``RewardBatch.failures``: "judge
timeout" (no answer within ``timeout_s`` of submission), "judge unparseable" (no grade in
the text), "judge crashed" (the engine raised; the server rebuilds it), "judge prompt too
long". A judge that fails nearly every call stops the run through the runner's breaker.

The reward is *trusted* (called inline by ``RewardRunner``, not in a worker process): it owns
an engine on a thread, and enforces its per-request timeout itself.
"""

from __future__ import annotations

import inspect
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.rewards.judge_parse import UNPARSEABLE, parse_number, verdict_probability, verdict_tokens
from hybridrl.rewards.judge_prompt import DEFAULT_TEMPLATE, JudgePrompt
from hybridrl.rewards.judge_server import JudgeServer
from hybridrl.rewards.outcome import RewardFailure
from hybridrl.rewards.registry import register_reward_factory

PARSERS = ("number", "verdict")
BACKENDS = ("builtin", "vllm")
DTYPES = ("float32", "bfloat16", "float16")
TOO_LONG = "judge prompt too long"
MAX_SEQ_LEN = 4096  # the default row length: the judge's context, capped (each row reserves it whole)


@dataclass(kw_only=True)
class JudgeOptions:
    """The options of a ``{name: judge, ...}`` reward entry."""

    path: str = ""
    """local Hugging Face causal-LM directory with its tokenizer."""
    template: str = DEFAULT_TEMPLATE
    """format string with {question} {response} {reference} {rubric}."""
    rubric: str = ""
    """the grading instructions, shared by every sample (its prefill is reused)."""
    parser: str = "verdict"
    """number: a grade read from the greedy answer | verdict: P(yes) / (P(yes) + P(no)), one forward."""
    scale: float = 10.0
    """number: the grade's full mark when the judge writes no denominator ("7" -> 0.7)."""
    verdicts: tuple[str, str] | None = None
    """verdict: the (yes, no) words; None: ("Yes", "No") after a chat template, else (" Yes", " No")."""
    max_tokens: int = 32
    """number: most tokens the judge may write."""
    timeout_s: float = 60.0
    """per request, from its submission: later is "judge timeout"."""
    dtype: str | None = None
    """float32 | bfloat16 | float16; None: bfloat16 on CUDA, float32 on CPU."""
    quantization: str | None = None
    """the engine's weight quantization (fp8, fp8_block, mxfp4), None for none."""
    backend: str = "builtin"
    """builtin (our engine) | vllm (number parser only)."""
    device: str | None = None
    """cpu | cuda; None: cuda when available."""
    max_batch_size: int = 32
    """requests decoded together (more wait in the engine's queue)."""
    max_seq_len: int | None = None
    """judge prompt + answer tokens; None: the judge's context, at most 4096."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ValueError(f"path={self.path!r} is not a Hugging Face model directory (no config.json); "
                             "give the local directory of the judge model and its tokenizer")
        if self.parser not in PARSERS:
            raise ValueError(f"parser={self.parser!r}: use one of {', '.join(PARSERS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.backend == "vllm" and self.parser == "verdict":
            raise ValueError("parser=verdict reads the logits of one forward of the built-in engine; use "
                             "backend=builtin, or parser=number with vllm")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
        for key in ("max_tokens", "max_batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: must be an integer >= 1")
        for key in ("timeout_s", "scale"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{key}={value!r}: must be a positive number")
        if self.verdicts is not None:
            if len(self.verdicts) != 2 or not all(isinstance(w, str) and w for w in self.verdicts):
                raise ValueError(f"verdicts={self.verdicts!r}: give two words, [yes, no]")
            self.verdicts = tuple(self.verdicts)
        if not isinstance(self.template, str) or not isinstance(self.rubric, str):
            raise ValueError("template and rubric must be strings")


class LLMJudge:
    """The batched reward ``judge(responses, answers, prompts) -> [score | RewardFailure]``.

    ``engine_factory(spec)``: builds the engine from an ``EngineSpec`` (default: the
    ``backend``'s ``from_pretrained(path)``; tests pass a subclass)."""

    hybridrl_batched = True
    hybridrl_trusted = True  # inline: it owns an engine thread and times out its own requests
    hybridrl_label = "judge"

    def __init__(self, options: JudgeOptions, *, engine_factory: Callable[[Any], Any] | None = None):
        from transformers import AutoConfig

        self.options = o = options
        self.tokenizer = load_judge_tokenizer(o.path)
        hf_config = AutoConfig.from_pretrained(o.path, local_files_only=True)
        verdict = None
        if o.parser == "verdict":
            yes, no = o.verdicts or (("Yes", "No") if self.tokenizer.chat_template else (" Yes", " No"))
            verdict = verdict_tokens(self.tokenizer, yes, no)
        self.prompt = JudgePrompt(self.tokenizer, o.template, o.rubric, verdict.prefix if verdict else ())
        self.prompt.check_spelling(o.path)
        spec = _engine_spec(o, hf_config, verdict is not None)
        self.max_prompt_len = spec.max_seq_len - (1 if verdict else min(o.max_tokens, spec.max_seq_len - 1))
        factory = engine_factory or _default_factory(o)
        if verdict is not None:
            server = JudgeServer(lambda: factory(spec), score_ids=(verdict.yes, verdict.no))
        else:
            from hybridrl.rollout.sampling_params import SamplingParams

            stop = () if self.tokenizer.eos_token_id is None else (int(self.tokenizer.eos_token_id),)
            params = SamplingParams(temperature=0.0, max_tokens=o.max_tokens, stop_token_ids=stop)
            server = JudgeServer(lambda: factory(spec), params=params, shared_prefix=self.prompt.shared_prefix())
        self.server = server
        # close waits for the thread at most one request timeout (a stuck engine is left behind)
        self._finalizer = weakref.finalize(self, server.close, min(o.timeout_s, 5.0))

    def __call__(self, responses: list[str], answers: list, prompts: list[str]) -> list[Any]:
        tickets = []
        for response, answer, prompt in zip(responses, answers, prompts):  # each goes in as soon as it is rendered
            ids = self.prompt.token_ids(str(prompt), str(response), "" if answer is None else str(answer))
            if len(ids) > self.max_prompt_len:
                tickets.append(RewardFailure(TOO_LONG, f"{len(ids)} tokens > {self.max_prompt_len}; raise the judge's "
                                                       "max_seq_len or shorten its template or rubric"))
            else:
                tickets.append(self.server.submit(ids, self.options.timeout_s))
        return [t if isinstance(t, RewardFailure) else self._read(t) for t in tickets]

    def _read(self, ticket) -> float | RewardFailure:
        try:
            value = self.server.result(ticket)
        except RewardFailure as e:
            return e
        if self.options.parser == "verdict":
            score = verdict_probability(*value) if all(map(math.isfinite, value)) else math.nan
            return score if math.isfinite(score) else RewardFailure(UNPARSEABLE, f"non-finite verdict logits {value}")
        text = self.tokenizer.decode(value, skip_special_tokens=True)
        score = parse_number(text, self.options.scale)
        if score is None:
            return RewardFailure(UNPARSEABLE, f"no grade in the judge's answer {text[:80]!r}")
        return score

    def generate_text(self, question: str, response: str, reference: str = "") -> str:
        """The judge's greedy answer to one prompt, through the server (generate mode)."""
        value = self.server.result(self.server.submit(self.prompt.token_ids(question, response, reference),
                                                      self.options.timeout_s))
        return self.tokenizer.decode(value, skip_special_tokens=True)

    def close(self) -> None:
        """Stop the server thread (also done at garbage collection and at exit)."""
        self._finalizer()


def load_judge_tokenizer(path: str):
    """The judge's tokenizer as saved: its ``tokenizer.json`` pipeline when there is one
    (transformers 5.19's ``AutoTokenizer`` forces ``Qwen2Tokenizer`` on a ``qwen2`` config,
    which rebuilds a byte-level pipeline and drops a character tokenizer's spaces), else
    whatever ``AutoTokenizer`` loads."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... for bad files
        raise ValueError(f"path={path!r}: no tokenizer loads from it ({type(e).__name__}); save the judge's "
                         "tokenizer into that directory") from None


def _engine_spec(o: JudgeOptions, hf_config, verdict: bool):
    import torch

    from hybridrl.rollout.backend import EngineSpec

    device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = o.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    context = int(getattr(hf_config, "max_position_embeddings", None) or MAX_SEQ_LEN)
    max_seq_len = o.max_seq_len or min(context, MAX_SEQ_LEN)
    # verdict: one forward per prompt through engine.logits (no KV cache): one row is enough
    return EngineSpec(max_batch_size=1 if verdict else o.max_batch_size, max_seq_len=max_seq_len,
                      dtype=getattr(torch, dtype), device=device, quantization=o.quantization)


def _default_factory(o: JudgeOptions) -> Callable[[Any], Any]:
    def build(spec):
        if o.backend == "vllm":
            from hybridrl.vllm_backend import VllmEngine

            return VllmEngine.from_pretrained(o.path, spec)
        from hybridrl.rollout.engine import RolloutEngine

        return RolloutEngine.from_pretrained(o.path, spec)
    return build


@register_reward_factory("judge")
def judge(**options) -> LLMJudge:
    """``{name: judge, path: DIR, ...}``: an LLM judge (options: ``JudgeOptions``)."""
    return LLMJudge(JudgeOptions(**options))


judge.__signature__ = inspect.signature(JudgeOptions)  # the registry checks option names against it
