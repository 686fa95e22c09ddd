"""`report.tables.compare` on a hand-written run: medians, deltas and totals computed by hand."""

from __future__ import annotations

import json

import pytest

from lazytrain.atomic import read_jsonl
from lazytrain.report.tables import compare_with_run, format_table, plan_id_of_dict

ZERO_WAITS = {"h2d": 0.0, "d2h": 0.0, "nvme_read": 0.0, "nvme_write": 0.0, "optimizer": 0.0}
ZERO_BYTES = {"h2d": 0, "d2h": 0, "nvme_read": 0, "nvme_write": 0}


def plan_dict() -> dict:
    """A one-block plan: windows f0, turn, b0 (only the keys the report reads)."""
    def win(name, time_ms, compute_ms, hbm):
        return {"name": name, "compute_ms": compute_ms, "h2d_bytes": 0, "d2h_bytes": 0,
                "nvme_read_bytes": 0, "nvme_write_bytes": 0, "time_ms": time_ms,
                "exposed_ms": time_ms - compute_ms, "hbm_checkpoint_bytes": hbm}
    return {"version": 1, "provenance": {"grad_accum": 1},
            "boundaries": [{"index": 0, "tier": "dram"}, {"index": 1, "tier": "hbm"}],
            "windows": [win("f0", 10.0, 8.0, 100), win("turn", 5.0, 5.0, 300),
                        win("b0", 20.0, 12.0, 200)],
            "transfers": [], "predicted": {"step_ms": 40.0, "model_tflops": 0,
                                           "hardware_tflops": 0, "tokens_per_s": 0,
                                           "peak_hbm_bytes": 0, "dram_bytes": 0, "nvme_bytes": 0}}


def window(name, wall, *, h2d=0.0, hbm=0):
    return {"name": name, "wall_ms": wall, "compute_ms": wall - h2d,
            "wait_ms": dict(ZERO_WAITS, h2d=h2d), "bytes": dict(ZERO_BYTES),
            "peak_bytes": {"hbm": hbm, "dram": 0, "nvme": 0}}


# wall ms per step for pre, f0, turn, b0, post; step 1 is warm-up (skipped by default)
WALLS = {1: (9, 99, 99, 99, 9), 2: (1, 11, 5, 22, 1), 3: (1, 13, 6, 30, 1), 4: (2, 12, 4, 26, 1)}
H2D_B0 = {1: 50.0, 2: 2.0, 3: 6.0, 4: 4.0}


def write_run(run_dir, *, plan=None) -> dict:
    plan = plan or plan_dict()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(plan))
    pid = plan_id_of_dict(plan)
    with open(run_dir / "windows.jsonl", "w") as fh:
        for step, walls in WALLS.items():
            names = ("pre", "f0", "turn", "b0", "post")
            ws = [window(n, w, h2d=H2D_B0[step] if n == "b0" else 0.0,
                         hbm=250 if n == "turn" else 0) for n, w in zip(names, walls)]
            fh.write(json.dumps({"step": step, "micro_batch": 0, "plan_id": pid,
                                 "windows": ws}) + "\n")
        fh.write('{"step": 5, "micro_')  # a torn last line (crash mid-append) is skipped
    return plan


def test_compare_gives_hand_computed_medians_and_deltas(tmp_path):
    plan = write_run(tmp_path)
    c = compare_with_run(plan, read_jsonl(tmp_path / "windows.jsonl"))
    rows = {w.name: w for w in c.windows}
    assert c.steps_used == [2, 3, 4]
    # f0: median(11, 13, 12) = 12 vs 10 -> +2; b0: median(22, 30, 26) = 26 vs 20 -> +6
    assert rows["f0"].measured_ms == 12 and rows["f0"].delta_ms == pytest.approx(2.0)
    assert rows["b0"].measured_ms == 26 and rows["b0"].delta_ms == pytest.approx(6.0)
    # turn: median(5, 6, 4) = 5 vs 5 -> 0
    assert rows["turn"].delta_ms == pytest.approx(0.0)
    # b0 h2d wait median(2, 6, 4) = 4; compute median(20, 24, 22) = 22
    assert rows["b0"].exposed_ms["h2d"] == 4 and rows["b0"].measured_compute_ms == 22
    assert rows["pre"].predicted_ms is None
    # step sums: 2 -> 1+11+5+22+1 = 40, 3 -> 51, 4 -> 45; median 45 vs predicted 40
    assert c.measured_step_ms == 45 and c.predicted_step_ms == 40
    assert c.measured_exposed_ms["h2d"] == 4
    assert c.predicted_exposed_ms == pytest.approx(2.0 + 0.0 + 8.0)
    assert (c.predicted_peak_checkpoint_bytes, c.measured_peak_checkpoint_bytes) == (300, 250)
    assert c.measured_peak_hbm_bytes is None  # recorded without the ledger
    assert [w.name for w in c.most_wrong()] == ["b0", "f0", "turn"]


