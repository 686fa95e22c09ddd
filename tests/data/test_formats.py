"""Reading alpaca / GSM8K / MetaMathQA / messages files, final answers, and the input errors."""

from __future__ import annotations

import json

import pytest

from lazytrain.data.formats import extract_final_answer, load_examples, read_dataset
from lazytrain.data.synthetic import arithmetic_dataset


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_rows_become_question_answer_with_calculator_marks_removed(tmp_path):
    row = {"question": "Natalia sold 48 clips. How many?",
           "answer": "She sold 48/2 = <<48/2=24>>24 in May.\n#### 1,072"}
    (ex,), fmt = read_dataset(_write_jsonl(tmp_path / "g.jsonl", [row]))
    assert fmt == "gsm8k"
    assert [m.role for m in ex.messages] == ["user", "assistant"]
    assert ex.messages[0].content == row["question"]
    assert ex.messages[1].content == "She sold 48/2 = 24 in May.\n#### 1,072"
    assert ex.messages[1].train and not ex.messages[0].train
    assert ex.answer == "1072"


def test_alpaca_input_is_appended_to_the_instruction(tmp_path):
    rows = [{"instruction": "Add.", "input": "2 and 3", "output": "5"},
            {"instruction": "Say hi.", "input": "", "output": "hi"}]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows))
    first, second = load_examples(path, "alpaca")
    assert first.messages[0].content == "Add.\n\n2 and 3"
    assert second.messages[0].content == "Say hi."
    assert first.messages[1].content == "5" and first.answer is None


def test_metamathqa_answer_comes_from_the_answer_is_line(tmp_path):
    row = {"type": "GSM_Rephrased", "query": "What is 2+2?", "original_question": "q",
           "response": "2+2 is 4.\nThe answer is: 4"}
    (ex,), fmt = read_dataset(_write_jsonl(tmp_path / "m.jsonl", [row]))
    assert fmt == "metamathqa" and ex.answer == "4"
    assert ex.messages[0].content == "What is 2+2?"


def test_messages_format_trains_every_assistant_turn(tmp_path):
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    (ex,) = load_examples(_write_jsonl(tmp_path / "c.jsonl", [row]))
    assert [m.train for m in ex.messages] == [False, True, False, True]
    assert [m.content for m in ex.prompt_messages] == ["a", "b", "c"]


def test_shared_files_parse_in_their_formats(shared_dir):
    gsm = load_examples(shared_dir / "data/gsm8k/test.jsonl")
    assert len(gsm) == 1319 and all(ex.answer for ex in gsm)
    assert len(load_examples(shared_dir / "data/alpaca_en_demo/alpaca_en_demo.json")) == 10
    meta = load_examples(shared_dir / "data/metamathqa/metamathqa_schema_sample.json")
    assert [ex.answer for ex in meta][0] == "\\sqrt{5}"


@pytest.mark.parametrize("text, expected", [
    ("so 5 + 7 = 12\n#### 12", "12"),
    ("The answer is: 3.50", "3.5"),
    ("I think it is 40 or 41.", "41"),
    ("#### $1,234.00", "1234"),
    ("no numbers here", None),
])
def test_final_answer_extraction(text, expected):
    assert extract_final_answer(text) == expected


def test_a_missing_column_names_the_record_and_column(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"},
                                                 {"question": "q2"}])
    with pytest.raises(ValueError, match=r"record 1: column 'answer' is missing"):
        load_examples(path, "gsm8k")


def test_an_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl has no records"):
        load_examples(tmp_path / "empty.jsonl")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no records"):
        load_examples(tmp_path / "empty.json")


def test_a_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"question": "q", "answer": "a"}\n{oops\n')
    # datasets (pyarrow) names the row, counted from 0: row 1 is line 2
    with pytest.raises(ValueError, match=r"x.jsonl cannot be read .*in row 1"):
        load_examples(tmp_path / "x.jsonl")


def test_unknown_columns_cannot_be_detected(tmp_path):
    with pytest.raises(ValueError, match="cannot detect the format"):
        load_examples(_write_jsonl(tmp_path / "u.jsonl", [{"body": "t"}]))  # text: TRL's


def test_arithmetic_dataset_is_deterministic_and_eval_is_held_out():
    train_a, eval_a = arithmetic_dataset(num_train=300, num_eval=16, seed=3)
    train_b, eval_b = arithmetic_dataset(num_train=300, num_eval=16, seed=3)
    assert train_a == train_b and eval_a == eval_b
    assert not {e.messages[0].content for e in eval_a} & {e.messages[0].content for e in train_a}
    assert arithmetic_dataset(num_train=300, num_eval=16, seed=4)[0] != train_a


def test_arithmetic_worked_answers_are_correct():
    # Independent check: redo every worked line `a op b = c` and the final `#### n`.
    train, _ = arithmetic_dataset(num_train=200, num_eval=0, seed=0)
    for ex in train:
        lines = ex.messages[1].content.splitlines()
        value = None
        for line in lines[1:-1]:
            lhs, rhs = line.rstrip(".").split(" = ")
            a, op, b = lhs.split(" ")
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op]
            assert value == int(rhs) and value >= 0
        assert lines[-1] == f"#### {value}" and ex.answer == str(value)
