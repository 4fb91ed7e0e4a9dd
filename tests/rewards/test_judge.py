"""The LLM judge reward (``hybridrl/rewards/judge*.py``): its parsers on hand-derived cases,
its served answers against the same engine run one prompt at a time, its verdict against a
float64 transformers forward, and its failures (a request that never answers, an engine
that blocks, raises, or answers nothing readable) each costing only their samples through
``RewardRunner``; a judge that always fails stops the run in one line.

Judges are tiny checkpoints built here (``judge_models.py``); the answers of the hand-set
``chain_judge`` are known in advance, so the failure tests know every expected score."""

from __future__ import annotations

import gc
import math
import random
import threading

import pytest
import torch

from _seeds import fresh_seed
from hybridrl.rewards import RewardBrokenError, RewardRunner, get_reward_fn
from hybridrl.rewards.breaker import StopRule
from hybridrl.rewards.judge import JudgeOptions, LLMJudge
from hybridrl.rewards.judge_parse import parse_number, verdict_probability, verdict_tokens
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from tests._greedy import rounding_margin
from tests.rewards.judge_models import CueEngine, char_tokenizer, chain_judge, random_judge

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and avoids OpenMP stalls on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("text, scale, expected", [
    ("Score: 7/10", 10, 0.7),
    ("score 7", 10, 0.7),
    ("8.5", 10, 0.85),
    ("Rating 85", 100, 0.85),
    ("37+45=82, so Score: 4 / 5", 10, 0.8),  # the number after the last "score", its own denominator
    ("Score: 3. Wait, final score: 9", 10, 0.9),
    ("between 1 and 2, I say 6", 10, 0.6),  # no "score": the last number
    ("Score: 12/10", 10, None),  # above full marks
    ("Score: -3", 10, None),
    ("Score: 7/0", 10, None),
    ("no idea", 10, None),
    ("Score: none", 10, None),
])
def test_parse_number(text, scale, expected):
    got = parse_number(text, scale)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_verdict_tokens_and_probability():
    tok = char_tokenizer()
    v = verdict_tokens(tok, " Yes", " No")  # both start with " ": read where they differ
    assert v.prefix == (tok.convert_tokens_to_ids(" "),)
    assert (v.yes, v.no) == (tok.convert_tokens_to_ids("Y"), tok.convert_tokens_to_ids("N"))
    with pytest.raises(ValueError, match="no token tells them apart"):
        verdict_tokens(tok, "Yes", "Yes")
    g = torch.Generator().manual_seed(fresh_seed())
    logits = torch.randn(50, dtype=torch.float64, generator=g) * 8
    p = torch.softmax(logits, 0)  # the definition: P(yes) / (P(yes) + P(no)) under the full softmax
    for y, n in [(3, 7), (7, 3), (0, 49)]:
        assert verdict_probability(logits[y], logits[n]) == pytest.approx(float(p[y] / (p[y] + p[n])), rel=1e-12)
    assert verdict_probability(800.0, -800.0) == 1.0 and verdict_probability(-800.0, 800.0) == 0.0


def test_option_errors_are_one_line(tmp_path):
    path = str(random_judge(tmp_path / "j", 0))
    cases = [({"path": str(tmp_path / "nope")}, "not a Hugging Face model directory"),
             ({"path": path, "parser": "stars"}, "parser='stars'"),
             ({"path": path, "template": "{question} {answer}"}, "unknown field(s) {answer}"),
             ({"path": path, "template": "{question}"}, "has no {response}"),
             ({"path": path, "rubric": "Be strict!"}, "cannot spell"),  # 'B', 'b', 'i', '!' are not in its alphabet
             ({"path": path, "backend": "vllm"}, "parser=verdict reads the logits"),
             ({"path": path, "timeout_s": 0}, "timeout_s=0")]
    for options, expected in cases:
        with pytest.raises(ValueError) as e:
            get_reward_fn("judge", where="reward.functions[0].name", **options)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert str(e.value).startswith("reward.functions[0].name='judge': "), str(e.value)


def _first_gap(hf, prompt: list[int], a: list[int], b: list[int]) -> tuple[float, float]:
    """Where greedy continuations ``a`` and ``b`` of ``prompt`` first differ: the gap between
    the two chosen tokens' logits in a transformers forward, and the rounding margin there."""
    i = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + a[:i]])).logits[0, -1].float()
    return abs(float(logits[a[i]] - logits[b[i]])), rounding_margin(logits)


