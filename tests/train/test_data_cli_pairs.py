"""`lazytrain data CONFIG` with `train.method: dpo`: preference pairs as the DPO trainer reads
them (the rendered prompt, the chosen and rejected responses with their trained tokens marked,
row and trained token counts against data.seq_len, the dropped pairs).

References: the chatml text written out by hand, its token counts taken with the tokenizer
itself on those literal strings (the tiny byte-level BPE splits before every newline, space
and special token, so a row's count is the sum of its parts')."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import AutoTokenizer

from lazytrain.cli.main import main

PROMPTS = ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nWhat is 10 + 7?<|im_end|>\n<|im_start|>assistant\n")
"""The chatml prompt of each pair, as the model reads it."""
RESPONSES = (("2 + 3 = 5.\n#### 5", "2 + 3 = 6.\n#### 6"), ("10 + 7 = 17.\n#### 17", "#### 16"))
"""(chosen, rejected) of each pair."""
END = "<|im_end|>"
"""Closes the assistant turn: trained; the newline after it is not."""


@pytest.fixture
def dpo_config(arithmetic_model_dir, tmp_path):
    """A DPO run config over two pairs: pair 0 in plain text fields, pair 1 as role/content
    message lists."""
    (c0, r0), (c1, r1) = RESPONSES
    rows = [{"prompt": "What is 2 + 3?", "chosen": c0, "rejected": r0},
            {"prompt": [{"role": "user", "content": "What is 10 + 7?"}],
             "chosen": [{"role": "assistant", "content": c1}],
             "rejected": [{"role": "assistant", "content": r1}]}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"config_path": str(arithmetic_model_dir)},
                                      "train": {"method": "dpo"},
                                      "data": {"path": str(data), "seq_len": 160,
                                               "num_eval": 0}}))
    return config


@pytest.fixture
def tokens(arithmetic_model_dir):
    """Text -> its token ids with the model's tokenizer (no template, no special tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(arithmetic_model_dir)
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def n_tokens(tokens):
    return lambda text: len(tokens(text))


def test_pairs_show_the_prompt_the_trained_responses_and_their_token_counts(dpo_config,
                                                                            n_tokens, capsys):
    assert main(["data", str(dpo_config), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    trained = 0
    for k, (prompt, responses) in enumerate(zip(PROMPTS, RESPONSES)):
        assert f"--- pair {k} (preference)\nprompt: {prompt}\nchosen (" in out
        for name, text in zip(("chosen", "rejected"), responses):
            row, target = n_tokens(prompt + text + END + "\n"), n_tokens(text + END)
            assert (f"{name} (row of {row} tokens, {target} trained; data.seq_len=160): "
                    f"[[{text}{END}]]\n") in out
            trained += target
    assert "[[What is" not in out and "dropped" not in out.replace("0 dropped", "")
    assert (f"2 training pairs (preference, {dpo_config.parent / 'pairs.jsonl'}), 0 held out; "
            f"of 2 counted at data.seq_len=160: 2 fit whole, 0 truncated, 0 dropped "
            f"(data.overlong=truncate); {trained} trained tokens") in out


def test_a_pair_over_seq_len_is_dropped_with_skip_and_cut_with_truncate(dpo_config, tokens,
                                                                        n_tokens,
                                                                        arithmetic_model_dir,
                                                                        capsys):
    rows = [[n_tokens(p + t + END + "\n") for t in rs] for p, rs in zip(PROMPTS, RESPONSES)]
    # pair 1's chosen row is the longest of the four, pair 0's rows the next
    seq_len = max(rows[0] + [rows[1][1]])
    assert rows[1][0] > seq_len
    assert main(["data", str(dpo_config), "--samples", "2", "--set", f"data.seq_len={seq_len}",
                 "--set", "data.overlong=skip"]) == 0
    out = capsys.readouterr().out
    assert (f"(dropped: chosen ({rows[1][0]} tokens) over data.seq_len={seq_len}, "
            f"data.overlong=skip)") in out
    kept = sum(n_tokens(t + END) for t in RESPONSES[0])  # pair 0 only
    assert (f"of 2 counted at data.seq_len={seq_len}: 1 fit whole, 0 truncated, 1 dropped "
            f"(pairs 1) (data.overlong=skip); {kept} trained tokens") in out

    # truncate: pair 1's chosen row is cut to seq_len, keeping the response's first tokens
    assert main(["data", str(dpo_config), "--samples", "2", "--set",
                 f"data.seq_len={seq_len}"]) == 0
    out = capsys.readouterr().out
    chosen = RESPONSES[1][0]
    left = seq_len - n_tokens(PROMPTS[1])
    cut_text = AutoTokenizer.from_pretrained(arithmetic_model_dir).decode(
        tokens(chosen + END)[:left])
    assert 0 < left < n_tokens(chosen) and chosen.startswith(cut_text) and cut_text != chosen
    assert (f"chosen (row of {rows[1][0]} tokens cut to {seq_len}, {left} of "
            f"{n_tokens(chosen + END)} trained kept; data.seq_len={seq_len}): "
            f"[[{cut_text}]]\n") in out
    assert (f"of 2 counted at data.seq_len={seq_len}: 1 fit whole, 1 truncated, 0 dropped "
            f"(data.overlong=truncate); {kept + left + n_tokens(RESPONSES[1][1] + END)} "
            f"trained tokens") in out


def test_a_cut_that_leaves_a_response_no_trained_token_drops_the_pair(dpo_config, n_tokens,
                                                                     capsys):
    seq_len = n_tokens(PROMPTS[0])  # pair 0's rows end where its responses begin
    assert n_tokens(PROMPTS[1]) >= seq_len
    assert main(["data", str(dpo_config), "--samples", "1", "--set",
                 f"data.seq_len={seq_len}"]) == 0
    out = capsys.readouterr().out
    assert (f"(dropped: the cut at data.seq_len={seq_len} leaves chosen and rejected no "
            f"trained token)") in out
    assert (f"of 2 counted at data.seq_len={seq_len}: 0 fit whole, 0 truncated, 2 dropped "
            f"(pairs 0, 1) (data.overlong=truncate); 0 trained tokens") in out
