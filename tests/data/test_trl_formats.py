"""TRL's dataset kinds: prompt/completion (strings, or conversational message lists) and plain
`text` (no chat template, every token trained, eos appended)."""

from __future__ import annotations

import json

from lazytrain.data.formats import read_dataset
from lazytrain.data.tokenize import IGNORE_INDEX, encode


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_string_prompt_completion_is_a_user_turn_and_a_trained_assistant_turn(tmp_path):
    rows = [{"prompt": "What is 2+3?", "completion": " 2+3 = 5\n#### 5"}]
    (ex,), fmt = read_dataset(_write_jsonl(tmp_path / "pc.jsonl", rows))
    assert fmt == "prompt_completion"
    assert [(m.role, m.content, m.train) for m in ex.messages] == [
        ("user", "What is 2+3?", False), ("assistant", "2+3 = 5\n#### 5", True)]
    assert ex.answer == "5"


def test_conversational_prompt_completion_trains_the_completion_turns(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"}],
             "completion": [{"role": "assistant", "content": "Hello"}]}]
    (ex,), fmt = read_dataset(_write_jsonl(tmp_path / "pc.jsonl", rows))
    assert fmt == "prompt_completion"
    assert [(m.role, m.train) for m in ex.messages] == [("system", False), ("user", False),
                                                        ("assistant", True)]


def test_text_is_trained_whole_without_a_template(tmp_path, plain_tokenizer):
    text = "Maya has 12 shells. Then Maya buys 7 more shells."
    (ex,), fmt = read_dataset(_write_jsonl(tmp_path / "t.jsonl", [{"text": text}]))
    assert fmt == "text"
    enc = encode(plain_tokenizer, ex, seq_len=512, overlong="truncate")
    want = plain_tokenizer(text, add_special_tokens=False)["input_ids"] + \
        [plain_tokenizer.eos_token_id]
    assert list(enc.input_ids) == want  # no <|im_start|> markup around it
    assert list(enc.labels) == want and IGNORE_INDEX not in enc.labels
