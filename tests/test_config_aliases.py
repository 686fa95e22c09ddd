"""Spellings users bring from HF TrainingArguments and MegaTrain (`lazytrain.config.KEY_ALIASES`,
`VALUE_ALIASES`) load as our keys, and `train.report_to` takes HF's list or single name."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lazytrain.config import TrainConfig, config_from_dict, load_config, save_config


def _load(tmp_path, raw: dict, overrides=()):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, overrides)


def test_hf_spellings_set_our_keys(tmp_path):
    cfg = _load(tmp_path, {"model": {"dtype": "bfloat16"},
                           "data": {"max_seq_len": 512},
                           "train": {"learning_rate": 3e-5, "per_device_train_batch_size": 6,
                                     "gradient_accumulation_steps": 3, "max_steps": 7,
                                     "max_grad_norm": 0.5, "compute_dtype": "float32"}})
    assert cfg.model.dtype == "bf16" and cfg.train.compute_dtype == "fp32"
    assert (cfg.train.lr, cfg.train.micro_batch, cfg.train.grad_accum) == (3e-5, 6, 3)
    assert (cfg.train.steps, cfg.train.clip_grad_norm, cfg.data.seq_len) == (7, 0.5, 512)


def test_alias_in_an_override_sets_our_key(tmp_path):
    cfg = _load(tmp_path, {}, ["train.learning_rate=2e-4", "train.master_dtype=bfloat16"])
    assert cfg.train.lr == 2e-4 and cfg.train.master_dtype == "bf16"


def test_alias_and_its_key_both_set_is_refused_naming_both(tmp_path):
    with pytest.raises(ValueError, match="train.learning_rate and train.lr are both set"):
        _load(tmp_path, {"train": {"learning_rate": 1e-4, "lr": 2e-4}})


def test_saved_config_uses_our_names(tmp_path):
    cfg = _load(tmp_path, {"train": {"learning_rate": 3e-5}})
    saved = yaml.safe_load(save_config(cfg, tmp_path / "out.yaml").read_text())
    assert saved["train"]["lr"] == 3e-5 and "learning_rate" not in saved["train"]


@pytest.mark.skipif("epochs" not in {f.name for f in dataclasses.fields(TrainConfig)},
                    reason="train.epochs is not in this version's TrainConfig")
def test_num_train_epochs_sets_train_epochs(tmp_path):
    cfg = _load(tmp_path, {"train": {"num_train_epochs": 2}})
    assert cfg.train.epochs == 2


@pytest.mark.parametrize("value,expected", [
    ("tensorboard", ("tensorboard",)), (["tensorboard", "wandb"], ("tensorboard", "wandb")),
    (["none"], ("none",)), ([], ())], ids=["one_name", "list", "none", "empty"])
def test_report_to_takes_a_name_or_a_list(value, expected):
    assert config_from_dict({"train": {"report_to": value}}).train.report_to == expected


def test_report_to_refuses_an_unknown_tracker_and_none_with_others():
    with pytest.raises(ValueError, match="train.report_to must be one of tensorboard, wandb"):
        config_from_dict({"train": {"report_to": ["mlflow"]}})
    with pytest.raises(ValueError, match=r"train.report_to must be \[none\] alone"):
        config_from_dict({"train": {"report_to": ["none", "wandb"]}})


def test_report_to_round_trips_through_the_saved_yaml(tmp_path):
    cfg = config_from_dict({"train": {"report_to": ["tensorboard"]}})
    path = save_config(cfg, tmp_path / "c.yaml")
    assert load_config(path).train.report_to == ("tensorboard",)
