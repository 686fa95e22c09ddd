"""A model directory whose tokenizer.json is damaged is one line naming model.config_path, not
a KeyError or tokenizers' bare Exception traceback."""

from __future__ import annotations

import shutil

import pytest

from lazytrain.train import model_source


@pytest.mark.parametrize("text", [
    "{}",  # KeyError: 'added_tokens' from transformers
    '{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null, '
    '"post_processor": null, "decoder": null, "model": {"type": "Nope"}}',  # tokenizers' Exception
])
def test_a_damaged_tokenizer_json_is_one_line_naming_the_key(arithmetic_model_dir, tmp_path,
                                                             text):
    model = tmp_path / "model"
    shutil.copytree(arithmetic_model_dir, model)
    (model / "tokenizer.json").write_text(text)
    source = model_source.ModelSource(directory=model, has_weights=True)
    with pytest.raises(ValueError, match=r"^model.config_path: no tokenizer in ") as info:
        model_source.load_tokenizer(source)
    assert "\n" not in str(info.value)