def test_compare_skips_as_many_warm_up_steps_as_asked(tmp_path):
    plan = write_run(tmp_path)
    c = compare_with_run(plan, read_jsonl(tmp_path / "windows.jsonl"), skip_steps=3)
    assert c.steps_used == [4] and c.measured_step_ms == 2 + 12 + 4 + 26 + 1
    with pytest.raises(ValueError, match="skip-steps"):
        compare_with_run(plan, read_jsonl(tmp_path / "windows.jsonl"), skip_steps=4)


def test_records_of_another_plan_are_ignored_when_this_plan_has_records(tmp_path):
    plan = write_run(tmp_path)
    records = read_jsonl(tmp_path / "windows.jsonl")
    stale = dict(records[1], plan_id="0" * 16, step=9)
    stale["windows"] = [dict(w, wall_ms=1000.0) for w in stale["windows"]]
    c = compare_with_run(plan, records + [stale])
    assert c.steps_used == [2, 3, 4] and c.measured_step_ms == 45


def test_format_table_names_the_totals_and_the_most_wrong_window(tmp_path):
    plan = write_run(tmp_path)
    text = format_table(compare_with_run(plan, read_jsonl(tmp_path / "windows.jsonl")))
    assert "step time" in text and "peak HBM" in text
    assert "most wrong: b0 (+6.00 ms)" in text


def test_compare_reports_the_ledgers_peaks_owners_and_bytes_per_window(tmp_path):
    plan = plan_dict()
    plan["predicted"].update(peak_hbm_bytes=5000, dram_bytes=9000)
    plan["provenance"]["memory"] = {"states_bytes": 8000}
    plan["windows"][0]["h2d_bytes"] = 4096  # f0 loads 4096 bytes
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid = plan_id_of_dict(plan)
    with open(run_dir / "windows.jsonl", "w") as fh:
        for step, (hbm, pinned, moved) in {1: (4000, 900, 4096), 2: (4500, 1000, 4096)}.items():
            ws = []
            for n in ("pre", "f0", "turn", "b0", "post"):
                w = window(n, 1.0)
                w["ledger"] = {"hbm_bytes": hbm if n == "turn" else 10, "pinned_bytes": pinned,
                               "moved": dict(ZERO_BYTES, h2d=moved if n == "f0" else 0)}
                ws.append(w)
            fh.write(json.dumps({"step": step, "micro_batch": 0, "plan_id": pid, "windows": ws,
                                 "ledger_peak": {"window": "turn", "hbm_bytes": hbm,
                                                 "pinned_bytes": pinned,
                                                 "owners": {"kept graph of block 0": hbm}}})
                     + "\n")
    c = compare_with_run(plan, read_jsonl(run_dir / "windows.jsonl"), skip_steps=0)
    assert (c.predicted_peak_hbm_bytes, c.measured_peak_hbm_bytes) == (5000, 4500)
    assert (c.predicted_pinned_bytes, c.measured_pinned_bytes) == (1000, 1000)  # 9000 - 8000
    assert c.peak_window == "turn" and c.peak_owners == {"kept graph of block 0": 4500}
    rows = {w.name: w for w in c.windows}
    assert rows["f0"].predicted_bytes["h2d"] == 4096 and rows["f0"].measured_bytes["h2d"] == 4096
    assert rows["turn"].measured_ledger_hbm_bytes == 4500
    d = c.to_dict()
    assert {"predicted_peak_hbm_bytes", "measured_peak_hbm_bytes", "predicted_pinned_bytes",
            "measured_pinned_bytes", "predicted_peak_checkpoint_bytes",
            "measured_peak_checkpoint_bytes"} <= set(d)
    assert "largest at the HBM peak (turn): kept graph of block 0 0.00 MB" in format_table(c)


def test_report_shows_host_blocked_time_apart_from_compute_and_waits(tmp_path):
    # f0 blocked 1, 3, 2 ms in steps 2-4 (median 2); every other window 0.5 (4 of them):
    # step sums 3, 5, 4 -> median 4. Old files (no field) report None, no line.
    plan = write_run(tmp_path)
    records = read_jsonl(tmp_path / "windows.jsonl")
    assert compare_with_run(plan, records).measured_host_blocked_ms is None
    blocked_f0 = {1: 9.0, 2: 1.0, 3: 3.0, 4: 2.0}
    for r in records:
        r["windows"] = [dict(w, host_blocked_ms=blocked_f0[r["step"]] if w["name"] == "f0"
                             else 0.5) for w in r["windows"]]
    c = compare_with_run(plan, records)
    rows = {w.name: w for w in c.windows}
    assert rows["f0"].measured_host_blocked_ms == 2.0
    assert rows["b0"].measured_host_blocked_ms == 0.5
    assert c.measured_host_blocked_ms == pytest.approx(4.0)
    text = format_table(c)
    assert "host-blocked   measured      4.00 ms" in text
    assert "host-blocked 2.00" in text.splitlines()[3]  # the f0 row (header, column, pre)
    assert c.to_dict()["windows"][1]["measured_host_blocked_ms"] == 2.0