def test_served_answers_equal_the_engine_alone(tmp_path):
    """Requests from two callers, the second batch added while the first decodes (the engine
    held mid-run), 3 rows for 8 requests: each answer is the token ids the same engine
    generates greedily for that prompt alone; the shared prefix is prefilled once."""
    from transformers import AutoModelForCausalLM

    seed = fresh_seed()
    rng = random.Random(seed)
    path = random_judge(tmp_path / "j", seed)
    spec_kw = dict(max_batch_size=3, max_seq_len=64)
    judge = LLMJudge(JudgeOptions(path=str(path), parser="number", max_tokens=12, device="cpu", **spec_kw),
                     engine_factory=lambda spec: CueEngine.from_pretrained(str(path), spec, hold_at_step=3))
    draws = [(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", str(rng.randint(0, 198))) for _ in range(8)]
    prompts = [judge.prompt.token_ids(q, r, "") for q, r in draws]
    engine = judge.server.engine
    tickets = [judge.server.submit(p, 600) for p in prompts[:4]]
    engine.blocked.wait()  # the engine is inside its 2nd decode step of the first batch
    later: list = []
    caller = threading.Thread(target=lambda: later.extend(judge.server.submit(p, 600) for p in prompts[4:]))
    caller.start()
    caller.join()
    engine.release.set()
    served = [judge.server.result(t) for t in tickets + later]

    alone = RolloutEngine.from_pretrained(str(path), EngineSpec(**spec_kw))
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(judge.tokenizer.eos_token_id,))
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    for p, got in zip(prompts, served):
        want = alone.generate([p], params).response_token_ids[0]  # this prompt alone in the engine
        if got != want:  # only a near-tie may tell two float32 runs apart (tests/_greedy.py)
            gap, margin = _first_gap(hf, p, got, want)
            assert gap < margin, f"seed {seed}: served {got} != alone {want} (logit gap {gap:.3g} > {margin:.3g})"
    prefix = judge.prompt.shared_prefix()
    assert len(prefix) >= 4 and judge.server.parent is not None
    assert engine.scheduler.stats["cached_tokens"] == len(prompts) * len(prefix), f"seed {seed}"
    judge.close()


@pytest.mark.parametrize("chat", [False, True])
def test_verdict_equals_a_float64_forward(tmp_path, chat):
    """P(yes) / (P(yes) + P(no)) from the engine's one forward (no decode step) against a float64
    transformers forward of the same text. Bound: the score is sigmoid(z_yes - z_no), whose
    slope is at most 1/4, and each float32 logit is off by at most 32 ulps of its dot product's
    absolute sum sum_i |h_i||W_ji| (tests/trainer/test_prefix_consistency.py: measured <= 8);
    so |error| <= 1/4 * 2 * 32 ulps of the larger sum. ``chat``: the tokenizer renders the
    judge prompt through its chat template (the verdict words become "Yes" / "No")."""
    from transformers import AutoModelForCausalLM

    seed = fresh_seed()
    rng = random.Random(seed)
    tok = char_tokenizer()
    if chat:
        tok = _with_chat_template(tok)
    path = random_judge(tmp_path / "j", seed, tok)
    judge = get_reward_fn("judge", path=str(path), parser="verdict", device="cpu")
    draws = [(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", str(rng.randint(0, 198))) for _ in range(6)]
    scores = judge([r for _, r in draws], [None] * 6, [q for q, _ in draws])
    assert judge.server.engine.scheduler.stats["steps"] == 0  # nothing decoded, nothing sampled

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    yes, no = (tok.convert_tokens_to_ids("Y"), tok.convert_tokens_to_ids("N"))
    for (q, r), got in zip(draws, scores):
        text = f"Q: {q} A: {r} Correct?"
        if chat:  # the template below: <|u|>TEXT<|a|>, no <bos>, read right after <|a|>
            ids = tok.encode(f"<|u|>{text}<|a|>", add_special_tokens=False)
        else:  # <bos> TEXT, then the " " both " Yes" and " No" start with
            ids = [tok.bos_token_id] + tok.encode(text + " ", add_special_tokens=False)
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
        z = out.logits[0, -1]
        p = torch.softmax(z, 0)
        want = float(p[yes] / (p[yes] + p[no]))
        h, w = out.hidden_states[-1][0, -1].abs(), hf.lm_head.weight.detach().abs()
        condition = max(float(h @ w[yes]), float(h @ w[no]), float(z.abs().max()))
        tol = 0.25 * 2 * 32 * EPS32 * condition
        assert abs(got - want) <= tol, f"seed {seed}: {got} vs float64 {want} (|diff| {abs(got - want):.3g} > {tol:.3g})"
    judge.close()


def _with_chat_template(tok):
    """The char tokenizer with a two-marker chat template (markers are single special tokens)."""
    from hybridrl.data.char_tokenizer import ARITHMETIC_CHARS, build_char_tokenizer
    from tests.rewards.judge_models import CHARS, CUES

    assert CHARS.startswith(ARITHMETIC_CHARS)
    template = ("{% for m in messages %}{{ '<|u|>' + m.content }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|a|>' }}{% endif %}")
    chat = build_char_tokenizer(CHARS, specials=CUES + ("<|u|>", "<|a|>"), chat_template=template)
    return chat


def _chain_runner(tmp_path, template: str, timeout_s: float, stop_rule: StopRule | None = None):
    path = chain_judge(tmp_path / "chain")
    judge = LLMJudge(JudgeOptions(path=str(path), parser="number", template=template, max_tokens=16,
                                  timeout_s=timeout_s, device="cpu", max_seq_len=64),
                     engine_factory=lambda spec: CueEngine.from_pretrained(str(path), spec))
    rule = stop_rule or StopRule(max_failure_rate=None)
    return judge, RewardRunner(judge, failure_reward=-1.0, stop_rule=rule)


def test_each_failure_costs_only_its_sample(tmp_path):
    """In one batch: good answers (the chain judge writes "Score: 7/10" after a response
    ending in ">"), one that it answers with nothing ("judge unparseable"), one it never
    answers ("judge timeout"), one whose add_request raises ("judge crashed")."""
    seed = fresh_seed()
    rng = random.Random(seed)
    judge, runner = _chain_runner(tmp_path, "{question}|{response}", timeout_s=3.0)
    warm = runner.score(["5>"], [None], ["1+1="])  # first calls pay for lazy setup, not the timed batch
    assert warm.scores == pytest.approx([0.7]) and not warm.failures
    kinds = ["good"] * 5 + ["junk", "hang", "crash"]
    rng.shuffle(kinds)
    response = {"good": "12>", "junk": "12z", "hang": "<hang>1>", "crash": "<crash>1>"}
    batch = runner.score([response[k] for k in kinds], [None] * len(kinds), [f"{rng.randint(0, 99)}+1="] * len(kinds))
    want = [0.7 if k == "good" else -1.0 for k in kinds]
    assert batch.scores == pytest.approx(want), f"seed {seed}: {kinds}"
    assert dict(batch.failures) == {"judge unparseable": 1, "judge timeout": 1, "judge crashed": 1}
    assert set(runner.first_errors) == set(batch.failures)
    # the server goes on: the next batch is answered
    again = runner.score(["3>", "4>"], [None, None], ["1+1=", "2+2="])
    assert again.scores == pytest.approx([0.7, 0.7]) and not again.failures
    judge.close()


def test_a_crashing_step_fails_its_batch_and_the_engine_is_rebuilt(tmp_path):
    judge, runner = _chain_runner(tmp_path, "{question}|{response}", timeout_s=60.0)
    batch = runner.score(["1>", "<boom>2>", "3>"], [None] * 3, ["1+1="] * 3)
    assert dict(batch.failures) == {"judge crashed": 3}  # the engine raised with all three in it
    assert "simulated judge fault in step" in runner.first_errors["judge crashed"]
    again = runner.score(["1>", "2>"], [None] * 2, ["1+1="] * 2)  # served by the rebuilt engine
    assert again.scores == pytest.approx([0.7, 0.7]) and not again.failures
    assert judge.server.stats["restarts"] == 1
    judge.close()


def test_a_blocked_engine_times_out_and_closes(tmp_path):
    """The engine blocks inside a step: every pending sample times out (measured from its
    submission), close() returns, and the thread ends once the step returns."""
    judge, runner = _chain_runner(tmp_path, "{question}|{response}", timeout_s=0.5)
    engine, thread = judge.server.engine, judge.server._thread
    batch = runner.score(["1>", "<block>2>", "3>"], [None] * 3, ["1+1="] * 3)
    assert dict(batch.failures) == {"judge timeout": 3}
    assert engine.blocked.is_set()
    judge.close()  # does not wait on the stuck step for ever
    engine.release.set()
    thread.join()
    assert not thread.is_alive()


def test_an_always_failing_judge_stops_the_run_in_one_line(tmp_path):
    """Every answer is empty (the prompt ends in "?", after which the chain judge stops)."""
    judge, runner = _chain_runner(tmp_path, "{question}{response}?", timeout_s=60.0,
                                  stop_rule=StopRule(window=4, max_failure_rate=0.9))
    with pytest.raises(RewardBrokenError) as e:
        runner.score(["1>"] * 6, [None] * 6, ["1+1="] * 6)
    message = str(e.value)
    assert "\n" not in message and "4 judge unparseable" in message and "reward 'judge' is broken" in message, message
    judge.close()


def test_close_and_garbage_collection_stop_the_server(tmp_path):
    judge = get_reward_fn("judge", path=str(random_judge(tmp_path / "j", 0)), parser="verdict", device="cpu")
    thread = judge.server._thread
    assert math.isfinite(judge(["1"], [None], ["1+1="])[0])
    del judge
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()


def test_the_default_template_and_the_builtin_alphabet():
    """The built-in character tokenizer cannot spell the default template (one-line error);
    the alphabet of scripts/train_judge.py can, and the template stays short (a char judge
    reads every character)."""
    import importlib.util
    from pathlib import Path

    from hybridrl.job.model_factory import builtin_tokenizer
    from hybridrl.rewards.judge_prompt import DEFAULT_TEMPLATE, JudgePrompt

    with pytest.raises(ValueError, match="cannot spell") as e:
        JudgePrompt(builtin_tokenizer(), DEFAULT_TEMPLATE, "").check_spelling("builtin")
    assert "\n" not in str(e.value)
    script = Path(__file__).resolve().parents[2] / "scripts" / "train_judge.py"
    spec = importlib.util.spec_from_file_location("train_judge", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from hybridrl.data.char_tokenizer import build_char_tokenizer

    prompt = JudgePrompt(build_char_tokenizer(module.judge_chars()), DEFAULT_TEMPLATE, "")
    prompt.check_spelling("train_judge")
    assert len(prompt.token_ids("37+45=", "82", "")) <= 32
