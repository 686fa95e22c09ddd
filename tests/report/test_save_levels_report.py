"""Save levels in the reports: the level/tier counts and saved bytes of the plan table and
summary, the internals' own colours in the simulated Gantt chart, and `lazytrain report`'s
measured vs predicted internals bytes (hand-written plans and windows.jsonl records)."""

from __future__ import annotations

import pytest

from lazytrain.planner.plan import InternalTransfer, Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.report.gantt import KIND_COLORS, KIND_LABELS, bars_from_events
from lazytrain.report.plan_table import (compact_pairs, plan_summary, save_level_line,
                                         save_level_lines)
from lazytrain.report.tables import compare_with_run, format_table, predicted_saved_bytes
from lazytrain.sim import simulate

MB = 10**6


def _problem(L: int = 4) -> PlanningProblem:
    """S1/S2 = 100/400 MB except block 2's 200/500 MB; 1 MB per ms links."""
    return PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.5,) * L, bwd_ms=(2.0,) * L,
        reforward_ms=(1.2,) * L, reforward_l1_ms=(0.5,) * L,
        saved_bytes=tuple((200 * MB, 500 * MB) if j == 2 else (100 * MB, 400 * MB)
                          for j in range(L)),
        weight_bytes=(MB,) * L, grad_bytes=(MB,) * L, internal_bytes=(0,) * L,
        boundary_bytes=(MB,) * (L + 1), params_per_block=(10,) * L, embed_ms=0.5, head_ms=1.0,
        h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=2e9,
        nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9, hbm_bytes=10**13,
        dram_bytes=10**13, nvme_bytes=10**13)


def _levels_plan() -> Plan:
    # block 0 L0; block 1 L2 dram (d2h f2, h2d b2); block 2 L1 hbm; block 3 L2 hbm
    moves = (InternalTransfer(block=1, kind="d2h", window="f2", fraction=1.0),
             InternalTransfer(block=1, kind="h2d", window="b2", fraction=1.0))
    return Plan(tiers=("hbm",) * 5, save_levels=("L0", "L2", "L1", "L2"),
                saved_tiers=("none", "dram", "hbm", "hbm"), internal_transfers=moves)


def test_the_level_line_counts_blocks_per_level_and_tier():
    assert save_level_line(_levels_plan()) == "save levels: L0 1, L1 hbm 1, L2 hbm 1, L2 dram 1"
    assert save_level_line(Plan(tiers=("hbm",) * 3)) == \
        "save levels: none (every block re-forwarded in full)"
    # a kept block is L0 in the plan (tier none) but keeps its whole graph: counted apart
    kept = Plan(tiers=("hbm",) * 4, keep_internals=(2,), save_levels=("L0", "L2", "L0"),
                saved_tiers=("none", "hbm", "none"))
    assert save_level_line(kept) == "save levels: L0 1, kept 1, L2 hbm 1"


def test_the_table_lists_each_level_s_blocks_their_bytes_and_the_bytes_per_block():
    lines = save_level_lines(_problem(), _levels_plan())
    assert lines == [
        "save levels: L0 1, L1 hbm 1, L2 hbm 1, L2 dram 1",
        "  L1 hbm    2  1 block, 0.20 GB",      # S1[2] = 200 MB
        "  L2 hbm    3  1 block, 0.40 GB",      # S2[3]
        "  L2 dram   1  1 block, 0.40 GB",      # S2[1]
        "saved bytes per block (S1 / S2): 100 / 400 MB 3 blocks 0-1,3; 200 / 500 MB 1 block 2",
    ]


def test_compact_pairs_lists_each_distinct_size_once_with_its_blocks():
    assert compact_pairs([(MB, 2 * MB)] * 3) == "1 / 2 MB 3 blocks 0-2"
    assert compact_pairs([(1.23456 * MB, 2 * MB), (1.2349 * MB, 2 * MB), (3 * MB, 4 * MB)]) \
        == "1.23 / 2 MB 2 blocks 0-1; 3 / 4 MB 1 block 2"
    # a 3:1 hybrid of 20 blocks in GB: the ranges of the common size cut after four
    hybrid = [(4 * 10**9, 6 * 10**9) if j % 4 != 3 else (10**9, 2 * 10**9) for j in range(20)]
    assert compact_pairs(hybrid) == ("4 / 6 GB 15 blocks 0-2,4-6,8-10,12-14,...; "
                                     "1 / 2 GB 5 blocks 3,7,11,15,...")


