"""A record whose text is a list or a mapping (OpenAI-style content parts, a nested column) is
refused naming the record, never trained on as its Python repr ("['a', 'b']",
"[{'type': 'text', ...}]")."""

from __future__ import annotations

import json

import pytest

from lazytrain.data.formats import load_examples


def _jsonl(tmp_path, *records):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("fmt, record", [
    ("text", {"text": ["a", "b"]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                               {"role": "assistant", "content": "yo"}]}),
    ("prompt_completion", {"prompt": [{"role": "user", "content": "hi"}],
                           "completion": [{"role": "assistant",
                                           "content": [{"type": "text", "text": "yo"}]}]}),
])
def test_a_list_where_text_belongs_is_refused_naming_the_record(tmp_path, fmt, record):
    path = _jsonl(tmp_path, record)
    with pytest.raises(ValueError, match=r"record 0: .*not a string") as info:
        load_examples(path, fmt)
    assert "\n" not in str(info.value)


def test_plain_strings_still_read(tmp_path):
    path = _jsonl(tmp_path, {"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "yo"}]})
    [example] = load_examples(path, "messages")
    assert [m.content for m in example.messages] == ["hi", "yo"]
