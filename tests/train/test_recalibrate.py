"""A run's measured windows replace the cached calibration they contradict by more than
`planner.drift_threshold` (one line says so), and leave alone one they agree with, a user's
own profile and an entry measured again since the plan was made.

The cache entries here are written by hand from the analytic problem (no calibration is
measured), the windows are the plan's own predicted windows scaled by a known factor, and the
reference is that factor: a calibration 4x too slow (times 4x the run's) is refit to the run's
times, and the same plan then predicts the run's measured step."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from lazytrain.cli.profile import analytic_profile
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.planner.window_time import post_ms, pre_ms
from lazytrain.planner.plan import Plan
from lazytrain.profile import calibrate
from lazytrain.spec.model import ModelSpec
from lazytrain.train import setup
from lazytrain.train.loop import _recalibrate, train
from lazytrain.train.recalibrate import recalibrate_from_run
from train_helpers import tiny_config

SLOW = 4.0
"""The calibration's times over the run's (the newcomer's record: 16.0 s / 4.15 s = 3.9x)."""


@pytest.fixture
def cached(arithmetic_model_dir, tmp_path, monkeypatch):
    """The tiny run's config with a hand-written cache entry: the analytic problem's times
    x SLOW, as a calibration under load would hold them. Returns (cfg, cache path)."""
    monkeypatch.delenv("LAZYTRAIN_CALIBRATE")
    cfg = tiny_config(arithmetic_model_dir, tmp_path / "run", "train.steps=3",
                      "data.num_eval=2", f"runtime.calibration_dir={tmp_path}/cal")
    spec = ModelSpec.from_hf_config(cfg.model.config_path)
    profile = analytic_profile(problem_from_config(cfg), [b.kind for b in spec.blocks], cfg)
    profile["model_config_sha256"] = spec.config_sha256
    for times in profile["block_kinds"].values():
        times.update({k: v * SLOW for k, v in times.items()})
    profile["ends"] = {k: v * SLOW for k, v in profile["ends"].items()}
    profile["step_const_ms"] = 5.0
    fields = calibrate.key_fields(cfg, device="cpu")
    path = calibrate.cache_file(cfg, fields)
    calibrate.write_cache(path, profile, fields)
    return cfg, path


def run_records(plan, problem, scale: float, steps=(1, 2, 3)) -> list[dict]:
    """windows.jsonl records of `steps` in which every window of `plan` took `scale` x its
    predicted time and compute under `problem` (pre and post: their terms, post with the step
    constant), so each step measures `scale` x the predicted step. pre and post are timed on
    the plan's weight paths, as the evaluator times them."""
    if plan.weight_paths is not None:
        problem = with_weight_paths(problem, plan.weight_paths)
    windows = [{"name": "pre", "wall_ms": scale * pre_ms(problem), "compute_ms": None}]
    windows += [{"name": w.name, "wall_ms": scale * w.time_ms,
                 "compute_ms": scale * w.compute_ms} for w in plan.windows]
    windows.append({"name": "post", "wall_ms": scale * (post_ms(problem) + problem.const_ms),
                    "compute_ms": None})
    return [{"step": s, "micro_batch": 0, "plan_id": plan.digest(), "windows": windows}
            for s in steps]


def calibrated_plan(cfg):
    """The plan of `cfg` made with the cached calibration (as `lazytrain train` makes it), and
    the problem of that calibration."""
    plan = setup.make_plan(cfg, calibrate=False, log=lambda msg: None)
    assert plan.provenance["costs"]["source"] == "calibrated"
    return plan, problem_from_config(calibrate.config_for_plan(cfg, plan.provenance))


def test_windows_4x_faster_than_the_cache_replace_it_and_the_plan_then_predicts_them(cached):
    cfg, path = cached
    plan, problem = calibrated_plan(cfg)
    assert evaluate(problem, plan).step_ms == pytest.approx(plan.predicted.step_ms)
    before = json.loads(path.read_text())
    log = []
    record = recalibrate_from_run(cfg, plan, run_records(plan, problem, 1 / SLOW),
                                  log=log.append)
    assert record is not None and record["steps"] == [2, 3]  # step 1 is the warm-up
    ratios = {d["channel"]: d["ratio"] for d in record["drifts"]}
    assert ratios["compute"] == pytest.approx(1 / SLOW) and ratios["step"] == pytest.approx(
        1 / SLOW)
    [line] = log
    drift = {d["channel"]: d for d in record["drifts"]}
    said = ", ".join(f"{ch} {drift[ch]['measured']:.0f} ms (planned {drift[ch]['planned']:.0f})"
                     for ch in ("compute", "step"))
    assert line.startswith("calibration: this run's windows contradict the cached calibration "
                           f"({said}, beyond planner.drift_threshold 0.15); replaced ")
    assert str(path) in line
    after = json.loads(path.read_text())
    assert after["calibration"]["fields"] == before["calibration"]["fields"]
    assert after["calibration"]["refit_from_run"] == record
    # forward times are determined by the f{j} windows alone: the run's, 1/4 of the cache's
    for kind, times in after["block_kinds"].items():
        assert times["fwd_ms"] == pytest.approx(before["block_kinds"][kind]["fwd_ms"] / SLOW,
                                                rel=1e-3)
    assert after["ends"]["head_ms"] == pytest.approx(before["ends"]["head_ms"] / SLOW, rel=1e-3)
    # the next run's problem: the same plan predicts what this run measured, 1/4 of before
    replanned = problem_from_config(calibrate.config_for_plan(cfg, plan.provenance))
    assert evaluate(replanned, plan).step_ms == pytest.approx(plan.predicted.step_ms / SLOW,
                                                              rel=1e-6)
    again = calibrate.resolve_profile(cfg, log=log.append)  # still a valid cache entry
    assert again.source == "calibrated" and again.path == str(path) and len(log) == 1


@pytest.mark.parametrize("scale", [1.1, 0.9], ids=["10%-slower", "10%-faster"])
def test_windows_within_the_threshold_leave_the_cache_alone(cached, scale):
    cfg, path = cached
    plan, problem = calibrated_plan(cfg)
    before = path.read_bytes()
    log = []
    assert recalibrate_from_run(cfg, plan, run_records(plan, problem, scale),
                                log=log.append) is None
    assert path.read_bytes() == before and log == []


def test_an_explicit_profile_and_a_recalibrated_entry_are_left_alone(cached, tmp_path):
    cfg, path = cached
    plan, problem = calibrated_plan(cfg)
    records = run_records(plan, problem, 1 / SLOW)
    own = tmp_path / "mine.json"
    own.write_bytes(path.read_bytes())
    mine = tiny_config(cfg.model.config_path, tmp_path / "run", f"hardware.profile_path={own}")
    assert recalibrate_from_run(mine, plan, records) is None  # the user's file, not the cache
    stored = json.loads(path.read_text())
    stored["calibration"]["measured_at"] = "2099-01-01T00:00:00Z"  # `profile --calibrate` since
    path.write_text(json.dumps(stored))
    assert recalibrate_from_run(cfg, plan, records) is None
    assert json.loads(path.read_text()) == stored


def test_a_run_planned_with_a_calibration_4x_too_slow_replaces_it(cached, tmp_path):
    cfg, path = cached
    log = []
    summary = train(cfg, progress=False, log=log.append)
    lines = [ln for ln in log if ln.startswith("calibration: this run's windows contradict")]
    assert len(lines) == 1 and str(path) in lines[0]
    stored = json.loads(path.read_text())
    assert stored["calibration"]["refit_from_run"] == summary["calibration_refit"]
    # the measured step of the run, by hand: the median over steps 2-3 of the windows' walls
    records = [json.loads(ln) for ln in (tmp_path / "run" / "windows.jsonl").read_text()
               .splitlines()]
    per_step = {}
    for r in records:
        if r["step"] > 1:
            per_step[r["step"]] = per_step.get(r["step"], 0.0) + sum(w["wall_ms"]
                                                                     for w in r["windows"])
    measured = statistics.median(per_step.values())
    plan = Plan.load(tmp_path / "run" / "plan.json")
    replanned = problem_from_config(calibrate.config_for_plan(cfg, plan.provenance))
    if stored["step_const_ms"] > 0:  # the constant took up the rest of the measured step
        assert evaluate(replanned, plan).step_ms == pytest.approx(measured, rel=1e-6)
    else:
        assert evaluate(replanned, plan).step_ms >= measured


def test_a_damaged_windows_file_is_a_warning_not_a_failed_run(cached, tmp_path):
    cfg, _path = cached
    plan, _problem = calibrated_plan(cfg)
    windows = tmp_path / "windows.jsonl"
    windows.write_text('{"step": 1, "wind\n{"step": 2, "windows": []}\n')  # line 1 torn
    log = []
    trainer = SimpleNamespace(windows_path=windows, plan=plan)
    assert _recalibrate(cfg, trainer, run_dir=tmp_path, log=log.append) is None
    [line] = log
    assert line.startswith("warning: the calibration cache could not be refit from this run")


def test_the_drift_line_gives_compute_per_step_never_above_the_step(cached):
    """Two measured steps (2 and 3): compute is the step's, by hand the sum of the plan's
    window compute x 1/SLOW (one micro-batch per step), not both steps' sum, and at most the
    measured step (which also holds the copies, pre and post)."""
    cfg, _path = cached
    plan, problem = calibrated_plan(cfg)
    log = []
    record = recalibrate_from_run(cfg, plan, run_records(plan, problem, 1 / SLOW),
                                  log=log.append)
    drift = {d["channel"]: d for d in record["drifts"]}
    by_hand = sum(w.compute_ms for w in plan.windows) / SLOW
    assert drift["compute"]["measured"] == pytest.approx(by_hand)
    assert drift["compute"]["planned"] == pytest.approx(by_hand * SLOW)
    assert drift["compute"]["measured"] <= drift["step"]["measured"]


def _with_copies(records: list[dict], channel: str, nbytes: int, wait_ms: float) -> list[dict]:
    """`records` with every forward window moving `nbytes` on `channel` in `wait_ms` of wait."""
    out = json.loads(json.dumps(records))
    for r in out:
        for w in r["windows"]:
            if w["name"].startswith("f"):
                w["bytes"], w["wait_ms"] = {channel: nbytes}, {channel: wait_ms}
    return out


@pytest.mark.parametrize("nbytes, wait_ms", [(4096, 50.0), (128 * 2**20, 10_000.0)],
                         ids=["4-KiB-copies", "0.01-GB/s"])
def test_a_rate_of_almost_nothing_never_reaches_the_cache(cached, nbytes, wait_ms):
    """A loaded run's h2d fit of ~0 GB/s (a few KiB timed against a stalled wait: 0.00008
    GB/s; or 128 MiB per window at 0.013 GB/s) is refused with one note; the compute drift
    still replaces the rest, and the cached h2d rate stays."""
    cfg, path = cached
    plan, problem = calibrated_plan(cfg)
    before = json.loads(path.read_text())
    log = []
    records = _with_copies(run_records(plan, problem, 1 / SLOW), "h2d", nbytes, wait_ms)
    record = recalibrate_from_run(cfg, plan, records, log=log.append)
    assert record is not None and "h2d" in record["refused"]
    assert "h2d" not in {d["channel"] for d in record["drifts"]}
    after = json.loads(path.read_text())
    assert after["bandwidths"]["h2d_gb_per_s"] == before["bandwidths"]["h2d_gb_per_s"]
    [note] = [ln for ln in log if ln.startswith("note: calibration: this run's h2d ")]
    assert "not used: the cache keeps its rate" in note and "\n" not in note


def test_a_replaced_entry_is_dated_by_its_refit(cached):
    """The costs line's date follows the file: after a refit, `measured_at` is the refit's
    time and the replaced date is kept in the record."""
    cfg, path = cached
    stored = json.loads(path.read_text())
    stored["calibration"]["measured_at"] = "2026-01-01T00:00:00Z"
    path.write_text(json.dumps(stored))
    plan, problem = calibrated_plan(cfg)
    record = recalibrate_from_run(cfg, plan, run_records(plan, problem, 1 / SLOW))
    after = json.loads(path.read_text())
    assert after["calibration"]["measured_at"] == record["at"] != "2026-01-01T00:00:00Z"
    assert record["replaced_measured_at"] == "2026-01-01T00:00:00Z"
    line = calibrate.resolve_profile(cfg).line()
    assert line.endswith(f"measured {record['at']})")


def test_a_window_overhead_measured_under_load_shrinks_to_the_measured_step(cached):
    """An entry whose fixed window cost is 10 ms (a loaded calibration) and a run 4x faster
    in every window: the refit compute alone still predicts more than the measured step, so
    the constant goes to 0 and the overhead shrinks until the same plan predicts the measured
    step (the reference: the records' median step, by hand)."""
    cfg, path = cached
    stored = json.loads(path.read_text())
    stored["window_overhead_ms"] = 10.0
    path.write_text(json.dumps(stored))
    plan, problem = calibrated_plan(cfg)
    assert problem.window_overhead_ms == 10.0
    records = run_records(plan, problem, 1 / SLOW)
    measured = statistics.median(sum(w["wall_ms"] for w in r["windows"]) for r in records[1:])
    assert recalibrate_from_run(cfg, plan, records) is not None
    after = json.loads(path.read_text())
    assert after["step_const_ms"] == 0.0 and 0.0 <= after["window_overhead_ms"] < 10.0
    replanned = problem_from_config(calibrate.config_for_plan(cfg, plan.provenance))
    assert evaluate(replanned, plan).step_ms == pytest.approx(measured, rel=1e-6)
