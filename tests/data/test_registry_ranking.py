"""`"ranking": true` entries of a LlamaFactory-style registry: preference pairs for
`train.method: dpo` (alpaca and sharegpt layouts, columns and tags mapped), refused for SFT.

References: the pairs each record must give, written out by hand."""

from __future__ import annotations

import json

import pytest

from lazytrain.config import load_config
from lazytrain.data.formats import Message
from lazytrain.data.preference import PreferencePair, read_registry_pairs
from lazytrain.data.registry import read_registry_dataset
from lazytrain.train.dpo_run import read_configured_pairs


def _user(text):
    return Message(role="user", content=text)


def _reply(text):
    return (Message(role="assistant", content=text, train=True),)


def _write(tmp_path, entries: dict, files: dict):
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(rows))
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps(entries))
    return path


ALPACA_ROWS = [
    {"q": "Add 2 and 3.", "x": "Show the sum.", "good": "2 + 3 = 5\n#### 5", "bad": "#### 6",
     "sys": "Be exact.", "hist": [["Hi", "Hello!"]]},
    {"q": "Add 1 and 1.", "x": "", "good": "2", "bad": "3", "sys": "", "hist": []},
]
ALPACA_ENTRY = {"file_name": "prefs.json", "ranking": True,
                "columns": {"prompt": "q", "query": "x", "chosen": "good", "rejected": "bad",
                            "system": "sys", "history": "hist"}}


def test_an_alpaca_ranking_entry_reads_as_pairs(tmp_path):
    registry = _write(tmp_path, {"prefs": ALPACA_ENTRY}, {"prefs.json": ALPACA_ROWS})
    pairs = read_registry_pairs(str(registry), "prefs")
    assert pairs == [
        # system first, the history's turns untrained, prompt and query joined by a newline
        PreferencePair(prompt=(Message(role="system", content="Be exact."), _user("Hi"),
                               Message(role="assistant", content="Hello!"),
                               _user("Add 2 and 3.\nShow the sum.")),
                       chosen=_reply("2 + 3 = 5\n#### 5"), rejected=_reply("#### 6"),
                       answer="5"),
        PreferencePair(prompt=(_user("Add 1 and 1."),), chosen=_reply("2"),
                       rejected=_reply("3")),
    ]


SHAREGPT_ROWS = [
    {"conversations": [{"from": "system", "value": "Be exact."},
                       {"from": "human", "value": "What is 2 + 2?"},
                       {"from": "gpt", "value": "4"},
                       {"from": "human", "value": "And 2 + 3?"}],
     "chosen": {"from": "gpt", "value": "5"}, "rejected": {"from": "gpt", "value": "6"}},
]


def test_a_sharegpt_ranking_entry_reads_as_pairs(tmp_path):
    registry = _write(tmp_path, {"prefs": {"file_name": "prefs.json", "formatting": "sharegpt",
                                           "ranking": True,
                                           "columns": {"messages": "conversations",
                                                       "chosen": "chosen",
                                                       "rejected": "rejected"}}},
                      {"prefs.json": SHAREGPT_ROWS})
    (pair,) = read_registry_pairs(str(registry), "prefs")
    assert pair == PreferencePair(
        prompt=(Message(role="system", content="Be exact."), _user("What is 2 + 2?"),
                Message(role="assistant", content="4"), _user("And 2 + 3?")),
        chosen=_reply("5"), rejected=_reply("6"))


def test_openai_style_tags_and_renamed_columns_map_as_in_sft(tmp_path):
    rows = [{"msgs": [{"role": "user", "content": "Name a prime."}],
             "better": {"role": "assistant", "content": "7"},
             "worse": {"role": "assistant", "content": "9"}}]
    entry = {"file_name": "p.json", "formatting": "sharegpt", "ranking": True,
             "columns": {"messages": "msgs", "chosen": "better", "rejected": "worse"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                      "assistant_tag": "assistant"}}
    registry = _write(tmp_path, {"p": entry}, {"p.json": rows})
    assert read_registry_pairs(str(registry), "p") == [
        PreferencePair(prompt=(_user("Name a prime."),), chosen=_reply("7"), rejected=_reply("9"))]


