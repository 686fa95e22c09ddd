"""Which model a job runs: model.name alone never trains the built-in SmolLM2, and Hugging Face
hub ids resolve through huggingface_hub's cache (a fake local cache here: no network)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from lazytrain.cli.main import main
from lazytrain.config import config_from_dict


def _llama_config(layers: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 384,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "tie_word_embeddings": True}


def _fake_hub_cache(root, repo_id: str, files: dict | None = None, copy_from=None):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/REV/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    if copy_from is not None:
        shutil.copytree(copy_from, snapshot)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, body in (files or {}).items():
        (snapshot / name).write_text(json.dumps(body))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_model_name_alone_becomes_the_source_or_is_refused():
    assert config_from_dict({}).model.config_path == "smollm2-135m-instruct"  # nothing named
    named = config_from_dict({"model": {"name": "Qwen/Qwen3-8B"}}).model
    assert named.config_path == "Qwen/Qwen3-8B" and named.name == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match=r"model\.config_path: not set, but model\.name is "
                                         r"'my-label'"):
        config_from_dict({"model": {"name": "my-label"}})
    both = config_from_dict({"model": {"name": "label", "config_path": "smollm2-135m-instruct"}})
    assert both.model.name == "label"


def test_plan_of_a_named_hub_model_reads_its_config_from_the_hf_cache(offline_cache, tmp_path,
                                                                      capsys):
    from lazytrain.spec.model import ModelSpec

    _fake_hub_cache(offline_cache, "Org/Five", {"config.json": _llama_config(5)})
    assert ModelSpec.from_hf_config("Org/Five").num_blocks == 5
    path = tmp_path / "named.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "Org/Five"}}))
    assert main(["plan", "--config", str(path), "--policy", "megatrain"]) == 0
    out = capsys.readouterr().out
    assert "5 blocks" in out and "30 blocks" not in out  # not the built-in SmolLM2
    assert "plan for Org/Five (Org/Five) on " in out  # the summary names the source


def test_an_uncached_hub_id_while_offline_exits_2_with_one_line(offline_cache, capsys):
    assert main(["plan", "--model", "Org/Missing", "--policy", "megatrain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.config_path: Org/Missing")
    assert "HF_HUB_OFFLINE" in err[0] and "hf download Org/Missing" in err[0]


@pytest.mark.slow
def test_training_a_hub_id_loads_its_weights_from_the_cache_and_names_the_source(
        arithmetic_model_dir, offline_cache, tmp_path, capsys):
    from safetensors.torch import load_file

    from lazytrain.train import checkpoint as ckpt
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    snapshot = _fake_hub_cache(offline_cache, "Org/Tiny", copy_from=arithmetic_model_dir)
    cfg = tiny_config("Org/Tiny", tmp_path / "run", "train.steps=1", "data.num_eval=0",
                      "train.lr=1e-12", "train.warmup_steps=0")
    summary = train(cfg, progress=False)
    assert summary["steps_completed"] == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("plan: ") and "(Org/Tiny)" in first
    # the weights came from the cache: after one step at lr 1e-12 they still equal the files
    start = load_file(str(snapshot / "model.safetensors"))
    end = load_file(str(ckpt.latest_checkpoint(tmp_path / "run").path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert (start[name] - end[name]).abs().max() < 1e-6


def test_the_train_plan_summary_prints_the_model_source(tiny_plan):
    from lazytrain.train.setup import plan_summary

    first = plan_summary(tiny_plan, source="/models/tiny").splitlines()[0]
    assert first.startswith(f"plan: {tiny_plan.provenance['model']} (/models/tiny) on ")
