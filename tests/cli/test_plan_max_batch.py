"""`lazytrain plan --max-batch`: the reported largest micro-batch plans within budget and one
more does not (checked by running `lazytrain plan` at both sizes), table and --json."""

from __future__ import annotations

import json

import pytest

import lazytrain.cli.main as cli_main
from lazytrain.cli.main import main

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def only_plan_verb(monkeypatch):
    monkeypatch.setattr(cli_main, "COMMANDS", {k: v for k, v in cli_main.COMMANDS.items()
                                               if k == "plan"})


@pytest.fixture
def tiny_config(tmp_path):
    """A 4-block hidden-64 Llama on h800-paper with HBM cut to 0.2 GB (a few hundred
    sequences of 64 tokens fit), heuristic policy."""
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "tiny.yaml").write_text(
        "model:\n  config_path: tiny.json\n  dtype: bf16\n"
        "hardware:\n  preset: h800-paper\n  hbm_gb: 0.2\n"
        "data:\n  seq_len: 64\n"
        "train:\n  micro_batch: 2\n  grad_accum: 4\n"
        "planner:\n  time_limit_s: 5\n  policy: heuristic\n")
    return tmp_path / "tiny.yaml"


def test_max_batch_json_fits_and_one_more_micro_batch_does_not(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--max-batch", "--json"]) == 0
    search = json.loads(capsys.readouterr().out)["max_batch"]
    best = search["max_micro_batch"]
    assert best >= 2 and search["grad_accums"] == [1, 4]
    assert search["max_global_batch"] == 4 * best
    assert {r["micro_batch"] for r in search["rows"]} >= {1, best, best + 1}
    assert main(["plan", "--config", str(tiny_config), "--micro-batch", str(best)]) == 0
    capsys.readouterr()
    assert main(["plan", "--config", str(tiny_config), "--micro-batch", str(best + 1)]) == 1


def test_max_batch_table_lists_tokens_per_s_per_candidate(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--max-batch",
                 "--grad-accums", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "largest micro-batch that fits" in out and "tokens/s" in out
    assert out.count(" yes ") >= 4


def test_max_batch_rejects_a_malformed_accumulation_list(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--max-batch",
                 "--grad-accums", "1,x"]) == 2
    assert "--grad-accums" in capsys.readouterr().err
