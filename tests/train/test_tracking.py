"""`train.report_to`: TensorBoard event files and an offline W&B run carry, per step, the values
of metrics.jsonl, the exposed ms per channel summed from windows.jsonl (the test sums them
itself), and the plan's predicted step; a missing package names the extra to install."""

from __future__ import annotations

import json

import pytest

from train_helpers import tiny_config
from lazytrain.train import tracking
from lazytrain.train.loop import train


def _jsonl(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _exposed_by_step(run_dir) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for rec in _jsonl(run_dir / "windows.jsonl"):
        per = out.setdefault(rec["step"], {})
        for w in rec["windows"]:
            for channel, ms in w["wait_ms"].items():
                per[channel] = per.get(channel, 0.0) + ms
    return out


@pytest.mark.slow
def test_tensorboard_and_offline_wandb_carry_the_metrics_of_every_step(arithmetic_model_dir,
                                                                       tiny_plan, tmp_path,
                                                                       monkeypatch):
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run_dir, "data.num_eval=0", "train.steps=2",
                      "train.report_to=[tensorboard, wandb]")
    train(cfg, plan=tiny_plan, progress=False)
    metrics = _jsonl(run_dir / "metrics.jsonl")
    exposed = _exposed_by_step(run_dir)

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
               for tag in events.Tags()["scalars"]}
    for rec in metrics:
        step = rec["step"]
        assert scalars["train/loss"][step] == pytest.approx(rec["loss"], rel=1e-6)
        assert scalars["train/lr"][step] == pytest.approx(rec["lr"], rel=1e-6)
        assert scalars["train/grad_norm"][step] == pytest.approx(rec["grad_norm"], rel=1e-6)
        assert scalars["perf/tokens_per_s"][step] == pytest.approx(rec["tokens_per_s"], rel=1e-6)
        assert scalars["perf/model_tflops"][step] == pytest.approx(rec["model_tflops"],
                                                                   rel=1e-6)
        assert scalars["perf/step_ms_measured"][step] == pytest.approx(rec["step_s"] * 1e3,
                                                                       rel=1e-6)
        assert scalars["perf/step_ms_predicted"][step] == pytest.approx(
            tiny_plan.predicted.step_ms, rel=1e-6)
        for channel in tracking.EXPOSED_CHANNELS:
            assert scalars[f"exposed_ms/{channel}"][step] == pytest.approx(
                exposed[step].get(channel, 0.0), rel=1e-5, abs=1e-6)
        assert scalars["memory/peak_hbm_checkpoint_bytes"][step] == rec["peak_bytes"]["hbm"]

    # The offline run file is a log of protobuf records whose history items hold each value as
    # JSON text, stored raw: every step's loss and grad norm must be in it next to its key.
    [offline] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    raw = offline.read_bytes()
    for key in ("train/loss", "train/grad_norm", "exposed_ms/h2d", "perf/step_ms_predicted"):
        assert raw.count(key.encode()) >= len(metrics), key  # history (+ summary) records
    for rec in metrics:
        assert json.dumps(rec["loss"]).encode() in raw
        assert json.dumps(rec["grad_norm"]).encode() in raw
    assert wandb.run is None  # the run was finished


def test_step_scalars_sum_the_waits_of_every_window_and_micro_batch():
    record = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 100.0,
              "model_tflops": 0.01, "step_s": 0.25,
              "peak_bytes": {"hbm": 4096, "dram": 1000, "dram_staging": 24, "nvme": 8192}}
    mb0 = {"windows": [{"wait_ms": {"h2d": 1.5, "d2h": 0.25}},
                       {"wait_ms": {"h2d": 2.0, "nvme_read": 3.0}}]}
    mb1 = {"windows": [{"wait_ms": {"h2d": 0.5, "optimizer": 4.0}}]}
    out = tracking.step_scalars(record, windows=[mb0, mb1], predicted_step_ms=200.0)
    assert out["exposed_ms/h2d"] == 4.0  # 1.5 + 2.0 + 0.5
    assert out["exposed_ms/d2h"] == 0.25 and out["exposed_ms/nvme_read"] == 3.0
    assert out["exposed_ms/nvme_write"] == 0.0 and out["exposed_ms/optimizer"] == 4.0
    assert out["perf/step_ms_measured"] == 250.0 and out["perf/step_ms_predicted"] == 200.0
    assert out["memory/peak_host_checkpoint_bytes"] == 1024.0  # dram + dram_staging
    assert "memory/peak_hbm_allocated_bytes" not in out  # CPU: no CUDA allocator figure


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_names_the_extra_to_install(name, monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda mod: None if mod == name else real(mod))
    with pytest.raises(ValueError, match=rf"pip install 'lazytrain\[{name}\]'"):
        tracking.check_trackers(["tensorboard", "wandb"])


def test_none_opens_no_tracker():
    assert tracking.check_trackers(["none"]) == ()
    assert tracking.check_trackers([]) == ()


def test_a_resumed_run_replaces_the_tensorboard_steps_it_redoes(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    first = tracking.Trackers(["tensorboard"], run_dir=tmp_path, config={})
    for step in (1, 2, 3):
        first.log(step, {"train/loss": float(step)})
    first.close()  # crashed after step 3; the last checkpoint was step 1
    resumed = tracking.Trackers(["tensorboard"], run_dir=tmp_path, config={})
    for step in (2, 3):
        resumed.log(step, {"train/loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(1, 1.0), (2, 20.0), (3, 30.0)]  # steps 2, 3 of the first run purged
