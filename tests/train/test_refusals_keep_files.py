"""A refused job touches nothing: ten malformed configs, each with `--overwrite` over a finished
run and each into a fresh run directory, exit 2 with one line; the finished run's files stay
byte-identical (lock files aside) and a fresh run directory gets no config.yaml or plan.json.
A refused `--resume` leaves the run's config.yaml as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from lazytrain.cli.main import main

pytestmark = pytest.mark.slow

LOCKS = (".lazytrain.lock",)


def _base(model_dir, data_file):
    return {"model": {"config_path": str(model_dir)},
            "data": {"path": str(data_file), "seq_len": 160, "num_eval": 0},
            "train": {"micro_batch": 2, "steps": 1, "lr": 3e-3, "warmup_steps": 0},
            "planner": {"policy": "megatrain", "megatrain_k": 2},
            "runtime": {"device": "cpu"}}


def _rows(n=12):
    return "".join(json.dumps({"instruction": f"Add {i} and {i}.", "output": f"{2 * i}"}) + "\n"
                   for i in range(n))


def _malformed(tmp_path, good: dict) -> dict[str, dict]:
    """The review's ten malformed configs, each `good` with one mistake."""
    empty, broken = tmp_path / "empty.jsonl", tmp_path / "broken.jsonl"
    empty.write_text("")
    broken.write_text(_rows(3) + '{"instruction": "Add 1 and 1.", "output": \n' + _rows(3))

    def edit(section, key, value):
        cfg = json.loads(json.dumps(good))
        if key is None:
            cfg[section] = value
        else:
            cfg[section][key] = value
        return cfg

    typo = json.loads(json.dumps(good))
    typo["train"]["stpes"] = typo["train"].pop("steps")
    return {
        "typo'd key": typo,
        "wrong type": edit("train", "steps", "many"),
        "negative lr": edit("train", "lr", -1e-3),
        "steps 0": edit("train", "steps", 0),
        "seq_len 0": edit("data", "seq_len", 0),
        "missing data file": edit("data", "path", str(tmp_path / "nope.jsonl")),
        "empty data file": edit("data", "path", str(empty)),
        "malformed JSONL line": edit("data", "path", str(broken)),
        "unknown chat template": edit("data", "chat_template", "no-such-template"),
        "hbm_gb given in MB": edit("hardware", None, {"hbm_gb": 80000}),
    }


def _snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in LOCKS}


def _train_over_run_and_fresh(config, run, fresh, capsys):
    """`lazytrain train` with `config` over the finished `run` (--overwrite), then into the
    fresh dir: yields (exit code, non-empty stderr lines) of each."""
    for target, extra in ((run, ["--overwrite"]), (fresh, [])):
        code = main(["train", "--config", str(config), "--run-dir", str(target), "--no-progress",
                     *extra])
        yield code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def finished(arithmetic_model_dir, tmp_path_factory):
    """A finished one-step run and the config it ran with."""
    root = tmp_path_factory.mktemp("finished")
    data = root / "data.jsonl"
    data.write_text(_rows())
    good = _base(arithmetic_model_dir, data)
    path = root / "good.yaml"
    path.write_text(yaml.safe_dump(good))
    assert main(["train", "--config", str(path), "--run-dir", str(root / "run"),
                 "--no-progress"]) == 0
    return root / "run", good


def test_ten_malformed_configs_exit_2_in_one_line_and_touch_nothing(finished, tmp_path, capsys):
    run, good = finished
    before = _snapshot(run)
    assert "config.yaml" in before and "plan.json" in before and any(
        k.startswith("checkpoints/") for k in before)
    capsys.readouterr()
    failures = []
    for name, cfg in _malformed(tmp_path, good).items():
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for target, extra in ((run, ["--overwrite"]), (tmp_path / "fresh", [])):
            shutil.rmtree(tmp_path / "fresh", ignore_errors=True)
            code = main(["train", "--config", str(path), "--run-dir", str(target),
                         "--no-progress", *extra])
            err = capsys.readouterr().err.strip().splitlines()
            where = "overwrite" if extra else "fresh"
            if code != 2:
                failures.append(f"{name} ({where}): exit {code}: {err[-3:]}")
            elif len([ln for ln in err if ln.strip()]) != 1 or not err[0].startswith("error: "):
                failures.append(f"{name} ({where}): not one line: {err}")
            if extra and _snapshot(run) != before:
                failures.append(f"{name} ({where}): the finished run's files changed")
                before = _snapshot(run)
            if not extra and ((target / "config.yaml").exists()
                              or (target / "plan.json").exists()):
                failures.append(f"{name} ({where}): left config.yaml or plan.json behind")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("override", ["data.path", "train.seed=11"])
