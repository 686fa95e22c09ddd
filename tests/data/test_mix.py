"""`data.mix`: datasets mixed by weight, the held-out examples from the first entry."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lazytrain.config import load_config
from lazytrain.data import build_data
from lazytrain.data.sources import mix_examples


def test_mix_examples_gives_each_part_its_weighted_share_of_the_total():
    # total 4 + 2 = 6; weights 1 : 3 -> round(6 / 4) = round(1.5) = 2 and round(4.5) = 4
    # (Python rounds halves to even): 2 of the 4 a's once each, both b's twice each
    mixed = mix_examples([["a0", "a1", "a2", "a3"], ["b0", "b1"]], [1.0, 3.0], seed=0,
                         names=["a", "b"])
    counts = Counter(mixed)
    assert len(mixed) == 6
    assert sorted(n for k, n in counts.items() if k.startswith("a")) == [1, 1]
    assert {k: n for k, n in counts.items() if k.startswith("b")} == {"b0": 2, "b1": 2}


def test_an_empty_mix_entry_is_named():
    with pytest.raises(ValueError, match="data.mix: empty.jsonl has no training samples"):
        mix_examples([["a"], []], [1.0, 1.0], seed=0, names=["a.jsonl", "empty.jsonl"])


def test_an_entry_whose_weight_rounds_to_no_sample_is_named_not_dropped():
    # total 4 + 2 = 6; weight 0.01 of 1.01 -> round(0.059) = 0 samples of b: b would be
    # missing from the mix without a word
    with pytest.raises(ValueError, match=r"data.mix: b.jsonl's weight 0.01 gives it 0 of the 6"):
        mix_examples([["a0", "a1", "a2", "a3"], ["b0", "b1"]], [1.0, 0.01], seed=0,
                     names=["a.jsonl", "b.jsonl"])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_build_data_mixes_two_formats_and_holds_out_from_the_first(tmp_path, plain_tokenizer):
    qa = _jsonl(tmp_path / "qa.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"}
                                        for i in range(10)])
    text = _jsonl(tmp_path / "text.jsonl", [{"text": f"plain text {i}"} for i in range(5)])
    cfg = load_config(None, [f"data.mix=[{{path: {qa}, weight: 3}}, {{path: {text}}}]",
                             "data.num_eval=2", "data.seq_len=64"])
    data = build_data(cfg.data, plain_tokenizer, micro_batch=2, seed=0)
    # held out: qa's last 2 (q8, q9); the mix: 8 + 5 = 13 samples, qa round(3/4 x 13) =
    # round(9.75) = 10 (its 8 once, 2 of them twice), text round(3.25) = 3 of its 5
    assert [ex.messages[0].content for ex in data.eval_examples] == ["q8", "q9"]
    kinds = Counter("qa" if ex.messages[0].role == "user" else "text"
                    for ex in data.train.examples)
    assert kinds == {"qa": 10, "text": 3}
    prompts = Counter(ex.messages[0].content for ex in data.train.examples
                      if ex.messages[0].role == "user")
    assert set(prompts) == {f"q{i}" for i in range(8)} and sorted(prompts.values())[-2:] == [2, 2]
    assert data.format == "prompt_completion+text"
