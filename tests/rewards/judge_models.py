"""Small judge checkpoints built in code (no downloads) and an engine that misbehaves on cue.

- ``random_judge``: a random-init Qwen2 judge (weights scaled so greedy answers are not
  degenerate) over a character tokenizer that can spell the default template.
- ``chain_judge``: a Qwen2 judge whose weights are set by hand so that its next token is a
  function of the current one (attention and MLP outputs zeroed, one-hot embeddings, the
  LM head maps each token to its successor): after a prompt ending in ``>`` it writes
  ``Score: 7/10``, after any other character it stops at once (an empty, unreadable
  answer). A real model served by the real engine whose answers are known in advance.
- ``CueEngine``: the built-in engine, except on requests whose prompt holds a cue token:
  ``<hang>`` is accepted and never scheduled (it never answers), ``<crash>`` makes
  ``add_request`` raise, ``<boom>`` makes the next ``step`` raise, ``<block>`` makes ``step``
  block until ``CueEngine.release`` is set; ``hold_at_step=N``: the N-th ``step`` call
  blocks the same way whatever runs (a test adds requests meanwhile).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from hybridrl.data.char_tokenizer import ARITHMETIC_CHARS, build_char_tokenizer
from hybridrl.rollout import RolloutEngine

CHARS = ARITHMETIC_CHARS + "QA:?CorectYsNS/>z|"
CUES = ("<hang>", "<crash>", "<boom>", "<block>")
CHAIN = "Score: 7/10"  # what the chain judge writes after ">"


def char_tokenizer():
    return build_char_tokenizer(CHARS, specials=CUES)


def _qwen2_config(tok, hidden: int, layers: int, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=256,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       tie_word_embeddings=False, **extra)


def random_judge(path: Path, seed: int, tok=None) -> Path:
    """A random Qwen2 judge saved (with its tokenizer) to ``path``."""
    from transformers import Qwen2ForCausalLM

    tok = tok if tok is not None else char_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_qwen2_config(tok, 64, 2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) * (0.5 if "embed" in name else 0.12))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def chain_judge(path: Path) -> Path:
    """The hand-set successor judge described in the module docstring."""
    from transformers import Qwen2ForCausalLM

    tok = char_tokenizer()
    V = len(tok)
    model = Qwen2ForCausalLM(_qwen2_config(tok, -(-V // 8) * 8, 1))  # even head_dim (rotary)
    succ = {i: tok.eos_token_id for i in range(V)}  # every token is followed by eos ...
    chain = [tok.convert_tokens_to_ids(c) for c in ">" + CHAIN] + [tok.eos_token_id]
    succ.update(zip(chain[:-1], chain[1:]))  # ... except along ">Score: 7/10"
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)  # o_proj, down_proj = 0: each layer adds nothing
        model.model.embed_tokens.weight[torch.arange(V), torch.arange(V)] = 1.0
        for i, j in succ.items():
            model.lm_head.weight[j, i] = 10.0  # logit 10 * sqrt(hidden) for the successor, 0 for the rest
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class CueEngine(RolloutEngine):
    """``RolloutEngine`` that misbehaves on requests holding a cue token (module docstring)."""

    def __init__(self, *args, hold_at_step: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold_at_step, self.steps = hold_at_step, 0
        self.release = threading.Event()  # a blocked step returns once this is set
        self.blocked = threading.Event()  # set while a step is blocked
        tok = char_tokenizer()
        self.cue_ids = {tok.convert_tokens_to_ids(c): c for c in CUES}
        self.cued: dict[str, str] = {}  # request id -> its cue

    def add_request(self, request_id, token_ids, params=None, **kw):
        cue = next((self.cue_ids[t] for t in token_ids if t in self.cue_ids), None)
        if cue == "<crash>":
            raise RuntimeError("simulated judge fault on add_request")
        if cue is not None:
            self.cued[request_id] = cue
        if cue == "<hang>":
            return  # accepted, never scheduled
        super().add_request(request_id, token_ids, params, **kw)

    def step(self):
        running = set(self.cued) & {s.request_id for s in self.scheduler.live.values()}
        cues = {self.cued[r] for r in running}
        if "<boom>" in cues:
            raise RuntimeError("simulated judge fault in step")
        self.steps += 1
        if "<block>" in cues or self.steps == self.hold_at_step:
            self.blocked.set()
            self.release.wait()
        return super().step()

    def abort(self, request_id):
        if self.cued.get(request_id) == "<hang>":
            return None
        return super().abort(request_id)
