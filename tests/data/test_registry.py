"""LlamaFactory-style `dataset_info.json` registries: MegaTrain's real one plus hand-made ones.

References are the raw records themselves: each converted example is compared with the record
fields it must come from, read here with plain `json`.
"""

from __future__ import annotations

import json
import pytest

from lazytrain.config import DataConfig
from lazytrain.data import build_data, encode
from lazytrain.data.registry import read_registry_dataset, resolve_entry


def _registry(tmp_path, entries: dict):
    path = tmp_path / "dataset_info.json"
    path.write_text(json.dumps(entries))
    return path


def test_megatrain_registry_reads_alpaca_en_demo_from_shared_data(shared_dir):
    registry = shared_dir / "megatrain_configs" / "dataset_info.json"
    data_dir = shared_dir / "data" / "alpaca_en_demo"
    examples, fmt = read_registry_dataset(registry, "alpaca_en_demo", dataset_dir=data_dir)
    records = json.loads((data_dir / "alpaca_en_demo.json").read_text())
    assert fmt == "registry:alpaca" and len(examples) == len(records) == 10
    for ex, rec in zip(examples, records):
        prompt = "\n".join(x for x in (rec["instruction"], rec["input"]) if x)  # LlamaFactory
        assert [(m.role, m.content, m.train) for m in ex.messages] == [
            ("user", prompt, False), ("assistant", rec["output"], True)]


def test_an_entry_without_file_name_or_hf_hub_url_says_what_to_add(tmp_path):
    registry = _registry(tmp_path, {"ms": {"ms_hub_url": "AI-ModelScope/x"}})
    with pytest.raises(ValueError, match=r"entry 'ms' has neither file_name nor hf_hub_url "
                                         r".*ms_hub_url.*add \"file_name\""):
        read_registry_dataset(registry, "ms")


def test_a_hub_entry_resolves_to_its_id_subset_and_split(shared_dir):
    registry = shared_dir / "megatrain_configs" / "dataset_info.json"
    entry = resolve_entry(registry, "ultrachat_200k")
    assert (entry.path, entry.hub_id, entry.split) == (None, "HuggingFaceH4/ultrachat_200k",
                                                       "train_sft")
    assert entry.formatting == "sharegpt" and entry.tags["role_tag"] == "role"


def test_metamath_and_gsm8k_columns_map_prompt_and_response(shared_dir, tmp_path):
    registry = _registry(tmp_path, {
        # MegaTrain's metamath columns, pointed at the local schema sample
        "metamath": {"file_name": "metamathqa/metamathqa_schema_sample.json",
                     "columns": {"prompt": "query", "response": "response"}},
        "gsm8k": {"file_name": "gsm8k/test.jsonl", "formatting": "alpaca",
                  "columns": {"prompt": "question", "response": "answer"}, "num_samples": 5}})
    meta, _ = read_registry_dataset(registry, "metamath", dataset_dir=shared_dir / "data")
    rows = json.loads((shared_dir / "data/metamathqa/metamathqa_schema_sample.json").read_text())
    assert [ex.messages[0].content for ex in meta] == [r["query"] for r in rows]
    assert [ex.messages[1].content for ex in meta] == [r["response"] for r in rows]
    assert all(ex.answer for ex in meta)  # "The answer is:" marker
    gsm, _ = read_registry_dataset(registry, "gsm8k", dataset_dir=shared_dir / "data")
    first = json.loads((shared_dir / "data/gsm8k/test.jsonl").read_text().splitlines()[0])
    assert len(gsm) == 5 and gsm[0].messages[0].content == first["question"]
    assert gsm[0].answer == first["answer"].rsplit("####", 1)[1].strip()


