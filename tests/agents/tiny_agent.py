"""The agents tests' tiny Qwen2 engine (its end-of-turn token likely enough that turns end)
and an in-process environment with a shared random stream (its answers depend on the order
of its calls: what only a deterministic driver reproduces)."""

from __future__ import annotations

import random

import torch
import transformers

from hybridrl.agents.types import EnvStep
from hybridrl.rollout import EngineSpec, RolloutEngine


def tiny_qwen(tok) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, max_position_embeddings=1024,
                                   tie_word_embeddings=False)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # <|im_end|>'s logit ~10.5 where the rest are ~N(0, 1): p ~ 0.1, turns end
        h = m.model(torch.randint(0, len(tok), (4, 64))).last_hidden_state.mean(dim=(0, 1))
        m.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>")] = h * (10.5 / h.dot(h))
    return m


def tiny_engine(model, max_seq_len: int = 768, max_batch_size: int = 4) -> RolloutEngine:
    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len))
    engine.load_weights(model.named_parameters())
    return engine


class EchoEnv:
    """A tool-like environment: each turn gets a tool message (random text, sometimes long)
    until turn 3, then done."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.turns = {}

    def reset(self, eids, rows):
        for e in eids:
            self.turns[e] = 0
        return [EnvStep(messages=[{"role": "user", "content": r["prompt"]}]) for r in rows]

    def step(self, items):
        out = []
        for eid, text in items:
            self.turns[eid] += 1
            words = " ".join(self.rng.choice(["sum", "42", "é", "tool", "\n", "{x}", "résultat"])
                             for _ in range(self.rng.randint(1, 40)))
            done = self.turns[eid] >= 3
            out.append(EnvStep(messages=[] if done else [{"role": "tool", "name": "echo", "content": words}],
                               reward=1.0 if done else 0.0, done=done, final_answer=text if done else None))
        return out

    def end(self, eid):
        self.turns.pop(eid, None)


class Recording:
    """The engine, its finished outputs kept by id and every request-API call logged in order."""

    def __init__(self, engine):
        self.engine, self.outputs, self.calls = engine, {}, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, request_id, token_ids, params=None, **kw):
        self.calls.append(("add", request_id, list(token_ids), params, tuple(sorted(kw.items()))))
        self.engine.add_request(request_id, token_ids, params, **kw)

    def release(self, request_id):
        self.calls.append(("release", request_id))
        return self.engine.release(request_id)

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        return self.engine.abort(request_id)

    def step(self):
        out = self.engine.step()
        for o in out.finished:
            self.outputs[o.request_id] = o
        return out
