"""LLM-judge throughput: responses judged per second, served by our engine vs one
transformers ``generate`` call per response (``benchmarks/rewards.py`` assembles the rows).

The judge: a random-init Qwen2 (hidden 256, 4 layers; ``quick``: 2 layers) over a character
tokenizer of printable ASCII, fp32 on CPU; a rubric of ~400 characters shared by every
prompt (``rubric``), then the question and a 20-40 character response; greedy answers of
``max_tokens`` new tokens, read by the ``number`` parser.

- ours: the ``judge`` reward (``hybridrl/rewards/judge.py``) called on the whole batch: one
  server thread, every request added at once and decoded together (continuous batching),
  the rubric prefix prefilled once and continued from by every request (retained parent);
- baselines: what a TRL user writes for a judge reward function: per response, render the
  same prompt text, ``tokenizer(text, return_tensors="pt")``, ``model.generate(...,
  do_sample=False, max_new_tokens=max_tokens)``, decode, parse; and the same with the whole
  batch in one left-padded ``generate`` call (the careful user's version).

Both read the same text and produce the same greedy answers; best of interleaved rounds.
Rows: responses judged / s, and prompt tokens prefilled per response.

    python benchmarks/reward_cases/judge.py [--quick] [--json PATH]
"""

from __future__ import annotations

import random
import string
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: _common
sys.path.insert(0, str(HERE.parents[1]))  # the repository: hybridrl

from _common import best_interleaved, parse_args, report, row  # noqa: E402

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
RUBRIC = ("You are a strict grader of arithmetic answers. Read the question and the response. "
          "Check every digit of the final answer against your own computation; ignore formatting "
          "and any explanation the response gives. A correct final answer earns 10 points, an "
          "answer off by one digit earns 3, anything else earns 0. Reply with exactly one line "
          "of the form Score: N/10 and nothing else.\n")
TEMPLATE = "{rubric}Question: {question}\nResponse: {response}\n"


def _judge_dir(directory: Path, layers: int) -> Path:
    import torch
    import transformers

    from hybridrl.data.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(CHARS)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=256, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=768,
                                   max_position_embeddings=1024, tie_word_embeddings=False,
                                   pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # scaled like the tests' models: greedy answers far from degenerate
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) * (0.5 if "embed" in name else 0.08))
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _batch(n: int) -> tuple[list[str], list[str]]:
    rng = random.Random(0)
    questions, responses = [], []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        questions.append(f"{a}+{b}=")
        responses.append(f"I add {a} and {b}: the answer is {a + b + rng.choice([0, 0, 1, -10])}.")
    return questions, responses


def rows(quick: bool) -> list[dict]:
    import torch
    import transformers

    from hybridrl.rewards.judge import JudgeOptions, LLMJudge, load_judge_tokenizer
    from hybridrl.rewards.judge_parse import parse_number

    n, max_tokens, layers, repeats = (16, 8, 2, 2) if quick else (64, 16, 4, 3)
    questions, responses = _batch(n)
    with tempfile.TemporaryDirectory() as tmp:
        path = _judge_dir(Path(tmp) / "judge", layers)
        judge = LLMJudge(JudgeOptions(path=str(path), parser="number", template=TEMPLATE, rubric=RUBRIC,
                                      max_tokens=max_tokens, timeout_s=600, device="cpu", max_batch_size=n,
                                      max_seq_len=640))
        tok = load_judge_tokenizer(str(path))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

        def ours():
            return judge(responses, [None] * n, questions)

        def baseline():  # one generate call per response, as a TRL reward function would
            scores = []
            for q, r in zip(questions, responses):
                enc = tok(TEMPLATE.format(rubric=RUBRIC, question=q, response=r, reference=""), return_tensors="pt")
                with torch.no_grad():
                    out = hf.generate(**enc, do_sample=False, max_new_tokens=max_tokens,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                scores.append(parse_number(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True),
                                           10.0))
            return scores

        def batched():  # the whole batch in one left-padded generate call, as a careful TRL user would
            texts = [TEMPLATE.format(rubric=RUBRIC, question=q, response=r, reference="")
                     for q, r in zip(questions, responses)]
            tok.padding_side = "left"
            enc = tok(texts, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = hf.generate(**enc, do_sample=False, max_new_tokens=max_tokens,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            width = enc["input_ids"].shape[1]
            return [parse_number(tok.decode(o[width:], skip_special_tokens=True), 10.0) for o in out]

        stats = judge.server.engine.scheduler.stats
        before = dict(stats)
        ours()
        prefilled = (stats["prefill_tokens"] - before["prefill_tokens"]) / n
        prompt_len = sum(len(judge.prompt.token_ids(q, r, "")) for q, r in zip(questions, responses)) / n
        t0 = time.perf_counter()
        t_ours, t_base, t_batched = best_interleaved([ours, baseline, batched], repeats)
        judge.close()
    setting = (f"transformers {transformers.__version__} generate, one call per response, greedy, "
               f"max_new_tokens={max_tokens}, fp32 CPU, KV cache on")
    case = f"judge {n} resp x {max_tokens} tok, {layers}L h256"
    print(f"# judge benchmark: {time.perf_counter() - t0:.1f} s timed", file=sys.stderr)
    return [row(case=case, metric="responses/s", ours=n / t_ours, baseline=n / t_base, baseline_name=setting,
                higher_is_better=True),
            row(case=case, metric="responses/s", ours=n / t_ours, baseline=n / t_batched,
                baseline_name=setting.replace("one call per response", f"all {n} in one left-padded call"),
                higher_is_better=True),
            row(case=case, metric="prefill tok/resp", ours=prefilled, baseline=prompt_len,
                baseline_name="same, whole prompt prefilled per call", higher_is_better=False)]


if __name__ == "__main__":
    args = parse_args(__doc__)
    report(rows(args.quick), args.json)
