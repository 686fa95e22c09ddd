"""`lazytrain report`: --json keys, the table, the Gantt PNG (written atomically), usage errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
from test_report import write_run  # noqa: E402  (the hand-written run of the report tests)

from lazytrain.cli.main import main


def test_report_json_has_the_promised_keys_and_hand_computed_totals(tmp_path, capsys):
    write_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"predicted_step_ms", "measured_step_ms", "windows"} <= set(out)
    assert (out["predicted_step_ms"], out["measured_step_ms"]) == (40, 45)
    for w in out["windows"]:
        assert {"name", "predicted_ms", "measured_ms", "exposed_ms"} <= set(w)
        assert set(w["exposed_ms"]) == {"h2d", "d2h", "nvme_read", "nvme_write", "optimizer"}
    assert out["most_wrong"][0] == "b0"


def test_report_writes_the_gantt_png_through_a_temp_file_and_rename(tmp_path, capsys,
                                                                    monkeypatch):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "run")
    renames = []
    real_replace = os.replace

    def spy(src, dst):
        renames.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    png = tmp_path / "out" / "gantt.png"
    assert main(["report", str(tmp_path / "run"), "--gantt", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (src, dst), = renames
    assert dst == png and src.parent == png.parent and src != png
    assert sorted(p.name for p in png.parent.iterdir()) == ["gantt.png"]  # no temp file left
    assert "most wrong" in capsys.readouterr().out


def test_report_without_windows_jsonl_exits_2_naming_the_file(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["report", str(tmp_path / "run")]) == 2
    assert "windows.jsonl" in capsys.readouterr().err


def test_report_with_another_plan_file(tmp_path, capsys):
    plan = write_run(tmp_path / "run")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(plan, predicted=dict(plan["predicted"], step_ms=50.0))))
    assert main(["report", str(tmp_path / "run"), "--plan", str(other), "--force",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # another plan id: its records are none, so every record is used (warm-up still skipped)
    assert out["predicted_step_ms"] == 50.0 and out["measured_step_ms"] == 45


def test_report_refuses_a_plan_the_run_did_not_measure_unless_forced(tmp_path, capsys):
    from lazytrain.planner.plan import plan_digest

    plan = write_run(tmp_path / "run")
    from lazytrain.atomic import read_jsonl

    records = read_jsonl(tmp_path / "run" / "windows.jsonl")
    assert {r.get("plan_id") for r in records} == {plan_digest(plan)}  # the run's own plan
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(plan, predicted=dict(plan["predicted"], step_ms=50.0))))
    assert main(["report", str(tmp_path / "run"), "--plan", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --plan:") and "--force" in err and len(err.splitlines()) == 1
    assert plan_digest(json.loads(other.read_text())) in err
    # the run's own plan passed with --plan is accepted
    same = tmp_path / "same.json"
    same.write_text(json.dumps(plan))
    assert main(["report", str(tmp_path / "run"), "--plan", str(same), "--json"]) == 0
