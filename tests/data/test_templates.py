"""Chat templates: chatml / llama3 / qwen / a Jinja file, the assistant-token masks that
`apply_chat_template` returns for them, the chatml default, and the template saved with the
tokenizer.

References are hand-built: the expected text of each template written out literally, cut into
prompt / target / tail pieces that are tokenized apart (every cut is at a special token or
before a newline-separated word, where byte-level BPE cannot merge across), and the expected
labels are -100 on the prompt and tail pieces and the token ids on the target pieces.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lazytrain.config import DataConfig
from lazytrain.data import build_data, encode, encode_prompt
from lazytrain.data.formats import Example, Message
from lazytrain.data.templates import QWEN_SYSTEM, choose_template, stop_token_ids
from lazytrain.data.tokenize import IGNORE_INDEX

CHAT = Example(messages=(Message(role="system", content="Be brief."),
                         Message(role="user", content="Ava has 3 apples. How many?"),
                         Message(role="assistant", content="3 apples.\n#### 3", train=True),
                         Message(role="user", content="And 2 more?"),
                         Message(role="assistant", content="#### 5", train=True)),
               answer="5")

# (piece, trained) in order: the full rendering of CHAT by each template.
EXPECTED = {
    "chatml": [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAva has 3 apples. "
                "How many?<|im_end|>\n<|im_start|>assistant\n", False),
               ("3 apples.\n#### 3<|im_end|>", True),
               ("\n<|im_start|>user\nAnd 2 more?<|im_end|>\n<|im_start|>assistant\n", False),
               ("#### 5<|im_end|>", True), ("\n", False)],
    "llama3": [("<|bos|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nAva has 3 apples. How many?"
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
               ("3 apples.\n#### 3<|eot_id|>", True),
               ("<|start_header_id|>user<|end_header_id|>\n\nAnd 2 more?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
               ("#### 5<|eot_id|>", True)],
}


def _reference(tok, pieces):
    ids, labels = [], []
    for text, trained in pieces:
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        labels += part if trained else [IGNORE_INDEX] * len(part)
    return ids, labels


@pytest.fixture
def fresh_tokenizer(plain_tokenizer):
    """The template-less test tokenizer (a fresh copy per test: build_data sets a template)."""
    return plain_tokenizer


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_named_template_masks_equal_the_hand_built_reference(name, fresh_tokenizer):
    template, note = choose_template(fresh_tokenizer, name)
    assert note is None
    fresh_tokenizer.chat_template = template
    enc = encode(fresh_tokenizer, CHAT, seq_len=512, overlong="truncate")
    ids, labels = _reference(fresh_tokenizer, EXPECTED[name])
    assert (list(enc.input_ids), list(enc.labels)) == (ids, labels)


def test_qwen_adds_its_system_prompt_only_when_the_chat_has_none(fresh_tokenizer):
    fresh_tokenizer.chat_template = choose_template(fresh_tokenizer, "qwen")[0]
    no_system = Example(messages=CHAT.messages[1:3], answer="3")
    enc = encode(fresh_tokenizer, no_system, seq_len=512, overlong="truncate")
    ids, labels = _reference(fresh_tokenizer, [
        (f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\nAva has 3 apples. "
         f"How many?<|im_end|>\n<|im_start|>assistant\n", False),
        ("3 apples.\n#### 3<|im_end|>", True), ("\n", False)])
    assert (list(enc.input_ids), list(enc.labels)) == (ids, labels)
    with_system = encode(fresh_tokenizer, CHAT, seq_len=512, overlong="truncate")
    assert QWEN_SYSTEM not in fresh_tokenizer.decode(with_system.input_ids)


def test_a_jinja_file_is_used_as_the_template_through_prefix_masking(fresh_tokenizer, tmp_path):
    # No {% generation %} marker: the trained tokens come from rendering prefixes.
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}<|eos|>{% endfor %}"
        "{% if add_generation_prompt %}[assistant]\n{% endif %}")
    fresh_tokenizer.chat_template = choose_template(fresh_tokenizer, "t.jinja",
                                                    base_dir=tmp_path)[0]
    ex = Example(messages=CHAT.messages[1:3], answer="3")
    enc = encode(fresh_tokenizer, ex, seq_len=512, overlong="truncate")
    trained = fresh_tokenizer.decode([t for t, lab in zip(enc.input_ids, enc.labels)
                                      if lab != IGNORE_INDEX])
    assert trained == "3 apples.\n#### 3<|eos|>"
    assert fresh_tokenizer.decode(encode_prompt(fresh_tokenizer, ex)) == (
        "[user]\nAva has 3 apples. How many?<|eos|>[assistant]\n")


def test_an_unknown_template_names_the_key_and_the_choices(fresh_tokenizer):
    with pytest.raises(ValueError, match=r"^data.chat_template: 'vicuna' is neither a named "
                                         r"template \(chatml, qwen, llama3\) nor a Jinja file"):
        choose_template(fresh_tokenizer, "vicuna")


def test_without_any_template_chatml_is_chosen_said_once_and_saved(fresh_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    assert not fresh_tokenizer.chat_template
    cfg = DataConfig(num_eval=2)
    data = build_data(cfg, fresh_tokenizer, micro_batch=1, seed=0)
    assert len(data.notes) == 1 and "using chatml" in data.notes[0]
    fresh_tokenizer.save_pretrained(tmp_path / "tok")  # what a checkpoint does
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert reloaded.chat_template == choose_template(reloaded, "chatml")[0]
    ex = data.eval_examples[0]
    assert encode_prompt(reloaded, ex) == encode_prompt(fresh_tokenizer, ex)
    # A tokenizer that has a template keeps it, with no note.
    again = build_data(cfg, reloaded, micro_batch=1, seed=0)
    assert again.notes == () and reloaded.chat_template == fresh_tokenizer.chat_template


@pytest.mark.parametrize("name, marker", [("chatml", "<|im_end|>"), ("llama3", None)])
def test_generation_stops_at_eos_and_at_the_templates_end_of_turn_token(name, marker,
                                                                        fresh_tokenizer):
    fresh_tokenizer.chat_template = choose_template(fresh_tokenizer, name)[0]
    vocab = fresh_tokenizer.get_vocab()
    # The test tokenizer holds <|im_end|> as one token but not <|eot_id|>.
    expected = [vocab["<|eos|>"]] + ([vocab[marker]] if marker else [])
    assert stop_token_ids(fresh_tokenizer) == expected


SMOLLM2_DIR = Path(os.environ.get("LAZYTRAIN_CACHE", Path.home() / ".cache/lazytrain")) \
    / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2_DIR / "tokenizer.json").exists(),
                    reason="SmolLM2 tokenizer not converted yet (lazytrain.models.smollm2)")
def test_chatml_on_the_real_smollm2_tokenizer_masks_by_the_assistant_mask():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tok.chat_template = choose_template(tok, "chatml")[0]
    enc = encode(tok, CHAT, seq_len=512, overlong="truncate")
    ids, labels = _reference(tok, EXPECTED["chatml"])
    assert (list(enc.input_ids), list(enc.labels)) == (ids, labels)
