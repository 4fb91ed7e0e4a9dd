"""The shipped agent demo (examples/calculator_agent.yaml), shrunk to seconds: warm start on
multi-turn demonstrations, 2 RL steps of episodes, episode evals, end to end through
``train``. Checks the agent metrics, that tool spans are never trained (warm start and RL)
and that no environment worker process outlives the run."""

from __future__ import annotations

import os
from pathlib import Path

from hybridrl.config.io import load_config
from hybridrl.data.chat_tokenizer import build_chat_char_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calculator_agent.yaml"
SHRUNK = ["data.train_size=64", "data.eval_size=8", "batch.prompts_per_step=4", "rollout.n=2",
          "warm_start.steps=60", "warm_start.batch_size=8", "warm_start.lr=3e-3",
          # every demonstration calls the tool: the policy then opens its turns with <tool_call>
          # after a few steps, so the RL episodes have tool spans to mask
          "data.teacher_tool_rate=1.0", "data.teacher_tool_rate_big=1.0",
          "trainer.total_steps=2", "trainer.eval_every=2", "trainer.threads=1", "checkpoint.save=false",
          "logging.tensorboard=false", "logging.plot=false", "logging.progress=false"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # killed but not yet reaped by its parent: gone for every purpose here
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tool_spans(ids: list[int], tok) -> list[int]:
    """Positions of every tool message: from a ``<|tool|>`` marker up to and including the
    ``<|assistant|>`` header that follows it (what the environment adds, never sampled)."""
    tool, assistant = tok.convert_tokens_to_ids(["<|tool|>", "<|assistant|>"])
    out, inside = [], False
    for i, t in enumerate(ids):
        inside = inside or t == tool
        if inside:
            out.append(i)
        if inside and t == assistant:
            inside = False
    return out


def _environment_spans(ids: list[int], sampled: list[float], tok) -> list[list[int]]:
    """In an RL episode: what follows each sampled end-of-turn token up to and including
    the next ``<|assistant|>`` header — the tool message the environment appended (a turn
    stops at its first end-of-turn token, so whatever follows it is not sampled)."""
    end, assistant = tok.convert_tokens_to_ids(["<|end|>", "<|assistant|>"])
    spans, i = [], 0
    while i < len(ids):
        if ids[i] == end and sampled[i] == 1 and i + 1 < len(ids) and ids[i + 1] != tok.pad_token_id:
            j = i + 1
            while j < len(ids) and ids[j] != assistant:
                j += 1
            spans.append(list(range(i + 1, min(j + 1, len(ids)))))
            i = j
        i += 1
    return spans


def test_the_shipped_demo_config_loads_and_names_its_task():
    cfg = load_config(str(EXAMPLE))
    assert cfg.data.task == "calculator" and cfg.env.name.endswith("calculator:Calculator")


def test_warm_start_demonstrations_learn_the_assistant_turns_only():
    from hybridrl.job.agent_data import calculator_data
    from hybridrl.job.sft import masked_sft_batch

    tok = build_chat_char_tokenizer()
    cfg = load_config(str(EXAMPLE), ["data.train_size=8", "data.eval_size=2"])
    _, _, demos = calculator_data(cfg, tok)
    d = demos.demo(0, uses_tool=True)
    ids, _, labels = masked_sft_batch([d.ids], [d.loss_mask], tok.pad_token_id)
    learned = tok.decode([t for t in labels[0].tolist() if t != -100], skip_special_tokens=False)
    row = demos.rows[0]
    assert learned.startswith('<tool_call>{"name":"add","arguments":{"a":') and learned.endswith(row["answer"] + "<|end|>")
    spans = _tool_spans(d.ids, tok)
    assert spans and all(labels[0, i] == -100 for i in spans)
    assert tok.decode(ids[0, spans].tolist()) == f"<|tool|>{row['answer']}<|end|><|assistant|>"


def test_two_rl_steps_of_the_shrunk_demo_run_end_to_end(tmp_path, monkeypatch):
    from hybridrl.job import loop

    pids, batches = [], []
    real_build = loop.build_run

    def build(cfg, *args, **kwargs):
        run = real_build(cfg, *args, **kwargs)
        source, real_eval = run.step.source, run.eval_episodes
        real_take = source.take

        def take(model):  # the RL episodes: run by the source's producers, each with its environment pool
            batch = real_take(model)
            pids.extend(pid for p in source.producers for pid in p.runner.env_pool.pids())
            batches.append(batch.step_batch)
            return batch

        def eval_episodes():  # the eval's episodes: an environment pool of their own
            runner = real_eval()
            pids.extend(runner.env_pool.pids())
            return runner

        source.take, run.eval_episodes = take, eval_episodes
        return run

    monkeypatch.setattr(loop, "build_run", build)
    cfg = load_config(str(EXAMPLE), SHRUNK + [f"trainer.output_dir={tmp_path}"])
    result = loop.train(cfg)
    assert pids and not [p for p in pids if _alive(p)], "an environment worker outlived the run"
    rows = {r["step"]: r for r in result.history}
    assert set(rows) == {0, 1, 2}
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/truncated", "agent/failed",
                "agent/trained_token_share", "reward/mean"):
        assert key in rows[1] and key in rows[2], key
    for step in (0, 2):  # the evals ran episodes
        assert "eval/accuracy" in rows[step] and "eval/agent/tool_calls" in rows[step]
    tok = build_chat_char_tokenizer()
    tool = tok.convert_tokens_to_ids("<|tool|>")
    checked = 0
    for sb in batches:
        ro = sb.rollouts
        for b in range(ro.input_ids.shape[0]):
            ids, mask = ro.input_ids[b].tolist(), ro.response_mask[b].tolist()
            for span in _environment_spans(ids, mask, tok):
                assert ids[span[0]] == tool and not any(mask[i] for i in span)
                checked += 1
    assert checked > 0, "no episode called the tool: nothing was checked"