def test_the_summary_carries_the_level_line():
    text = plan_summary(_levels_plan())
    assert "  save levels: L0 1, L1 hbm 1, L2 hbm 1, L2 dram 1" in text.splitlines()


def test_the_simulated_gantt_draws_the_internals_in_their_own_colour():
    bars = bars_from_events(simulate(_problem(), _levels_plan()).events)
    saved = {(b.row, b.kind) for b in bars if b.kind.startswith("saved")}
    assert saved == {("d2h", "saved_d2h"), ("h2d", "saved_h2d")}
    # 400 MB at 1 GB/s: 400 ms on the D2H row
    d2h = next(b for b in bars if b.kind == "saved_d2h")
    assert d2h.end_ms - d2h.start_ms == pytest.approx(400.0)
    assert {"saved_d2h", "saved_h2d"} <= set(KIND_COLORS) and set(KIND_LABELS) == \
        set(KIND_COLORS)


# --- lazytrain report: measured vs predicted internals bytes ----------------------------------

NAMES = ("pre", "f0", "f1", "turn", "b1", "b0", "post")


def _plan_dict(*, sizes=True) -> dict:
    """Two blocks: block 0 L2 dram, d2h half in f1 and half in turn, h2d in b1; block 1 L1 hbm.
    S2[0] = 4 MB: predicted f1 2 MB D2H, turn 2 MB D2H, b1 4 MB H2D."""
    def win(name):
        return {"name": name, "compute_ms": 1.0, "h2d_bytes": 0, "d2h_bytes": 0,
                "nvme_read_bytes": 0, "nvme_write_bytes": 0, "time_ms": 1.0,
                "exposed_ms": 0.0, "hbm_checkpoint_bytes": 0}
    prov = {"grad_accum": 1, **({"saved_bytes": [[MB, 4 * MB], [MB // 2, 2 * MB]]}
                                if sizes else {})}
    return {"version": 1, "provenance": prov,
            "boundaries": [{"index": i, "tier": "hbm"} for i in range(3)],
            "save_levels": ["L2", "L1"], "saved_tiers": ["dram", "hbm"],
            "internal_transfers": [
                {"block": 0, "kind": "d2h", "window": "f1", "fraction": 0.5},
                {"block": 0, "kind": "d2h", "window": "turn", "fraction": 0.5},
                {"block": 0, "kind": "h2d", "window": "b1", "fraction": 1.0}],
            "windows": [win(n) for n in NAMES[1:-1]], "transfers": [],
            "predicted": {"step_ms": 5.0, "model_tflops": 0, "hardware_tflops": 0,
                          "tokens_per_s": 0, "peak_hbm_bytes": 0, "dram_bytes": 0,
                          "nvme_bytes": 0}}


# measured bytes per step (steps 2..4 after the warm-up step 1): (f1 d2h, turn d2h, b1 h2d)
MEASURED = {1: (0, 0, 0), 2: (2 * MB, 2 * MB, 4 * MB), 3: (2 * MB, 3 * MB, 5 * MB),
            4: (2 * MB, 1 * MB, 3 * MB)}


def _records(plan: dict, *, with_keys=True) -> list[dict]:
    from lazytrain.report.tables import plan_id_of_dict
    out = []
    for step, (f1, turn, b1) in MEASURED.items():
        ws = []
        for n in NAMES:
            w = {"name": n, "wall_ms": 1.0, "compute_ms": 1.0,
                 "wait_ms": {"h2d": 0.0, "d2h": 0.0, "nvme_read": 0.0, "nvme_write": 0.0,
                             "optimizer": 0.0},
                 "peak_bytes": {"hbm": 0, "dram": 0, "nvme": 0}}
            if with_keys:
                w["saved_d2h_bytes"] = {"f1": f1, "turn": turn}.get(n, 0)
                w["saved_h2d_bytes"] = b1 if n == "b1" else 0
            ws.append(w)
        out.append({"step": step, "micro_batch": 0, "plan_id": plan_id_of_dict(plan),
                    "windows": ws})
    return out


def test_predicted_internals_bytes_are_the_fractions_of_each_block_s_level_size():
    assert predicted_saved_bytes(_plan_dict()) == {
        "f1": {"d2h": 2 * MB, "h2d": 0.0}, "turn": {"d2h": 2 * MB, "h2d": 0.0},
        "b1": {"d2h": 0.0, "h2d": 4 * MB}}
    assert predicted_saved_bytes(_plan_dict(sizes=False)) is None  # sizes unknown
    assert predicted_saved_bytes({"windows": []}) == {}              # no internals


def test_report_gives_measured_medians_beside_the_predicted_internals_bytes():
    plan = _plan_dict()
    c = compare_with_run(plan, _records(plan))
    rows = {w.name: w for w in c.windows}
    # medians over steps 2-4: turn d2h (2, 3, 1) -> 2 MB; b1 h2d (4, 5, 3) -> 4 MB
    assert rows["turn"].measured_saved_bytes == {"d2h": 2 * MB, "h2d": 0}
    assert rows["b1"].measured_saved_bytes == {"d2h": 0, "h2d": 4 * MB}
    assert rows["b1"].predicted_saved_bytes == {"d2h": 0.0, "h2d": 4 * MB}
    assert rows["b0"].predicted_saved_bytes == {"d2h": 0.0, "h2d": 0.0}
    assert c.saved_totals("predicted") == {"d2h": 4 * MB, "h2d": 4 * MB}
    assert c.saved_totals("measured") == {"d2h": 4 * MB, "h2d": 4 * MB}
    text = format_table(c)
    assert ("saved internals (MB per micro-batch, predicted / measured): D2H 4.000 / 4.000, "
            "H2D 4.000 / 4.000") in text
    assert "  b1      D2H 0.000 / 0.000, H2D 4.000 / 4.000" in text
    assert c.to_dict()["measured_saved_bytes"] == {"d2h": 4 * MB, "h2d": 4 * MB}


def test_report_without_recorded_internals_prints_no_internals_line():
    plan = _plan_dict()
    c = compare_with_run(plan, _records(plan, with_keys=False))
    assert c.saved_totals("measured") is None and "saved internals" not in format_table(c)
    # recorded, but the plan's sizes unknown: measured beside "-"
    plan = _plan_dict(sizes=False)
    text = format_table(compare_with_run(plan, _records(plan)))
    assert "D2H - / 4.000, H2D - / 4.000" in text


def test_a_built_plan_that_moves_internals_carries_the_sizes_the_report_prices_them_with():
    from lazytrain.planner.evaluate import Decisions, build_plan
    from lazytrain.planner.plan import SolveRecord
    lv = _levels_plan()
    d = Decisions(tiers=lv.tiers, save_levels=lv.save_levels, saved_tiers=lv.saved_tiers,
                  internal_transfers=lv.internal_transfers)
    plan = build_plan(_problem(), d, solver=SolveRecord(backend="manual"))
    # block 1 at L2 in dram: S2[1] = 400 MB out in f2, back in b2
    assert predicted_saved_bytes(plan.to_dict()) == {"f2": {"d2h": 400 * MB, "h2d": 0.0},
                                                     "b2": {"d2h": 0.0, "h2d": 400 * MB}}
    # a plan moving none carries no sizes (its JSON, and digest, as before the field)
    d = Decisions(tiers=lv.tiers, save_levels=("L0", "L0", "L1", "L2"),
                  saved_tiers=("none", "none", "hbm", "hbm"))
    assert "saved_bytes" not in build_plan(_problem(), d,
                                           solver=SolveRecord(backend="manual")).provenance
