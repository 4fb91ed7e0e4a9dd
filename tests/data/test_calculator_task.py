"""The built-in agent task's data: the split, the teacher, the chat tokenizer it runs on."""

from __future__ import annotations

import json
import random

from hybridrl.data.calculator import calculator_splits, near_miss
from hybridrl.data.chat_tokenizer import CHAT_SPECIALS, build_chat_char_tokenizer


def test_calculator_splits_are_deterministic_disjoint_and_keep_the_sum_length():
    kw = dict(digits=7, train_size=300, eval_size=50, seed=3, tool_rate=0.25, tool_rate_big=0.75)
    tr, ev = calculator_splits(**kw)
    assert (tr, ev) == calculator_splits(**kw)
    assert not {e.prompt for e in ev} & {e.prompt for e in tr}
    for ex in tr:
        assert ex.prompt == f"{ex.a}+{ex.b}=" and ex.answer == str(ex.a + ex.b)
        assert len(str(ex.a)) == len(str(ex.b)) == len(ex.answer) == 7  # every copy at a fixed offset
        assert ex.tool_rate == (0.75 if str(ex.a)[0] >= "7" else 0.25)
        assert ex.estimate.startswith("~") and ex.estimate[1:] != ex.answer and len(ex.estimate) == 8
        call = json.loads(ex.tool_call_text().removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call == {"name": "add", "arguments": {"a": ex.a, "b": ex.b}}


def test_a_near_miss_is_always_wrong_and_keeps_the_length():
    rng = random.Random(0)
    for v in [5, 10, 99, 1234567, 9999999]:
        miss = near_miss(rng, v)
        assert miss != str(v) and len(miss) == len(str(v))


def test_the_chat_tokenizer_has_one_token_per_marker_and_passes_the_template_check():
    from hybridrl.agents.chat_render import ChatRenderer, check_template
    from hybridrl.agents.tool_env import ToolEnvironment

    tok = build_chat_char_tokenizer()
    for marker in CHAT_SPECIALS:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|end|>"
    tools = ToolEnvironment("hybridrl.agents.examples.calculator:Calculator")
    renderer = ChatRenderer(tok, tools.schemas())
    check_template(renderer)
    assert renderer.end_of_turn_id == tok.eos_token_id
    assert tok.decode(renderer.opening([{"role": "user", "content": "1+2="}])) == (
        "<|system|>tools: add(a,b)<|end|><|user|>1+2=<|end|><|assistant|>")