def test_sharegpt_entry_with_tags_trains_history_and_takes_the_system_turn(tmp_path):
    rows = [{"conversations": [{"from": "system", "value": "be brief"},
                               {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                               {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}]
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    registry = _registry(tmp_path, {"chat": {"file_name": "chat.json",
                                             "formatting": "sharegpt"}})
    (ex,), fmt = read_registry_dataset(registry, "chat")
    assert fmt == "registry:sharegpt"
    assert [(m.role, m.content, m.train) for m in ex.messages] == [
        ("system", "be brief", False), ("user", "q1", False), ("assistant", "a1", True),
        ("user", "q2", False), ("assistant", "a2", True)]


def test_openai_messages_entry_uses_role_content_tags(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    registry = _registry(tmp_path, {"m": {  # MegaTrain's ultrachat_200k columns and tags
        "file_name": "m.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                 "assistant_tag": "assistant"}}})
    (ex,), _ = read_registry_dataset(registry, "m")
    assert [(m.role, m.train) for m in ex.messages] == [("user", False), ("assistant", True)]


def test_alpaca_history_becomes_trained_earlier_turns(tmp_path):
    rows = [{"q": "now?", "a": "yes", "h": [["before?", "no"]], "sys": "s"}]
    (tmp_path / "h.json").write_text(json.dumps(rows))
    registry = _registry(tmp_path, {"h": {"file_name": "h.json", "columns": {
        "prompt": "q", "response": "a", "history": "h", "system": "sys"}}})
    (ex,), _ = read_registry_dataset(registry, "h")
    assert [(m.role, m.content, m.train) for m in ex.messages] == [
        ("system", "s", False), ("user", "before?", False), ("assistant", "no", True),
        ("user", "now?", False), ("assistant", "yes", True)]


@pytest.mark.parametrize("entry, rows, message", [
    ({"file_name": "d.json", "columns": {"prompt": "question", "response": "answer"}},
     [{"question": "x"}], r"d.json record 0: column 'answer' \(role 'response'\) is missing"),
    ({"file_name": "d.json", "formatting": "sharegpt"},
     [{"conversations": [{"from": "gpt", "value": "x"}]}],
     r"record 0: turn 0 has from='gpt'; expected 'human'"),
    ({"file_name": "d.json", "columns": {"images": "image"}}, [{}],
     r"column 'images' is not supported"),
    ({"file_name": "d.json", "formatting": "pairwise"}, [{}], r"formatting 'pairwise'"),
    ({"file_name": "d.json"}, [], r"d.json has no records"),
], ids=["missing_column", "bad_role_order", "multimodal", "formatting", "empty_file"])
def test_bad_entries_and_records_are_named(tmp_path, entry, rows, message):
    (tmp_path / "d.json").write_text(json.dumps(rows))
    registry = _registry(tmp_path, {"d": entry})
    with pytest.raises(ValueError, match=message):
        read_registry_dataset(registry, "d")


def test_unknown_name_suggests_the_closest_entry(tmp_path):
    registry = _registry(tmp_path, {"alpaca_en_demo": {"file_name": "a.json"}})
    with pytest.raises(ValueError, match="did you mean alpaca_en_demo"):
        resolve_entry(registry, "alpaca_en_dem")


def test_build_data_reads_a_registry_entry_through_the_config(shared_dir, plain_tokenizer):
    cfg = DataConfig(path="alpaca_en_demo", seq_len=200, packing=True, num_eval=2,
                     overlong="skip",
                     registry_path=str(shared_dir / "megatrain_configs/dataset_info.json"),
                     dataset_dir=str(shared_dir / "data/alpaca_en_demo"))
    data = build_data(cfg, plain_tokenizer, micro_batch=2, seed=0)
    assert data.format == "registry:alpaca" and len(data.eval_examples) == 2
    lengths = [len(encode(plain_tokenizer, ex, seq_len=10**6, overlong="skip").input_ids)
               for ex in data.train.examples]
    packed = 0
    while data.train.epoch == 0:
        batch = data.train.next_micro_batch()
        assert batch["input_ids"].shape == (2, 200) and "attention_mask" not in batch
        packed += int(((batch["position_ids"] == 0) & (batch["token_mask"] == 1)).sum())
    # An epoch skips exactly the samples over seq_len, counted in the summary counts.
    overlong = sum(n > 200 for n in lengths)
    assert overlong >= 1 and data.train.counts.skipped >= overlong
    assert data.train.counts.drawn - data.train.counts.skipped == packed
