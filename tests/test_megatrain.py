"""`lazytrain.megatrain`: recognising a MegaTrain YAML without false positives on ours, and the
key mapping on hand-written inputs (HF spellings, unknown keys, dtypes, cache paths)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lazytrain.config import TrainConfig, config_from_dict
from lazytrain.megatrain import convert_megatrain, looks_like_megatrain, model_id_of, \
    with_train_keys


@pytest.mark.parametrize("raw,expected", [
    ({"model": {"name": "x"}, "training": {"num_steps": 1}}, True),
    ({"dataset": {}, "memory": {}}, True),
    ({"model": {"name": "Qwen/Qwen3-8B", "attn_implementation": "sdpa"}}, True),
    ({"model": {"name": "my-label", "dtype": "bf16"}, "train": {"steps": 2}}, False),
    ({"model": {"config_path": "m.json"}, "data": {}, "planner": {}}, False),
    ([1, 2], False)], ids=["training", "two_sections", "model_keys", "ours_with_name",
                           "ours", "not_a_mapping"])
def test_recognises_megatrain_layout_only(raw, expected):
    assert looks_like_megatrain(raw) is expected


def test_every_shipped_config_of_ours_is_not_taken_for_megatrain(repo_root):
    for path in sorted((repo_root / "configs").glob("*.yaml")):
        assert not looks_like_megatrain(yaml.safe_load(path.read_text())), path.name


def test_hf_spellings_and_unknown_keys_in_a_megatrain_yaml():
    raw = {"model": {"name": "meta-llama/Llama-3.1-8B", "dtype": "float32"},
           "training": {"per_device_train_batch_size": 3, "max_steps": 9,
                        "num_train_epochs": 2, "lr_scheduler": "cosine"},
           "dataset": {"path": "data/x.jsonl", "query_field": "q", "response_field": "a"}}
    conv = convert_megatrain(raw, train_keys=with_train_keys(TrainConfig))
    cfg = config_from_dict(conv.config)
    assert (cfg.train.micro_batch, cfg.train.steps) == (3, 9)
    assert (cfg.model.dtype, cfg.train.compute_dtype, cfg.train.master_dtype) == \
        ("fp32", "fp32", "fp32")  # fp32: masters stay at our fp32 default
    dropped = dict(conv.dropped)
    assert "not a MegaTrain key" in dropped["training.lr_scheduler"]
    assert "not a known schema" in dropped["dataset.query_field + dataset.response_field"]
    if "epochs" in {f.name for f in dataclasses.fields(TrainConfig)}:
        assert cfg.train.epochs == 2
    else:
        assert "no train.epochs" in dropped["training.num_train_epochs"]


def test_an_unknown_dtype_is_dropped_with_the_reason():
    conv = convert_megatrain({"model": {"name": "a/b", "dtype": "float16"}})
    assert "float16" in dict(conv.dropped)["model.dtype"]
    assert "model" in conv.config and "dtype" not in conv.config["model"]


def test_hf_cache_snapshot_path_names_its_hub_id():
    path = "/media/x/models--Qwen--Qwen2.5-7B/snapshots/d149729398750b98c0af"
    assert model_id_of(path) == "Qwen/Qwen2.5-7B"
    assert model_id_of("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


def test_a_config_without_model_name_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.name"):
        convert_megatrain({"training": {"num_steps": 3}})


def test_trl_spellings_of_the_grpo_keys_map_onto_ours():
    raw = {"model": {"name": "a/b"},
           "training": {"batch_size": 2, "num_steps": 5},
           "grpo": {"num_generations": 8, "num_prompts_per_batch": 1, "epsilon": 0.28,
                    "beta": 0.04, "temperature": 0.7, "top_p": 0.9,
                    "max_completion_length": 64, "learning_rate": 3e-6}}
    conv = convert_megatrain(raw, train_keys=with_train_keys(TrainConfig))
    cfg = config_from_dict(conv.config)
    assert cfg.train.method == "grpo"
    assert (cfg.grpo.n, cfg.grpo.prompts_per_step, cfg.grpo.clip_eps, cfg.grpo.kl_coef) == \
        (8, 1, 0.28, 0.04)
    assert (cfg.grpo.temperature, cfg.grpo.top_p, cfg.grpo.max_new_tokens) == (0.7, 0.9, 64)
    assert cfg.train.lr == 3e-6
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == (2, 4)  # 8 rollouts in rows of 2
    assert conv.dropped == []


def test_a_config_without_grpo_keys_stays_supervised():
    conv = convert_megatrain({"model": {"name": "a/b"},
                              "dataset": {"max_response_len": 9}})
    assert "method" not in conv.config.get("train", {})
    assert "supervised training has no rollouts" in dict(conv.dropped)["dataset.max_response_len"]
