"""Preference records: every layout parses to the same pair, a bad record names its field, the
wrong worked answers are wrong, the two-row batches, and the reference cache's hit and miss."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lazytrain.data.formats import Message, extract_final_answer
from lazytrain.data.preference import (PreferenceStream, arithmetic_pairs, pair_batch,
                                       pairs_fingerprint, parse_pair, read_pairs)
from lazytrain.data.tokenize import Encoded
from lazytrain.train.reference import (cache_path, reference_key, reference_logps,
                                       row_logps)

USER = Message(role="user", content="What is 2 + 2?")
GOOD = Message(role="assistant", content="4", train=True)
BAD = Message(role="assistant", content="5", train=True)

LAYOUTS = {
    "trl_text": {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
    "trl_messages": {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
                     "chosen": [{"role": "assistant", "content": "4"}],
                     "rejected": [{"role": "assistant", "content": "5"}]},
    "trl_implicit_prompt": {
        "chosen": [{"role": "user", "content": "What is 2 + 2?"},
                   {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "What is 2 + 2?"},
                     {"role": "assistant", "content": "5"}]},
    "llamafactory_sharegpt": {"conversations": [{"from": "human", "value": "What is 2 + 2?"}],
                              "chosen": {"from": "gpt", "value": "4"},
                              "rejected": {"from": "gpt", "value": "5"}},
    "llamafactory_alpaca": {"instruction": "What is 2 + 2?", "input": "", "chosen": "4",
                            "rejected": "5"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_parses_to_the_same_pair(layout):
    pair = parse_pair(LAYOUTS[layout])
    assert pair.prompt == (USER,)
    assert pair.chosen == (GOOD,) and pair.rejected == (BAD,)


def test_system_prompt_comes_first_and_is_not_trained():
    pair = parse_pair({**LAYOUTS["llamafactory_alpaca"], "system": "Be brief."})
    assert pair.prompt == (Message(role="system", content="Be brief."), USER)


@pytest.mark.parametrize("record, field", [
    ({"prompt": "q", "rejected": "5"}, "`chosen`"),
    ({"prompt": "q", "chosen": 4, "rejected": "5"}, "`chosen`"),
    ({"prompt": "q", "chosen": "4", "rejected": [{"role": "assistant"}]}, "`rejected`[0]"),
    ({"prompt": 3.5, "chosen": "4", "rejected": "5"}, "`prompt`"),
    ({"conversations": [{"from": "robot", "value": "hi"}], "chosen": "4", "rejected": "5"},
     "`conversations`[0]"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "5"},
     "`chosen` has no assistant turn"),
    ({"chosen": [{"role": "assistant", "content": "4"}],
      "rejected": [{"role": "assistant", "content": "5"}]}, "no `prompt`"),
])
def test_a_bad_record_names_the_record_and_the_field(record, field):
    with pytest.raises(ValueError) as err:
        parse_pair(record, where="data: pairs.jsonl record 7")
    assert "record 7" in str(err.value) and field in str(err.value)


def test_a_file_reports_the_index_of_its_bad_record(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(LAYOUTS["trl_text"]) + "\n"
                    + json.dumps({"prompt": "q", "chosen": "4", "rejected": ""}) + "\n")
    with pytest.raises(ValueError, match=r"record 1: `rejected` is empty"):
        read_pairs(str(path))


def test_arithmetic_pairs_reject_a_wrong_answer_and_hold_out_other_questions():
    train, held = arithmetic_pairs(num_train=40, num_eval=10, seed=0)
    assert not {p.prompt[0].content for p in train} & {p.prompt[0].content for p in held}
    for p in train + held:
        good, bad = p.chosen[0].content, p.rejected[0].content
        assert extract_final_answer(good) == p.answer != extract_final_answer(bad)
        # every line of the rejected answer still reads "a op n = r." but one r is wrong
        lines = [re.fullmatch(r"(\d+) ([+-]) (\d+) = (-?\d+)\.", x).groups()
                 for x in bad.split("\n")[1:-1]]
        wrong = [(a, op, n, r) for a, op, n, r in lines
                 if int(a) + (int(n) if op == "+" else -int(n)) != int(r)]
        assert len(wrong) == 1


def _enc(ids, labels):
    return Encoded(input_ids=tuple(ids), labels=tuple(labels))


def test_a_micro_batch_holds_chosen_rows_then_rejected_rows_with_their_reference():
    pairs = [(_enc([1, 2, 3], [-100, 2, 3]), _enc([1, 2, 4], [-100, 2, 4])),
             (_enc([5, 6], [-100, 6]), _enc([5, 7, 8], [-100, 7, 8]))]
    batch = pair_batch(pairs, seq_len=4, pad_id=0,
                       ref_logp=torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [5, 6, 0, 0], [1, 2, 4, 0],
                                           [5, 7, 8, 0]]
    assert batch["labels"][1].tolist() == [-100, 6, -100, -100]
    assert batch["ref_logp"].tolist() == [-1.0, -3.0, -2.0, -4.0]


def test_the_stream_resumes_where_it_stopped_and_refuses_other_pairs():
    pairs = [(_enc([k, k + 1], [-100, k + 1]), _enc([k, k + 2], [-100, k + 2]))
             for k in range(1, 8)]
    a = PreferenceStream(pairs=pairs, micro_batch=3, seq_len=4, pad_id=0, seed=1)
    first = [a.next_micro_batch()["input_ids"] for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_micro_batch()["input_ids"] for _ in range(3)]
    b = PreferenceStream(pairs=pairs, micro_batch=3, seq_len=4, pad_id=0, seed=1)
    b.load_state_dict(state)
    assert all(torch.equal(x, b.next_micro_batch()["input_ids"]) for x in rest)
    assert not torch.equal(first[0], first[1])
    other = PreferenceStream(pairs=pairs[:-1], micro_batch=3, seq_len=4, pad_id=0, seed=1)
    with pytest.raises(ValueError, match="preference pairs differ"):
        other.load_state_dict(state)


def _fake_scorer(calls):
    """token_logprobs of a made-up model: log p(x_t) = -x_t / 10 (hand-checkable)."""
    def token_logprobs(seqs):
        calls.append(len(seqs))
        return [torch.tensor([-t / 10 for t in s[1:]]) for s in seqs]
    return token_logprobs


def test_row_logps_sum_the_trained_tokens_only():
    rows = [_enc([1, 2, 3, 4], [-100, -100, 3, 4])]
    assert row_logps(_fake_scorer([]), rows).tolist() == pytest.approx([-0.7])


def test_the_reference_cache_hits_on_its_key_and_misses_on_another(tmp_path):
    pairs = [(_enc([1, 2, 3], [-100, 2, 3]), _enc([1, 2, 4], [-100, 2, 4]))]
    key = reference_key(data_fingerprint=pairs_fingerprint(pairs), model="m1", template="t")
    calls, lines = [], []
    first = reference_logps(pairs, token_logprobs=_fake_scorer(calls), run_dir=tmp_path,
                            key=key, log=lines.append)
    assert first.tolist() == [pytest.approx([-0.5, -0.6])] and calls == [2]
    assert cache_path(tmp_path, key).is_file()
    again = reference_logps(pairs, token_logprobs=_fake_scorer(calls), run_dir=tmp_path,
                            key=key, log=lines.append)
    assert calls == [2] and torch.equal(again, first) and "read" in lines[-1]  # a hit
    for other in (reference_key(data_fingerprint=pairs_fingerprint(pairs), model="m2",
                                template="t"),
                  reference_key(data_fingerprint=pairs_fingerprint(pairs), model="m1",
                                template="u"),
                  reference_key(data_fingerprint=pairs_fingerprint(pairs[:0]), model="m1",
                                template="t")):
        assert other != key
        reference_logps(pairs, token_logprobs=_fake_scorer(calls), run_dir=tmp_path,
                        key=other, log=lines.append)
    assert calls == [2, 2, 2, 2]  # three misses: each scored again


def test_a_damaged_cache_entry_is_refused_with_the_fix(tmp_path):
    pairs = [(_enc([1, 2], [-100, 2]), _enc([1, 3], [-100, 3]))]
    cache_path(tmp_path, "k").parent.mkdir(parents=True)
    torch.save(torch.zeros(5, 2), cache_path(tmp_path, "k"))
    with pytest.raises(ValueError, match="delete the file"):
        reference_logps(pairs, token_logprobs=_fake_scorer([]), run_dir=tmp_path, key="k")
