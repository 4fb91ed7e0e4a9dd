"""The built-in agent task's data (``data.task=calculator``): prompt sets for the episodes and
the teacher's multi-turn demonstrations for the warm start (``job/demonstrations.py``).

The demonstrations are rendered with the run's own tool environment settings (``env.*``:
tools class, parser, system prompt) and chat template, so they are laid out token for
token as the episodes RL samples.
"""

from __future__ import annotations

from hybridrl.config import Config
from hybridrl.job.demonstrations import DemoRenderer, TeacherDemos
from hybridrl.trainer.prompts import PromptSet


def calculator_data(cfg: Config, tokenizer) -> tuple[PromptSet, PromptSet, TeacherDemos]:
    from hybridrl.agents.chat_render import ChatRenderer
    from hybridrl.agents.tool_env import ToolEnvironment
    from hybridrl.data.calculator import calculator_splits
    from hybridrl.data.char_tokenizer import encode_prompt

    d, e = cfg.data, cfg.env
    train, ev = calculator_splits(digits=d.operand_digits, train_size=d.train_size, eval_size=d.eval_size,
                                  seed=d.seed, tool_rate=d.teacher_tool_rate, tool_rate_big=d.teacher_tool_rate_big)

    def to_set(exs) -> PromptSet:
        return PromptSet([encode_prompt(tokenizer, x.prompt) for x in exs], [x.answer for x in exs],
                         [x.prompt for x in exs])

    tools = ToolEnvironment(e.name, parser=e.parser, max_tool_calls=e.max_tool_calls, system_prompt=e.system_prompt)
    if "add" not in tools.methods:
        raise ValueError(f"data.task=calculator: env.name={e.name} has no 'add' tool (its tools: "
                         f"{', '.join(tools.methods)}); use hybridrl.agents.examples.calculator:Calculator")
    renderer = DemoRenderer(tools, ChatRenderer(tokenizer, tools.schemas()), tokenizer, context_tokens=e.context_tokens)
    demos = TeacherDemos([{"prompt": x.prompt, "answer": x.answer} for x in train], [x.tool_rate for x in train],
                         lambda i, uses_tool: train[i].teacher_turns(uses_tool), renderer)
    return to_set(train), to_set(ev), demos
