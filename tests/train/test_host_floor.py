"""The host-memory preflight runs before planning: a machine that cannot hold the model's host
states is refused in one line before a calibration builds the model there (where the OOM
killer would end the job without a line)."""

from __future__ import annotations

import pytest

from lazytrain.cli.main import main
from lazytrain.spec.model import ModelSpec
from lazytrain.train import preflight, setup
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


def _must_not_run(*args, **kwargs):
    raise AssertionError("planning or calibration ran")


def test_too_little_host_memory_is_refused_before_planning_and_calibration(
        arithmetic_model_dir, tmp_path, monkeypatch, capsys):
    params = ModelSpec.from_hf_config(arithmetic_model_dir / "config.json").total_params
    need = 16 * params  # fp32 master, gradient, two moments (evaluation copies nothing)
    monkeypatch.setattr(preflight, "mem_available_bytes", lambda meminfo=None: need - 1)
    monkeypatch.setattr(setup, "make_plan", _must_not_run)
    monkeypatch.setattr(setup, "measure_calibration", _must_not_run)
    run = tmp_path / "run"
    code = main(["train", "--run-dir", str(run), "--no-progress",
                 "--set", f"model.config_path={arithmetic_model_dir}",
                 "--set", "runtime.device=cpu", "--set", "runtime.calibrate=auto",
                 "--set", "data.num_eval=4", "--set", "train.master_dtype=fp32"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 1 and len(err) == 1
    assert err[0].startswith("error: preflight: host memory: need ")
    assert "before planning and calibrating" in err[0]
    assert not (run / "config.yaml").exists() and not (run / "plan.json").exists()


def test_enough_host_memory_passes_the_floor(arithmetic_model_dir, tiny_plan, tmp_path,
                                             monkeypatch):
    params = ModelSpec.from_hf_config(arithmetic_model_dir / "config.json").total_params
    seen = []
    real = preflight.preflight_host_floor

    def floor(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr("lazytrain.train.plan_preflight.preflight_host_floor", floor)
    train(tiny_config(arithmetic_model_dir, tmp_path / "run", "train.steps=1",
                      "train.master_dtype=bf16", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    # bf16 masters: master 2 + gradient 2 + moments 8 bytes per parameter
    assert seen == [{"states_bytes": 12 * params}]


def test_held_out_examples_add_no_model_copy_to_the_host_floor(arithmetic_model_dir, tmp_path,
                                                               monkeypatch, capsys):
    """Host memory of exactly the fp32 states (16 B/param) passes the floor with 4 held-out
    examples: evaluation runs through the engine on the masters (it used to need 4 B/param
    more for an fp32 HF copy). Planning is stubbed to stop the job right after the floor."""
    params = ModelSpec.from_hf_config(arithmetic_model_dir / "config.json").total_params
    monkeypatch.setattr(preflight, "mem_available_bytes", lambda meminfo=None: 16 * params)

    def stop(*args, **kwargs):
        raise SystemExit("planned")

    monkeypatch.setattr(setup, "make_plan", stop)
    with pytest.raises(SystemExit, match="planned"):
        main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress",
              "--set", f"model.config_path={arithmetic_model_dir}", "--set", "runtime.device=cpu",
              "--set", "data.num_eval=4", "--set", "train.master_dtype=fp32"])
    assert "preflight" not in capsys.readouterr().err
