"""`lazytrain train` from the command line: outputs, exit codes, one-line refusals."""

from __future__ import annotations

import json

import pytest
import yaml

from lazytrain.cli.main import main

pytestmark = pytest.mark.slow


def _config_file(tmp_path, model_dir, **sections):
    cfg = {"model": {"config_path": str(model_dir)},
           "data": {"seq_len": 160, "num_eval": 2},
           "train": {"micro_batch": 2, "steps": 2, "lr": 3e-3, "warmup_steps": 0},
           "planner": {"policy": "megatrain", "megatrain_k": 2},
           "runtime": {"device": "cpu"}}
    for section, values in sections.items():
        cfg[section].update(values)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_writes_metrics_summary_and_a_checkpoint(arithmetic_model_dir, tiny_plan, tmp_path,
                                                       capsys):
    path = _config_file(tmp_path, arithmetic_model_dir)
    run_dir = tmp_path / "run"
    tiny_plan.save(tmp_path / "plan.json")  # planning itself is the planner's tests' subject
    assert main(["train", "--config", str(path), "--run-dir", str(run_dir), "--no-progress",
                 "--plan", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "done: 2 steps" in out
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert {"step", "loss", "tokens", "step_s", "peak_bytes", "lr"} <= set(records[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_before"]["num_examples"] == 2 and summary["eval_after"] is not None
    assert (run_dir / "plan.json").is_file() and (run_dir / "config.yaml").is_file()
    # --resume with more steps continues from step 2 with the run's own config and plan.
    assert main(["train", "--resume", str(run_dir), "--steps", "3", "--no-progress"]) == 0
    assert "done: 3 steps (this run 1)" in capsys.readouterr().out


def test_preflight_refusal_exits_1_with_one_line(arithmetic_model_dir, tmp_path, capsys):
    # A plan whose NVMe tier needs more than any disk: the preflight refuses before training.
    path = _config_file(tmp_path, arithmetic_model_dir)
    run_dir = tmp_path / "run"
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord
    import dataclasses

    problem = problem_from_config(load_config(path))
    big = dataclasses.replace(problem, boundary_bytes=(10**18,) * len(problem.boundary_bytes),
                              nvme_bytes=10**20, dram_bytes=10**20, hbm_bytes=10**20)
    plan = build_plan(big, decisions_from_tiers(big, ("hbm", "nvme", "hbm", "hbm")),
                      solver=SolveRecord(backend="manual"))
    plan.save(tmp_path / "plan.json")
    code = main(["train", "--config", str(path), "--run-dir", str(run_dir),
                 "--plan", str(tmp_path / "plan.json"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("error: preflight: ") and "need" in err[-1] and "have" in err[-1]