def test_a_refused_resume_leaves_config_yaml_and_the_plain_resume_goes_on(
        finished, tmp_path, capsys, override):
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    if override == "data.path":
        other = tmp_path / "other.jsonl"
        other.write_text(_rows(15))
        override = f"data.path={other}"
    before = (run / "config.yaml").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "2", "--no-progress",
                 "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: data: checkpoint was made on ")
    assert (run / "config.yaml").read_bytes() == before
    assert main(["train", "--resume", str(run), "--steps", "2", "--no-progress"]) == 0
    assert "done: 2 steps (this run 1)" in capsys.readouterr().out


def test_overwrite_counts_the_space_of_the_run_it_replaces(arithmetic_model_dir, tiny_plan,
                                                           tmp_path, monkeypatch):
    from lazytrain.spec.model import ModelSpec
    from lazytrain.train import preflight
    from lazytrain.train.loop import train
    from train_helpers import tiny_config

    run = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0")
    train(cfg, plan=tiny_plan, progress=False)
    params = ModelSpec.from_hf_config(arithmetic_model_dir / "config.json").total_params
    need = 2 * 12 * params  # two checkpoints of fp32 weights and two fp32 moments
    old_run = sum(p.stat().st_size for p in run.rglob("*")
                  if p.is_file() and p.name not in LOCKS)
    assert 0 < old_run < need
    # the disk has room for the new checkpoints only once the old run's files are gone
    monkeypatch.setattr(preflight, "free_bytes", lambda path: need - old_run // 2)
    summary = train(cfg, plan=tiny_plan, progress=False, overwrite=True)
    assert summary["steps_completed"] == 1


def test_data_of_which_no_sample_fits_seq_len_is_refused_before_a_file_is_touched(
        finished, tmp_path, capsys):
    """seq_len 8 keeps no answer token of any sample (the chat template's prompt fills it): the
    data is read fine, but the run can draw no batch. Refused at its first step before, after
    --overwrite had deleted the finished run (and a fresh run dir kept config.yaml and
    plan.json)."""
    run, good = finished
    before = _snapshot(run)
    cfg = json.loads(json.dumps(good))
    cfg["data"]["seq_len"] = 8
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    for code, err in _train_over_run_and_fresh(path, run, tmp_path / "fresh", capsys):
        assert code == 2 and err[-1].startswith("error: data: no sample fits data.seq_len=8")
        assert _snapshot(run) == before
    assert not (tmp_path / "fresh" / "config.yaml").exists()
    assert not (tmp_path / "fresh" / "plan.json").exists()


@pytest.mark.parametrize("damage", ["header", "tail"])
def test_damaged_model_weights_are_one_line_before_a_file_is_touched(
        finished, arithmetic_model_dir, tmp_path, capsys, damage):
    """A model directory whose model.safetensors is cut (a broken download) failed with a
    SafetensorError traceback while loading weights, after --overwrite had deleted the
    finished run and a fresh run dir had its config.yaml and plan.json."""
    run, good = finished
    before = _snapshot(run)
    model = tmp_path / "model"
    shutil.copytree(arithmetic_model_dir, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.truncate(1000 if damage == "header" else size - 100)
    cfg = json.loads(json.dumps(good))
    cfg["model"]["config_path"] = str(model)
    path = tmp_path / "damaged.yaml"
    path.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    for code, err in _train_over_run_and_fresh(path, run, tmp_path / "fresh", capsys):
        assert code == 2 and len(err) == 1, err[-3:]
        assert err[0].startswith(f"error: model.config_path: {weights} is damaged")
        assert _snapshot(run) == before
    assert not (tmp_path / "fresh" / "config.yaml").exists()