def test_num_samples_keeps_the_first_pairs(tmp_path):
    registry = _write(tmp_path, {"prefs": {**ALPACA_ENTRY, "num_samples": 1}},
                      {"prefs.json": ALPACA_ROWS})
    assert [p.rejected for p in read_registry_pairs(str(registry), "prefs")] == [
        _reply("#### 6")]


def test_sft_refuses_a_ranking_entry_naming_train_method(tmp_path):
    registry = _write(tmp_path, {"prefs": ALPACA_ENTRY}, {"prefs.json": ALPACA_ROWS})
    with pytest.raises(ValueError, match=r"registry entry 'prefs' of .* is preference data "
                                         r"\(\"ranking\": true\), which trains with "
                                         r"train\.method: dpo; set train\.method: dpo"):
        read_registry_dataset(registry, "prefs")


def test_dpo_reads_a_ranking_entry_through_the_config_and_refuses_an_sft_entry(tmp_path):
    registry = _write(tmp_path, {"prefs": ALPACA_ENTRY,
                                 "sft": {"file_name": "sft.json"}},
                      {"prefs.json": ALPACA_ROWS,
                       "sft.json": [{"instruction": "a", "output": "b"}]})
    cfg = load_config(None, ["train.method=dpo", "data.path=prefs", "data.num_eval=1",
                             f"data.registry_path={registry}"])
    train, held = read_configured_pairs(cfg.data, seed=0)
    assert [p.chosen for p in train] == [_reply("2 + 3 = 5\n#### 5")]
    assert [p.chosen for p in held] == [_reply("2")]
    sft = load_config(None, ["train.method=dpo", "data.path=sft",
                             f"data.registry_path={registry}"])
    with pytest.raises(ValueError, match=r"registry entry 'sft' of .* is not preference data "
                                         r"\(no \"ranking\": true\)"):
        read_configured_pairs(sft.data, seed=0)


@pytest.mark.parametrize("entry, rows, message", [
    ({"file_name": "d.json", "formatting": "sharegpt", "ranking": True},
     [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
       "chosen": {"from": "gpt", "value": "x"}, "rejected": {"from": "gpt", "value": "y"}}],
     r"'d': .*d.json record 0: the conversation must end on a user turn"),
    ({"file_name": "d.json", "formatting": "sharegpt", "ranking": True},
     [{"conversations": [{"from": "human", "value": "q"}],
       "chosen": {"from": "human", "value": "x"}, "rejected": {"from": "gpt", "value": "y"}}],
     r"record 0: the 'chosen' message has from='human'; expected 'gpt'"),
    ({"file_name": "d.json", "ranking": True, "columns": {"rejected": "worse"}},
     [{"instruction": "q", "chosen": "x", "rejected": "y"}],
     r"record 0: column 'worse' \(role 'rejected'\) is missing"),
    ({"file_name": "d.json", "ranking": True}, [{"instruction": "q", "chosen": "x",
                                                 "rejected": ""}],
     r"registry entry 'd' record 0: `rejected` is empty"),
    ({"file_name": "d.json", "columns": {"chosen": "c"}}, [{}],
     r"column 'chosen' belongs to preference data; add \"ranking\": true"),
], ids=["ends_on_assistant", "chosen_not_assistant", "missing_column", "empty_response",
        "chosen_without_ranking"])
def test_bad_ranking_entries_and_records_are_named(tmp_path, entry, rows, message):
    registry = _write(tmp_path, {"d": entry}, {"d.json": rows})
    with pytest.raises(ValueError, match=message):
        read_registry_pairs(str(registry), "d")
