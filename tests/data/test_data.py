import json

import pytest

from hybridrl.data.arithmetic import arithmetic_splits
from hybridrl.data.char_tokenizer import build_char_tokenizer, encode_prompt
from hybridrl.data.files import load_prompt_files


def test_arithmetic_splits_are_deterministic_disjoint_and_correct():
    tr1, ev1 = arithmetic_splits(num_digits=2, operations="+-*", train_size=500, eval_size=50, seed=3)
    tr2, ev2 = arithmetic_splits(num_digits=2, operations="+-*", train_size=500, eval_size=50, seed=3)
    assert tr1 == tr2 and ev1 == ev2
    assert not {e.prompt for e in ev1} & {e.prompt for e in tr1}
    for ex in tr1[:100]:
        expr = ex.prompt.rstrip("=")
        assert str(eval(expr)) == ex.answer  # noqa: S307 - digits and one operator only
    assert {ex.prompt[2] if ex.prompt[2] in "+-*" else ex.prompt[1] for ex in tr1} <= set("+-*")


def test_small_space_is_capped():
    tr, ev = arithmetic_splits(num_digits=1, operations="+", train_size=10_000, eval_size=10, seed=0)
    assert len(ev) == 10 and 0 < len(tr) <= 90
    assert not {e.prompt for e in ev} & {e.prompt for e in tr}


def test_char_tokenizer_roundtrip_and_save(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    ids = encode_prompt(tok, "37+45=")
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "37+45="
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again.encode("12*3", add_special_tokens=False) == tok.encode("12*3", add_special_tokens=False)
    assert again.pad_token_id == 0 and again.eos_token_id == 2


def test_jsonl_bad_rows_are_skipped_and_counted(tmp_path):
    tok = build_char_tokenizer()
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+2=", "answer": "3"}, "not json", {"question": "x"}, {"prompt": 5},
            {"prompt": "9" * 100, "answer": "1"}, {"prompt": "2+2="}]
    f.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    recs, report = load_prompt_files([str(f)], tok, prompt_key="prompt", answer_key="answer", max_prompt_length=20)
    assert [r.answer for r in recs] == ["3", None]
    assert report.loaded == 2 and sum(report.skipped.values()) == 4
    assert recs[0].source == f"{f}:1"


def test_parquet_and_chat_template(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz:\n")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}a:"
    table = pa.table({"prompt": [json.dumps([{"role": "user", "content": "1+1="}])], "answer": ["2"]})
    # parquet with a text column holding messages is not a chat list: it is text
    pq.write_table(table, tmp_path / "p.parquet")
    recs, _ = load_prompt_files([str(tmp_path / "p.parquet")], tok, prompt_key="prompt", answer_key="answer",
                                max_prompt_length=200)
    assert len(recs) == 1 and recs[0].answer == "2"
    chat = tmp_path / "c.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    recs, _ = load_prompt_files([str(chat)], tok, prompt_key="prompt", answer_key="answer", max_prompt_length=200)
    assert tok.decode(recs[0].prompt_ids) == "user: 1+1=\na:"


def test_missing_file_is_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_prompt_files([str(tmp_path / "nope.jsonl")], build_char_tokenizer(), prompt_key="prompt",
                          answer_key="answer", max_prompt_length=10)


def _load(files, tok=None, max_prompt_length=20):
    return load_prompt_files([str(f) for f in files], tok or build_char_tokenizer(), prompt_key="prompt",
                             answer_key="answer", max_prompt_length=max_prompt_length)


def test_invalid_utf8_row_is_skipped_and_counted_with_its_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n'
                  b'{"prompt": "2+\xff="}\n'
                  b'{"prompt": "3+3=", "answer": "6"}\n'
                  b'\xc3\x28\n')
    recs, report = _load([f])
    assert [r.answer for r in recs] == ["2", "6"]
    assert report.skipped == {"invalid UTF-8": 2}
    assert report.first["invalid UTF-8"] == f"{f}:2"
    assert f"2 invalid UTF-8 (first at {f}:2)" in report.summary()


def test_deeply_nested_json_and_a_bom_do_not_abort_the_file(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes("\ufeff".encode() + b'{"prompt": "1+1="}\n' + b"[" * 100_000 + b"\n" + b'{"prompt": "2+2="}\n')
    recs, report = _load([f])
    assert len(recs) == 2 and report.skipped == {"unparseable": 1} and report.first["unparseable"] == f"{f}:2"


def test_corrupt_parquet_is_one_line(tmp_path):
    f = tmp_path / "d.parquet"
    f.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match="cannot read it as parquet") as err:
        _load([f])
    assert "\n" not in str(err.value) and str(f) in str(err.value)


def test_chat_rows_without_a_chat_template_name_the_row(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": [{"role": "user", "content": "1"}]}))
    with pytest.raises(ValueError, match=f"{f}:2: chat-message prompts need a tokenizer with a chat_template"):
        _load([f])


def test_rows_a_chat_template_cannot_render_are_skipped(tmp_path):
    tok = build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz:\n")
    tok.chat_template = "{% if messages[0]['content'] == 'x' %}{{ raise_exception('no x') }}{% endif %}" \
                        "{{ messages[0]['content'] }}"
    f = tmp_path / "c.jsonl"
    rows = [[{"role": "user", "content": "x"}], [], [{"role": "user", "content": "1+1="}]]  # [] raised ValueError
    f.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    recs, report = _load([f], tok, 200)
    assert len(recs) == 1 and report.skipped == {"malformed prompt": 2} and report.first["malformed prompt"] == f"{f}:1"
