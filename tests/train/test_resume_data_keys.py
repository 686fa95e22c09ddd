"""A resume keeps what makes its token stream: data.chat_template, data.overlong and
data.packing change the tokens trained on (or which samples and rows), so another value is
refused in one line before anything is written; it was accepted, config.yaml took the new
value, and the run went on with another template than the checkpoint's."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("override", ["data.chat_template=llama3", "data.overlong=skip",
                                      "data.packing=true"])
def test_a_resume_with_another_token_stream_is_refused(arithmetic_model_dir, tiny_plan,
                                                       tmp_path, override):
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
          plan=tiny_plan, progress=False, log=lambda line: None)
    config_before = (run / "config.yaml").read_bytes()
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"^{key}: .* differs from .*resume with {key}=") as info:
        train(tiny_config(arithmetic_model_dir, run, "train.steps=2", "data.num_eval=0",
                          override), resume=True, progress=False, log=lambda line: None)
    assert "\n" not in str(info.value)
    assert (run / "config.yaml").read_bytes() == config_before
