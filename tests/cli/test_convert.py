"""`lazytrain convert megatrain`: every MegaTrain config in ../shared/megatrain_configs converts,
the result loads as our config with the source's values (read independently from the source
YAML), the ones whose model config is in ../shared/models plan, the others are refused in one
line naming the model, and a MegaTrain YAML given to plan or train points at the converter."""

from __future__ import annotations

import pytest
import yaml

from lazytrain.cli.main import main
from lazytrain.config import load_config

MODEL_OF = {
    "llama3_8b": "llama-3.1-8b",
    "gpt_oss_20b": "gpt-oss-20b",
    "qwen3_5_27b": "qwen3.5-27b",
    "qwen3_5_27b_4gpu": "qwen3.5-27b",
    "qwen3_8b": "qwen3-8b",
    "qwen3_next_80b": "qwen3-next-80b-a3b",
    "rl_qwen3_5_27b_grpo": "qwen3.5-27b",
}
"""MegaTrain config stem -> the ../shared/models file of its model."""
NO_MODEL_CONFIG = {"glm4_flash": "THUDM/glm-4-9b-chat", "qwen_7b": "Qwen/Qwen2.5-7B-Instruct",
                   "qwen_7b_1gpu": "/media/volume/Model/hf_cache/models--Qwen--Qwen2.5-7B"}
"""MegaTrain config stem -> what the plan refusal must name (the hub id or path)."""
BIG_HOST = {"qwen3_5_27b_4gpu": 1000, "qwen3_next_80b": 1000, "rl_qwen3_5_27b_grpo": 512}
"""DRAM (GB) of the machines these ran on: 80B x 12 B/param (bf16 masters + fp32 moments)
is 960 GB, and four ranks of a 27B model need ~4 x 128 GB; the h100-sxm preset's 360 GB fits
neither (the planner says so in one line). The config comment says "~640GB+ CPU RAM". The
GRPO config's KL term (kl_loss_coef 0.001) holds a bf16 reference copy of the 27B weights
beside the 12 B/param states: 54 GB more than the 348 GB its plan needs without it."""
STEMS = sorted([*MODEL_OF, *NO_MODEL_CONFIG])


def _convert(shared_dir, tmp_path, stem: str, capsys):
    out = tmp_path / f"{stem}.yaml"
    assert main(["convert", "megatrain", str(shared_dir / "megatrain_configs" / f"{stem}.yaml"),
                 "--out", str(out)]) == 0
    return out, capsys.readouterr().out


def test_the_shared_folder_holds_exactly_the_configs_this_test_knows(shared_dir):
    found = sorted(p.stem for p in (shared_dir / "megatrain_configs").glob("*.yaml"))
    assert found == STEMS


