"""A run whose tokenizer has no chat template trains in chatml, says so in one line, and its
checkpoint's tokenizer carries the template, so inference renders prompts the same way."""

from __future__ import annotations

import pytest

from train_helpers import tiny_config
from lazytrain.data.templates import CHATML
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import train

pytestmark = pytest.mark.slow


def test_a_template_less_model_trains_in_chatml_and_saves_it(arithmetic_model_dir, tiny_plan,
                                                             tmp_path):
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(arithmetic_model_dir).chat_template
    lines: list[str] = []
    train(tiny_config(arithmetic_model_dir, tmp_path / "run", "data.num_eval=0",
                      "train.steps=1"), plan=tiny_plan, progress=False, log=lines.append)
    notes = [ln for ln in lines if "chat template" in ln]
    assert len(notes) == 1 and "using chatml" in notes[0]
    saved = AutoTokenizer.from_pretrained(ckpt.latest_checkpoint(tmp_path / "run").path)
    assert saved.chat_template == CHATML
    chat = [{"role": "user", "content": "Ava has 3 apples."}]
    assert saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nAva has 3 apples.<|im_end|>\n<|im_start|>assistant\n")


def test_a_configured_template_replaces_the_tokenizers_and_is_saved(arithmetic_model_dir,
                                                                     tiny_plan, tmp_path):
    from transformers import AutoTokenizer

    train(tiny_config(arithmetic_model_dir, tmp_path / "run", "data.num_eval=0",
                      "train.steps=1", "data.chat_template=llama3"), plan=tiny_plan,
          progress=False, log=lambda _: None)
    saved = AutoTokenizer.from_pretrained(ckpt.latest_checkpoint(tmp_path / "run").path)
    chat = [{"role": "user", "content": "hi"}]
    assert saved.apply_chat_template(chat, tokenize=False) == (
        "<|bos|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")


def test_a_missing_template_file_is_refused_before_planning_and_hub_eval_ids_pass(tmp_path):
    from lazytrain.config import DataConfig
    from lazytrain.train.checks import check_data_paths

    with pytest.raises(FileNotFoundError, match=r"^data.chat_template: 'chat.jinja' is neither "
                                                r"a named template \(chatml, qwen, llama3\)"):
        check_data_paths(DataConfig(chat_template="chat.jinja"), base_dir=tmp_path)
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    check_data_paths(DataConfig(chat_template="chat.jinja"), base_dir=tmp_path)
    check_data_paths(DataConfig(chat_template="llama3"), base_dir=tmp_path)
    # Hub ids for the eval data are the data layer's to resolve, as for data.path
    check_data_paths(DataConfig(path="openai/gsm8k", eval_path="openai/gsm8k",
                                eval_split="test"), base_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^data.eval_path: .*held.jsonl does not exist"):
        check_data_paths(DataConfig(eval_path="held.jsonl"), base_dir=tmp_path)
