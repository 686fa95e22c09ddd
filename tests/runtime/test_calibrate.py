"""The calibration cache: a miss measures once and stores the key's fields, a hit reuses the
file (measurements counted through a wrapper, never timed), any key field change or a corrupt
file measures again, a plan for another machine never reads it, and `lazytrain plan` and
`lazytrain train` plan with the same profile."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from lazytrain.config import load_config
from lazytrain.profile import calibrate
from lazytrain.runtime import steady
from lazytrain.spec.model import ModelSpec
from lazytrain.train import setup
from tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-block tiny Llama whose tokenizer was trained on the embedded arithmetic problems."""
    from lazytrain.data.synthetic import arithmetic_dataset

    train, _ = arithmetic_dataset(num_train=300, num_eval=0, seed=7)
    texts = [m.content for ex in train for m in ex.messages] + ["Question: Answer: ####"]
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), texts, layers=2)


@pytest.fixture
def counted(monkeypatch):
    """Calibration on (the suite turns it off), the real measurement wrapped in a counter, and
    an idle load average and steady timing (no busy-machine warning and no second try from the
    other jobs of a CI box)."""
    monkeypatch.delenv("LAZYTRAIN_CALIBRATE")
    monkeypatch.setattr(calibrate.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(steady, "cpu_others_s", lambda: None)
    monkeypatch.setattr(steady, "MAX_SPREAD", float("inf"))
    calls = []

    def measure(cfg, device, **kwargs):
        calls.append((cfg.train.micro_batch, cfg.train.compute_dtype, device))
        return real(cfg, device, **kwargs)

    real = setup.measure_calibration
    monkeypatch.setattr(setup, "measure_calibration", measure)
    return calls


def tiny(model_dir, tmp_path, *extra: str):
    """The tiny CPU run config, its cache in tmp_path/cal."""
    return load_config(None, [f"model.config_path={model_dir}", f"train.run_dir={tmp_path}/run",
                              "data.seq_len=160", "data.num_eval=2", "train.micro_batch=2",
                              "train.steps=1", "train.warmup_steps=0",
                              "planner.policy=megatrain", "planner.megatrain_k=2",
                              "runtime.device=cpu", f"runtime.calibration_dir={tmp_path}/cal",
                              *extra])


def resolve(cfg, log=None):
    return calibrate.resolve_profile(cfg, measure=setup.measure_calibration,
                                     log=(log.append if log is not None else print))


def cache_files(tmp_path):
    return sorted((tmp_path / "cal").glob("calibration-*.json"))


def test_a_miss_measures_once_stores_the_key_fields_and_a_second_resolve_reuses_it(
        model_dir, tmp_path, counted):
    cfg = tiny(model_dir, tmp_path)
    first = resolve(cfg)
    assert first.source == "calibrated" and len(counted) == 1
    [path] = cache_files(tmp_path)
    assert first.path == str(path) and first.config.hardware.profile_path == str(path)
    stored = json.loads(path.read_text())
    fields = stored["calibration"]["fields"]
    assert fields == {
        "cpu_model": calibrate.cpu_model(), "gpu_name": "none",
        "torch_version": torch.__version__,
        "model_config_sha256": ModelSpec.from_hf_config(str(model_dir)).config_sha256,
        "micro_batch": 2, "seq_len": 160, "compute_dtype": "fp32", "master_dtype": "fp32",
        "torch_threads": torch.get_num_threads(), "io_threads": 2}
    assert stored["seq_len"] == 160 and stored["micro_batch"] == 2  # the profile itself
    assert set(stored["block_kinds"]) == {"dense"}
    second = resolve(cfg)
    assert len(counted) == 1  # no second measurement
    assert second.path == first.path and second.measured_at == first.measured_at
    assert second.line() == (f"costs: calibrated on this machine (cache {path}, measured "
                             f"{stored['calibration']['measured_at']})")


def test_the_problem_takes_the_cached_block_times(model_dir, tmp_path, counted):
    from lazytrain.planner.build import problem_from_config

    costs = resolve(tiny(model_dir, tmp_path))
    stored = json.loads(cache_files(tmp_path)[0].read_text())
    problem = costs.annotate(problem_from_config(costs.config))
    dense = stored["block_kinds"]["dense"]
    assert problem.fwd_ms == (dense["fwd_ms"],) * 2 and problem.bwd_ms == (dense["bwd_ms"],) * 2
    assert problem.const_ms == pytest.approx(stored["step_const_ms"])
    assert problem.provenance["costs"]["source"] == "calibrated"


@pytest.mark.parametrize("change", ["train.micro_batch=1", "train.compute_dtype=bf16",
                                    "train.master_dtype=bf16", "runtime.io_threads=1",
                                    "torch_version"])
def test_a_changed_key_field_measures_a_new_calibration(model_dir, tmp_path, counted,
                                                        monkeypatch, change):
    before = resolve(tiny(model_dir, tmp_path))
    if change == "torch_version":
        monkeypatch.setattr(torch, "__version__", "9.9.9+test")
        cfg = tiny(model_dir, tmp_path)
    else:
        cfg = tiny(model_dir, tmp_path, change)
    after = resolve(cfg)
    assert len(counted) == 2 and after.path != before.path
    assert len(cache_files(tmp_path)) == 2
    again = resolve(cfg)  # the new entry is reused in turn
    assert len(counted) == 2 and again.path == after.path


def test_an_entry_whose_stored_fields_differ_is_measured_again(model_dir, tmp_path, counted):
    cfg = tiny(model_dir, tmp_path)
    resolve(cfg)
    [path] = cache_files(tmp_path)
    stored = json.loads(path.read_text())
    stored["calibration"]["fields"]["torch_version"] = "1.0"  # a file copied from elsewhere
    path.write_text(json.dumps(stored))
    log = []
    resolve(cfg, log)
    assert len(counted) == 2
    assert any("torch_version '1.0' -> " in line for line in log)
    assert json.loads(path.read_text())["calibration"]["fields"]["torch_version"] == \
        torch.__version__


@pytest.mark.parametrize("content", ["{not json", "", '["a list"]',
                                     '{"calibration": {"version": 1}}'],
                         ids=["truncated", "empty", "list", "no-fields"])
def test_a_corrupt_cache_file_is_measured_again_with_one_warning(model_dir, tmp_path, counted,
                                                                 content):
    cfg = tiny(model_dir, tmp_path)
    path = calibrate.cache_file(cfg, calibrate.key_fields(cfg, device="cpu"))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    log = []
    costs = resolve(cfg, log)
    assert costs.source == "calibrated" and len(counted) == 1
    warnings = [line for line in log if line.startswith("warning:")]
    assert len(warnings) == 1 and str(path) in warnings[0] and "corrupt" in warnings[0]
    assert "calibration" in json.loads(path.read_text())


def test_a_cached_profile_with_broken_block_times_is_corrupt(model_dir, tmp_path, counted):
    cfg = tiny(model_dir, tmp_path)
    resolve(cfg)
    path = cache_files(tmp_path)[0]
    stored = json.loads(path.read_text())
    del stored["block_kinds"]["dense"]["bwd_ms"]
    path.write_text(json.dumps(stored))
    log = []
    plan_side = calibrate.resolve_profile(cfg, log=log.append)  # as `lazytrain plan`: no measure
    assert plan_side.source == "analytic" and len(counted) == 1
    assert "corrupt (block kind 'dense' lacks fwd_ms/fwd_grad_ms/bwd_ms)" in log[0]


@pytest.mark.parametrize("preset", ["h100-sxm", "h800-paper"])
def test_a_plan_for_another_machine_never_uses_this_machines_calibration(
        model_dir, tmp_path, counted, preset):
    resolve(tiny(model_dir, tmp_path))
    assert len(counted) == 1
    for device in ("cpu", "auto"):
        other = tiny(model_dir, tmp_path, f"hardware.preset={preset}", f"runtime.device={device}")
        costs = resolve(other)
        assert costs.source == "analytic" and costs.config == other
        assert costs.line() == f"costs: analytic (hardware preset {preset})"
    assert len(counted) == 1 and len(cache_files(tmp_path)) == 1
    with pytest.raises(ValueError, match=f"hardware.preset: {preset} .* does not describe this "
                                         f"machine"):
        calibrate.calibrate(other, setup.measure_calibration)


@pytest.mark.parametrize("how", ["config", "env"])
def test_calibration_off_plans_analytic_and_writes_nothing(model_dir, tmp_path, counted,
                                                          monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("LAZYTRAIN_CALIBRATE", "off")
        cfg = tiny(model_dir, tmp_path)
    else:
        cfg = tiny(model_dir, tmp_path, "runtime.calibrate=off")
    costs = resolve(cfg)
    assert costs.source == "analytic" and costs.line() == "costs: analytic (hardware preset cpu)"
    assert counted == [] and not (tmp_path / "cal").exists()


def test_an_explicit_profile_wins_over_the_calibration(model_dir, tmp_path, counted):
    cfg = tiny(model_dir, tmp_path, "hardware.profile_path=some/profile.json")
    costs = resolve(cfg)
    assert (costs.source, costs.line()) == ("profile", "costs: measured profile "
                                                       "some/profile.json")
    assert counted == []


def test_plan_reads_the_cache_train_wrote_and_both_plan_with_the_same_profile(
        model_dir, tmp_path, counted, capsys):
    from lazytrain.cli.plan import load_problem
    from lazytrain.planner.policy import PlannerOptions, plan
    from lazytrain.train.loop import train

    cfg = tiny(model_dir, tmp_path)
    args = argparse.Namespace(config=None, set=[f"{k}={v}" for k, v in (
        ("model.config_path", model_dir), ("train.run_dir", tmp_path / "run"),
        ("data.seq_len", 160), ("data.num_eval", 2), ("train.micro_batch", 2),
        ("train.steps", 1), ("train.warmup_steps", 0), ("planner.policy", "megatrain"),
        ("planner.megatrain_k", 2), ("runtime.device", "cpu"),
        ("runtime.calibration_dir", tmp_path / "cal"))])
    _cfg, before = load_problem(args)  # nothing cached yet: analytic, and it says so
    assert before.provenance["costs"]["source"] == "analytic"
    assert "`lazytrain train` measures one" in calibrate.costs_line(before.provenance["costs"])
    assert counted == []
    summary = train(cfg, progress=False, log=lambda msg: None)
    assert len(counted) == 1
    path = str(cache_files(tmp_path)[0])
    assert summary["plan"]["costs"].startswith(f"costs: calibrated on this machine (cache {path}")
    assert f"costs: calibrated on this machine (cache {path}" in capsys.readouterr().out
    trained = json.loads((tmp_path / "run" / "plan.json").read_text())
    _cfg, problem = load_problem(args)
    planned = plan(problem, PlannerOptions(policy="megatrain", megatrain_k=2, lp_bound=False))
    assert len(counted) == 1  # plan measured nothing
    assert problem.provenance["costs"] == trained["provenance"]["costs"]
    assert trained["provenance"]["costs_source"] == f"profile:{path}"
    assert planned.predicted.step_ms == pytest.approx(trained["predicted"]["step_ms"])
    from lazytrain.cli.main import main

    refit = tmp_path / "refit.json"  # a refit starts from the calibration the run planned with
    assert main(["profile", "--from-run", str(tmp_path / "run"), "--skip-steps", "0",
                 "--out", str(refit)]) == 0
    assert json.loads(refit.read_text())["calibration"] == \
        json.loads(cache_files(tmp_path)[0].read_text())["calibration"]


def test_profile_calibrate_refreshes_the_cache_entry(model_dir, tmp_path, counted, capsys):
    from lazytrain.cli.main import main

    sets = [f"model.config_path={model_dir}", f"train.run_dir={tmp_path}/run",
            "data.seq_len=160", "train.micro_batch=2", "runtime.device=cpu",
            f"runtime.calibration_dir={tmp_path}/cal"]
    argv = ["profile", "--calibrate"] + [x for s in sets for x in ("--set", s)]
    assert main(argv) == 0
    [path] = cache_files(tmp_path)
    assert capsys.readouterr().out.strip() == str(path)
    assert main(argv) == 0  # explicit: measured again although cached
    assert len(counted) == 2 and cache_files(tmp_path) == [path]
    assert main(argv + ["--set", "hardware.preset=h100-sxm"]) == 2
    assert "does not describe this machine" in capsys.readouterr().err


@pytest.mark.parametrize("preset, name, same", [
    ("h100-pcie", "NVIDIA H100 PCIe", True), ("h100-sxm", "NVIDIA H100 PCIe", False),
    ("h100-sxm", "NVIDIA H100 80GB HBM3", True), ("h100-pcie", "NVIDIA H100 80GB HBM3", False),
    ("h200", "NVIDIA H200", True), ("h100-sxm", "NVIDIA H200", False),
    ("a100-80gb", "NVIDIA A100-SXM4-80GB", True), ("rtx-4090", "NVIDIA GeForce RTX 4090", True),
    ("rtx-3090", "NVIDIA GeForce RTX 4090", False), ("cpu", "NVIDIA H200", False),
    ("my-gpu.json", "NVIDIA H200", False)])
def test_a_gpu_preset_describes_the_device_whose_name_holds_its_model(preset, name, same):
    assert calibrate.preset_describes_gpu(preset, name) is same


def test_on_cuda_the_key_holds_the_gpu_name_and_the_preset_must_match(model_dir, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert calibrate.machine_device(tiny(model_dir, tmp_path, "hardware.preset=h200",
                                         "runtime.device=auto")) == "cuda"
    assert calibrate.machine_device(tiny(model_dir, tmp_path, "hardware.preset=h100-sxm",
                                         "runtime.device=cuda")) is None
    assert calibrate.machine_device(tiny(model_dir, tmp_path, "runtime.device=auto")) is None
    assert calibrate.key_fields(tiny(model_dir, tmp_path), device="cuda")["gpu_name"] == \
        "NVIDIA H200"


def test_the_default_cache_dir_follows_xdg_cache_home(model_dir, tmp_path, monkeypatch):
    cfg = load_config(None, [f"model.config_path={model_dir}"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibrate.calibration_dir(cfg) == tmp_path / "xdg" / "lazytrain" / "calibration"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibrate.calibration_dir(cfg) == tmp_path / "home" / ".cache" / "lazytrain" / \
        "calibration"


def test_a_bare_yaml_off_is_the_off_choice_and_a_bad_env_value_is_named(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("runtime:\n  calibrate: off\n")
    cfg = load_config(path)
    assert cfg.runtime.calibrate == "off"
    monkeypatch.setenv("LAZYTRAIN_CALIBRATE", "never")
    with pytest.raises(ValueError, match="LAZYTRAIN_CALIBRATE: 'never' is not auto or off"):
        calibrate.calibration_mode(cfg)


def test_a_replan_sees_the_calibration_its_plan_was_made_with(model_dir, tmp_path):
    cfg = tiny(model_dir, tmp_path)
    cached = tmp_path / "calibration-0123.json"
    cached.write_text("{}")
    record = {"costs": {"source": "calibrated", "file": str(cached)}}
    assert calibrate.config_for_plan(cfg, record).hardware.profile_path == str(cached)
    explicit = tiny(model_dir, tmp_path, "hardware.profile_path=mine.json")
    assert calibrate.config_for_plan(explicit, record) == explicit  # the config's profile wins
    assert calibrate.config_for_plan(cfg, {"costs": {"source": "analytic"}}) == cfg
    cached.unlink()  # the cache was cleared since: the config's own costs
    assert calibrate.config_for_plan(cfg, record) == cfg


@pytest.mark.parametrize("load, share, warned", [(0.0, None, False), (1e3, None, True),
                                                  (0.0, 0.9, True)],
                         ids=["idle", "busy", "disturbed-while-measuring"])
def test_a_calibration_on_a_busy_machine_is_kept_with_a_warning(model_dir, tmp_path, counted,
                                                                 monkeypatch, load, share, warned):
    monkeypatch.setattr(calibrate.os, "getloadavg", lambda: (load, load, load))
    if share is not None:  # other processes use `share` of the CPUs all along; one try each
        wall = iter(range(1, 10 ** 6))
        cpus = steady.cpu_count_of()
        monkeypatch.setattr(steady, "cpu_others_s", lambda: (lambda t: (share * cpus * t, t))(
            float(next(wall))))
        monkeypatch.setattr(steady, "MAX_TRIES", 1)
    log = []
    costs = resolve(tiny(model_dir, tmp_path), log)
    assert costs.source == "calibrated" and len(counted) == 1
    stored = json.loads(cache_files(tmp_path)[0].read_text())
    assert stored["calibration"]["load_avg_1min"] == load
    busy = [line for line in log if "the machine was busy while calibrating" in line]
    assert len(busy) == int(warned)
    if share is not None:
        assert "block kind dense, ends disturbed on every try" in busy[0]
        assert stored["measurements"]["steady"]["ends"]["others_share"] == pytest.approx(share)


def test_an_unwritable_cache_dir_plans_analytic_with_one_warning(model_dir, tmp_path, counted):
    (tmp_path / "afile").write_text("")  # the cache dir would have to be inside a file
    cfg = tiny(model_dir, tmp_path, f"runtime.calibration_dir={tmp_path}/afile/cal")
    log = []
    costs = resolve(cfg, log)
    assert costs.source == "analytic" and len(counted) == 1
    assert costs.line().startswith("costs: analytic (hardware preset cpu); the calibration could "
                                   "not be cached: set runtime.calibration_dir")
    [warning] = [line for line in log if line.startswith("warning:")]
    assert f"cannot write the calibration cache {tmp_path}/afile/cal/" in warning
    with pytest.raises(OSError):  # the explicit refresh says so as an error
        calibrate.calibrate(cfg, setup.measure_calibration)