@pytest.mark.parametrize("stem", STEMS)
def test_megatrain_config_converts_with_its_values_and_every_key_reported(shared_dir, tmp_path,
                                                                        stem, capsys):
    source = yaml.safe_load((shared_dir / "megatrain_configs" / f"{stem}.yaml").read_text())
    out, report = _convert(shared_dir, tmp_path, stem, capsys)
    cfg = load_config(out)
    training, data = source["training"], source["dataset"]
    assert cfg.train.lr == training["learning_rate"]
    assert cfg.train.steps == training["num_steps"]
    assert cfg.train.micro_batch == training.get("batch_size", 4)  # GRPO has none: our default
    grpo = source.get("grpo", {})  # GRPO: the step's rollouts fill the micro-batches
    rollouts = grpo.get("num_prompts_per_batch", 0) * grpo.get("n_rollouts_per_prompt", 0)
    assert cfg.train.grad_accum == training.get("gradient_accumulation_steps",
                                                rollouts // 4 if grpo else 1)
    assert cfg.train.clip_grad_norm == training["max_grad_norm"]
    assert cfg.train.weight_decay == training["weight_decay"]
    assert cfg.train.seed == training["seed"]
    assert cfg.train.adam_beta2 == source["optimizer"]["beta2"]
    assert cfg.data.seq_len == data["max_seq_len"]
    assert cfg.planner.megatrain_k == source["memory"]["checkpoint_interval"]
    assert cfg.planner.policy == "milp"
    assert (cfg.model.dtype, cfg.train.compute_dtype, cfg.train.master_dtype) == ("bf16",) * 3
    assert cfg.model.config_path == source["model"]["name"]
    # every source key is reported as mapped or dropped, by its dotted name
    for section, body in source.items():
        for key in body:
            assert f"{section}.{key}" in report, f"{section}.{key} not reported"
    assert "dropped" in report and "memory.num_grad_slabs" in report


def test_gpu_list_becomes_ranks_on_one_node(shared_dir, tmp_path, capsys):
    out, _ = _convert(shared_dir, tmp_path, "qwen3_5_27b_4gpu", capsys)
    cfg = load_config(out)
    assert cfg.dist.nproc_per_node == 4 and cfg.hardware.gpus_per_node == 4
    assert cfg.data.path == "openai/gsm8k" and cfg.data.format == "gsm8k"
    assert cfg.data.subset == "main"  # openai/gsm8k loads no configuration unnamed


def test_query_response_fields_select_the_metamathqa_schema(shared_dir, tmp_path, capsys):
    out, _ = _convert(shared_dir, tmp_path, "qwen3_8b", capsys)
    cfg = load_config(out)
    assert (cfg.data.path, cfg.data.format) == ("dataset/Math/train", "metamathqa")


def test_registry_dataset_points_at_megatrain_data_folder(shared_dir, tmp_path, capsys):
    out, _ = _convert(shared_dir, tmp_path, "gpt_oss_20b", capsys)
    cfg = load_config(out)
    assert cfg.data.path == "alpaca_en_demo"
    assert cfg.data.registry_path == "data/dataset_info.json" and cfg.data.dataset_dir == "data"


@pytest.mark.parametrize("stem", sorted(MODEL_OF))
def test_converted_config_plans_with_the_shared_model_config(shared_dir, tmp_path, stem,
                                                            capsys):
    out, _ = _convert(shared_dir, tmp_path, stem, capsys)
    args = ["plan", "--config", str(out), "--model",
            str(shared_dir / "models" / f"{MODEL_OF[stem]}.json"), "--policy", "heuristic"]
    if stem in BIG_HOST:
        args += ["--set", f"hardware.dram_gb={BIG_HOST[stem]}"]
    assert main(args) == 0, capsys.readouterr().err[-800:]
    assert f"plan for {MODEL_OF[stem]}" in capsys.readouterr().out


@pytest.mark.parametrize("stem", sorted(NO_MODEL_CONFIG))
def test_plan_without_the_model_config_is_refused_in_one_line_naming_it(shared_dir, tmp_path,
                                                                       stem, capsys,
                                                                       monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the HF cache only
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf_cache"))
    out, _ = _convert(shared_dir, tmp_path, stem, capsys)
    assert main(["plan", "--config", str(out), "--policy", "heuristic"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(("error: model config not found",  # path
                                                      "error: model.config_path: "))  # hub id
    # the fix names the key (plan has --model, train does not; both take --set)
    assert NO_MODEL_CONFIG[stem] in err and "set model.config_path to" in err


@pytest.mark.parametrize("verb", ["plan", "train"])
def test_megatrain_yaml_given_to_plan_or_train_points_at_the_converter(shared_dir, verb,
                                                                       capsys):
    source = shared_dir / "megatrain_configs" / "qwen3_8b.yaml"
    assert main([verb, "--config", str(source)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "MegaTrain config" in err and f"lazytrain convert megatrain {source}" in err


def test_without_out_the_yaml_goes_to_stdout_and_the_report_to_stderr(shared_dir, tmp_path,
                                                                      capsys):
    assert main(["convert", "megatrain",
                 str(shared_dir / "megatrain_configs" / "llama3_8b.yaml")]) == 0
    captured = capsys.readouterr()
    (tmp_path / "c.yaml").write_text(captured.out)
    assert load_config(tmp_path / "c.yaml").train.micro_batch == 148
    assert "dropped" in captured.err and "dropped" not in captured.out.split("\n\n", 1)[1]


def test_grpo_section_becomes_train_method_grpo_with_its_values(shared_dir, tmp_path, capsys):
    source = yaml.safe_load((shared_dir / "megatrain_configs" / "rl_qwen3_5_27b_grpo.yaml")
                            .read_text())
    out, report = _convert(shared_dir, tmp_path, "rl_qwen3_5_27b_grpo", capsys)
    cfg = load_config(out)
    grpo, data = source["grpo"], source["dataset"]
    assert cfg.train.method == "grpo"
    assert cfg.grpo.n == grpo["n_rollouts_per_prompt"]
    assert cfg.grpo.prompts_per_step == grpo["num_prompts_per_batch"]
    assert cfg.grpo.clip_eps == grpo["clip_range"]
    assert cfg.grpo.kl_coef == grpo["kl_loss_coef"]
    assert cfg.grpo.scale_by_std is grpo["advantage_norm"]
    assert cfg.grpo.max_new_tokens == data["max_response_len"]
    assert cfg.train.lr == source["training"]["learning_rate"]
    # 4 prompts x 4 rollouts = 16 rows in micro-batches of our default 4
    assert cfg.train.micro_batch * cfg.train.grad_accum == 16
    line = next(x for x in report.splitlines() if "grpo.kl_loss_type" in x)
    assert "k3 estimator" in line


def test_hub_model_note_says_plan_fetches_its_config_not_that_planning_is_offline(
        shared_dir, tmp_path, capsys):
    # `lazytrain plan` resolves a hub id through huggingface_hub (README "Long runs"): the
    # converter's note and the YAML header must not tell the user that planning reads no network
    out, report = _convert(shared_dir, tmp_path, "qwen3_8b", capsys)
    header = "".join(line for line in out.read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    for text in (report, header):
        assert "no network" not in text
    assert "fetches only its config.json into the HF cache" in report
    assert "fetches only its config.json into the HF cache" in header
