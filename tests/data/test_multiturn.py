"""Multi-turn loss masking: every assistant turn is trained, system and user turns never are.

Reference: the runs of consecutive trained tokens, decoded one by one, must be exactly the
assistant contents with the template's end-of-turn text, in order; no run may contain a system
or user string. Checked for the sharegpt and OpenAI `messages` file formats, a registry entry,
the ChatML test template, the default chatml (assistant mask), and (when cached) SmolLM2's real chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lazytrain.data import encode, load_examples
from lazytrain.data.registry import read_registry_dataset
from lazytrain.data.tokenize import IGNORE_INDEX

TURNS = [("system", "Answer in one line."), ("user", "What is 2 + 3?"), ("assistant", "5"),
         ("user", "And times 4?"), ("assistant", "20"), ("user", "Minus 7?"),
         ("assistant", "13 apples")]
ASSISTANT = [c for r, c in TURNS if r == "assistant"]
PROMPTS = [c for r, c in TURNS if r != "assistant"]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def _trained_runs(tok, enc) -> list[str]:
    """Decoded maximal runs of consecutive trained tokens."""
    runs, current = [], []
    for token, label in zip(enc.input_ids, enc.labels):
        if label != IGNORE_INDEX:
            assert label == token  # HF convention: the model shifts inside the loss
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def _write_formats(tmp_path: Path) -> dict[str, Path]:
    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"messages": [{"role": r, "content": c} for r, c in TURNS]}))
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [
        {"from": SHAREGPT_ROLES[r], "value": c} for r, c in TURNS]}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"chat": {"file_name": "sharegpt.json", "formatting": "sharegpt"}}))
    return {"messages": messages, "sharegpt": sharegpt}


@pytest.fixture(params=["messages", "sharegpt", "registry"])
def conversation(request, tmp_path):
    """The TURNS conversation read through one of the three multi-turn paths."""
    paths = _write_formats(tmp_path)
    if request.param == "registry":
        (ex,), _ = read_registry_dataset(tmp_path / "dataset_info.json", "chat")
    else:
        (ex,) = load_examples(paths[request.param], request.param)
    return ex


def test_every_assistant_turn_is_trained_with_chat_template(conversation, chat_tokenizer):
    enc = encode(chat_tokenizer, conversation, seq_len=512, overlong="truncate")
    assert _trained_runs(chat_tokenizer, enc) == [f"{a}<|im_end|>\n" for a in ASSISTANT]


def test_every_assistant_turn_is_trained_with_the_default_chatml(conversation, plain_tokenizer):
    # No template in the tokenizer: chatml with {% generation %}, so the assistant mask of
    # apply_chat_template decides; each turn's content and its <|im_end|> are trained.
    enc = encode(plain_tokenizer, conversation, seq_len=512, overlong="truncate")
    runs = _trained_runs(plain_tokenizer, enc)
    assert runs == [f"{a}<|im_end|>" for a in ASSISTANT]
    assert not any(p in r for r in runs for p in PROMPTS)


def test_truncation_keeps_the_turns_before_the_cut_trained(conversation, chat_tokenizer):
    full = encode(chat_tokenizer, conversation, seq_len=512, overlong="truncate")
    second_end = [i for i, lab in enumerate(full.labels) if lab != IGNORE_INDEX]
    cut = encode(chat_tokenizer, conversation, seq_len=second_end[-1] - 1, overlong="truncate")
    runs = _trained_runs(chat_tokenizer, cut)
    assert cut.truncated and runs[:2] == [f"{a}<|im_end|>\n" for a in ASSISTANT[:2]]


SMOLLM2_DIR = Path(os.environ.get("LAZYTRAIN_CACHE", Path.home() / ".cache/lazytrain")) \
    / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2_DIR / "tokenizer.json").exists(),
                    reason="SmolLM2 tokenizer not converted yet (lazytrain.models.smollm2)")
def test_every_assistant_turn_is_trained_with_smollm2_chat_template(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    (ex,) = load_examples(_write_formats(tmp_path)["messages"], "messages")
    runs = _trained_runs(tok, encode(tok, ex, seq_len=512, overlong="truncate"))
    assert [r.strip() for r in runs] == [f"{a}<|im_end|>" for a in ASSISTANT]
    assert not any(p in r for r in runs for p in PROMPTS)
