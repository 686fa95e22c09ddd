"""`lazytrain data CONFIG`: rendered samples with the trained tokens marked, and the counts."""

from __future__ import annotations

import json

import yaml

from lazytrain.cli.main import main


def test_lazytrain_data_marks_the_completions_and_counts_what_seq_len_keeps(
        arithmetic_model_dir, tmp_path, capsys):
    rows = [{"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}.\n#### {a + b}"}
            for a, b in ((2, 3), (10, 7), (4, 4))]
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"config_path": str(arithmetic_model_dir)},
                                      "data": {"path": str(data), "seq_len": 160,
                                               "num_eval": 0}}))
    assert main(["data", str(config), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    # chatml: the prompt is plain text, each completion (and its end-of-turn) is marked
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n[[2 + 3 = 5." in out
    assert "#### 5<|im_end|>" in out and "[[What is" not in out
    assert "--- sample 1 (prompt_completion)" in out and "--- sample 2" not in out
    assert "3 training samples (prompt_completion, " in out
    assert ("0 held out; of 3 counted at data.seq_len=160: 3 fit whole, 0 truncated, 0 skipped "
            "(data.overlong=truncate)") in out
    # seq_len 12 cannot hold any prompt: every sample is skipped
    assert main(["data", str(config), "--set", "data.seq_len=12"]) == 0
    out = capsys.readouterr().out
    assert "of 3 counted at data.seq_len=12: 0 fit whole, 0 truncated, 3 skipped" in out
