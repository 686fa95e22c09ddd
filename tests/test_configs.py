"""The run config schema and the shipped YAML files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lazytrain.config import (SECTIONS, RunConfig, apply_overrides, field_docs, load_config,
                              save_config)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_yaml_loads_and_opens_with_a_comment_giving_the_command(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    head = path.read_text().splitlines()[:20]
    assert head[0].startswith("#")
    assert any("lazytrain " in line for line in head if line.startswith("#"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_yaml_builds_a_planning_problem(path, shared_dir):
    from lazytrain.planner.build import problem_from_config
    problem = problem_from_config(load_config(path))
    assert problem.num_blocks >= 1


@pytest.mark.parametrize("cls", [RunConfig, *SECTIONS.values()], ids=lambda c: c.__name__)
def test_every_config_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}
    assert [name for name, doc in docs.items() if not doc] == []


def test_defaults_are_the_embedded_default_job():
    cfg = load_config(None)
    assert cfg.model.config_path == "smollm2-135m-instruct"
    assert cfg.hardware.preset == "cpu" and cfg.runtime.device == "auto"
    assert cfg.data.path == "embedded:arithmetic" and cfg.data.seq_len == 112
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.steps) == (4, 1, 30)
    assert cfg.train.compute_dtype == "fp32"
    assert (cfg.planner.policy, cfg.planner.backend) == ("milp", "auto")


def test_unknown_key_names_the_dotted_path_and_the_closest_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("planner:\n  time_limit: 3\n")
    with pytest.raises(ValueError,
                       match=r"planner\.time_limit; did you mean planner\.time_limit_s"):
        load_config(path)


def test_unknown_section_names_the_closest_section():
    with pytest.raises(ValueError, match="unknown config key trian; did you mean train"):
        load_config(None, ["trian.steps=3"])


def test_wrong_type_names_the_key_and_the_expected_type(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: many\n")
    with pytest.raises(TypeError, match="train.steps must be an int; got 'many'"):
        load_config(path)
    with pytest.raises(TypeError, match="planner.allow_keep must be a bool"):
        load_config(None, ["planner.allow_keep=3"])


def test_out_of_range_value_names_the_key_and_the_value():
    with pytest.raises(ValueError, match="planner.time_limit_s must be > 0; got -1.0"):
        load_config(None, ["planner.time_limit_s=-1"])
    with pytest.raises(ValueError, match="train.compute_dtype must be one of bf16, fp32"):
        load_config(None, ["train.compute_dtype=fp16"])


def test_overrides_apply_before_validation_and_parse_yaml_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: -5\n")  # invalid alone; the override fixes it
    cfg = load_config(path, ["train.lr=3e-4", "hardware.hbm_gb=40", "data.packing=true"])
    assert cfg.train.lr == 3e-4 and cfg.hardware.hbm_gb == 40.0 and cfg.data.packing is True
    assert apply_overrides(cfg, ["train.steps=5"]).train.steps == 5


def test_malformed_override_says_how_to_write_it():
    with pytest.raises(ValueError, match="section.key=value"):
        load_config(None, ["train.steps"])


def test_save_then_load_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=7", "hardware.dram_gb=12.5"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path) == cfg
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_relative_model_path_resolves_against_the_yaml_directory(tmp_path, monkeypatch):
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "m.json").write_text("{}")
    (tmp_path / "cfgs" / "c.yaml").write_text("model:\n  config_path: m.json\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(tmp_path / "cfgs" / "c.yaml")
    assert cfg.model.config_path == str(tmp_path / "cfgs" / "m.json")


def test_model_path_under_shared_falls_back_to_a_shared_tree_beside_the_repo(tmp_path,
                                                                          monkeypatch):
    (tmp_path / "repo" / "configs").mkdir(parents=True)
    (tmp_path / "shared" / "models").mkdir(parents=True)
    (tmp_path / "shared" / "models" / "x.json").write_text("{}")
    yaml_path = tmp_path / "repo" / "configs" / "c.yaml"
    # Written for a checkout one level deeper; the shared/ tail still resolves.
    yaml_path.write_text("model:\n  config_path: ../../../shared/models/x.json\n")
    monkeypatch.chdir(tmp_path / "repo")
    cfg = load_config(yaml_path)
    assert cfg.model.config_path == str(tmp_path / "shared" / "models" / "x.json")


@pytest.mark.parametrize("override,key", [
    ("hardware.hbm_gb=.inf", "hardware.hbm_gb"),
    ("hardware.nvme_gb=1e400", "hardware.nvme_gb"),
    ("train.lr=.inf", "train.lr"),
    ("train.min_lr_ratio=.nan", "train.min_lr_ratio"),
    ("planner.time_limit_s=.inf", "planner.time_limit_s"),
    ("dist.timeout_s=.inf", "dist.timeout_s"),
])
def test_non_finite_numbers_are_rejected_naming_the_key(override, key):
    with pytest.raises(ValueError, match=f"{key} must be a finite number; got (inf|nan)"):
        load_config(None, [override])


def test_a_quoted_overflowing_number_in_the_yaml_is_rejected_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('hardware:\n  nvme_gb: "1e400"\n')
    with pytest.raises(ValueError, match="hardware.nvme_gb must be a finite number; got inf"):
        load_config(path)


@pytest.mark.parametrize("override,rule", [
    ("hardware.h2d_gb_per_s=1e-300", r"hardware.h2d_gb_per_s must be in \[0.001, 1e\+06\] GB/s"),
    ("hardware.nvme_read_gb_per_s=1e9", r"hardware.nvme_read_gb_per_s must be in \[0.001"),
    ("hardware.peak_tflops=1e-300", r"hardware.peak_tflops must be in \[0.001, 1e\+06\] TFLOP/s"),
    ("hardware.matmul_efficiency=1e-300", r"hardware.matmul_efficiency must be in \[0.001, 1\]"),
    ("hardware.hbm_gb=1e300", r"hardware.hbm_gb must be in \(0, 1e\+06\] GB"),
])
def test_implausible_hardware_overrides_are_rejected_with_their_range(override, rule):
    with pytest.raises(ValueError, match=rule):
        load_config(None, [override])


def test_hardware_overrides_at_the_ends_of_their_ranges_are_accepted():
    cfg = load_config(None, ["hardware.h2d_gb_per_s=1e-3", "hardware.d2h_gb_per_s=1e6",
                             "hardware.peak_tflops=1e-3", "hardware.matmul_efficiency=1e-3",
                             "hardware.hbm_gb=1e-6", "hardware.nvme_gb=0"])
    assert (cfg.hardware.h2d_gb_per_s, cfg.hardware.d2h_gb_per_s) == (1e-3, 1e6)


def test_malformed_yaml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: [\n")
    with pytest.raises(ValueError, match=r"bad.yaml: not valid YAML \(line 2, column 1: "):
        load_config(path)


def test_malformed_yaml_in_an_override_value_names_the_override():
    with pytest.raises(ValueError, match=r"override 'train.lr=\[': the value is not valid YAML"):
        load_config(None, ["train.lr=["])


def test_an_empty_section_is_the_defaults_with_and_without_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n")
    assert load_config(path).train == RunConfig().train
    cfg = load_config(path, ["train.micro_batch=2"])
    assert cfg.train == dataclasses.replace(RunConfig().train, micro_batch=2)


def test_a_non_string_key_is_named_as_unknown(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("1: 2\n")
    with pytest.raises(ValueError, match="unknown config key 1; valid keys: model, hardware"):
        load_config(path)
    path.write_text("train:\n  1: 2\n")
    with pytest.raises(ValueError, match="unknown config key train.1;"):
        load_config(path)


@pytest.mark.parametrize("kind", ["range", "non-finite", "unknown key", "unknown section",
                                  "choice", "alias twice", "override", "yaml", "megatrain",
                                  "wrong type", "not a mapping", "missing file"])
def test_every_refusal_of_the_loader_is_a_config_error_and_still_its_builtin(tmp_path, kind):
    from lazytrain.errors import (ConfigError, ConfigFileNotFoundError, ConfigTypeError,
                                  UserError)
    yaml_text = {"yaml": "train: [\n", "megatrain": "training: {}\n",
                 "alias twice": "train:\n  lr: 0.1\n  learning_rate: 0.2\n",
                 "not a mapping": "- 1\n"}.get(kind)
    path = tmp_path / "c.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text)
    overrides = {"range": ["train.lr=-1"], "non-finite": ["hardware.hbm_gb=.nan"],
                 "unknown key": ["train.lrr=1"], "unknown section": ["trian.lr=1"],
                 "choice": ["planner.policy=best"], "override": ["train.lr"],
                 "wrong type": ["train.steps=many"]}.get(kind, [])
    source = {"missing file": tmp_path / "nope.yaml"}.get(kind, path if yaml_text else None)
    builtin = {"wrong type": TypeError, "not a mapping": TypeError,
               "missing file": FileNotFoundError}.get(kind, ValueError)
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    needle = {"range": "train.lr must be > 0", "non-finite": "hardware.hbm_gb must be a finite",
              "unknown key": "did you mean train.lr", "unknown section": "did you mean train",
              "choice": "planner.policy must be one of", "alias twice": "are both set",
              "override": "must look like section.key=value", "yaml": "not valid YAML",
              "megatrain": "is a MegaTrain config", "wrong type": "train.steps must be an int",
              "not a mapping": "top level must be a mapping", "missing file": "not found"}[kind]
    assert needle in str(info.value)
    assert all(isinstance(info.value, cls) for cls in (UserError, ValueError, builtin))
    assert isinstance(info.value, ConfigTypeError) == (builtin is TypeError)
    assert isinstance(info.value, ConfigFileNotFoundError) == (builtin is FileNotFoundError)
