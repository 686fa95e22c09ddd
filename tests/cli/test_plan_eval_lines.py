"""`lazytrain plan` shows the forward-only and decode plans under the plan table, one line each
(weights resident or streamed, HBM with the KV cache, predicted tokens/s), as the trainer's
start-up summary does; numbers by hand on a tiny Llama."""

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
}


@pytest.fixture(autouse=True)
def only_plan(monkeypatch):
    """Register only `plan`, so another verb's import cannot fail this test."""
    monkeypatch.setattr(cli_main, "COMMANDS", {k: v for k, v in cli_main.COMMANDS.items()
                                               if k == "plan"})


def test_plan_prints_one_line_per_evaluation_plan(tmp_path, capsys):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "tiny.yaml").write_text(
        "model:\n  config_path: tiny.json\n  dtype: bf16\nhardware:\n  preset: h800-paper\n"
        "data:\n  seq_len: 64\ntrain:\n  micro_batch: 2\n  grad_accum: 1\n"
        "  compute_dtype: bf16\n  master_dtype: bf16\n"
        "planner:\n  policy: megatrain\n  megatrain_k: 2\n")
    assert main(["plan", "--config", str(tmp_path / "tiny.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    forward = [ln for ln in lines if ln.startswith("forward plan: ")]
    decode = [ln for ln in lines if ln.startswith("decode plan: ")]
    assert len(forward) == len(decode) == 1
    assert "weights resident in HBM" in decode[0] and "tokens generated/s" in decode[0]
    # KV cache of 8 rows x 64 tokens: 4 layers x 2 (k, v) x 2 kv heads x 16 x 2 B x 512 tokens
    # = 262,144 B
    assert "KV cache 0.000262 GB" in decode[0]
    assert "8 x 64 tokens" in forward[0] and "tokens scored/s" in forward[0]
