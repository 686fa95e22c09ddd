"""Plan JSON v1: window naming, legal windows, JSON round trip, atomic save, validate()."""

from __future__ import annotations

import json

import pytest

from lazytrain.planner.plan import (
    Bounds, Plan, PlanValidationError, Predicted, SolveRecord, Transfer, WindowRecord,
)
from lazytrain.planner.windows import legal_ords, window_name, window_names, window_ord

L = 3
HORIZONS = {"drain_windows": 2, "prefetch_windows": 2, "nvme_lead_windows": 1}


def _windows(num_blocks: int = L) -> tuple[WindowRecord, ...]:
    return tuple(WindowRecord(name=n, compute_ms=1.0, h2d_bytes=0.0, d2h_bytes=0.0,
                              nvme_read_bytes=0.0, nvme_write_bytes=0.0, time_ms=1.0,
                              exposed_ms=0.0, hbm_checkpoint_bytes=0.0)
                 for n in window_names(num_blocks))


def _t(boundary, kind, window, fraction=1.0):
    return Transfer(boundary=boundary, kind=kind, window=window, fraction=fraction)


def _plan(tiers=("nvme", "dram", "recompute", "hbm"), transfers=None, **kw) -> Plan:
    """L=3: boundary 0 nvme (segment (0,1), used in b0, ord 6), boundary 1 dram (segment (1,3),
    used in b2, ord 4), boundary 2 recomputed, boundary 3 hbm."""
    if transfers is None:
        transfers = (
            _t(0, "d2h", "f0"), _t(0, "nvme_write", "f0", 0.5), _t(0, "nvme_write", "f1", 0.5),
            _t(0, "nvme_read", "b2"), _t(0, "h2d", "b1"),
            _t(1, "d2h", "f1"), _t(1, "h2d", "turn"),
        )
    base = dict(provenance={"model": "tiny", "seq_len": 8, "micro_batch": 2,
                            "model_config_sha256": "abc", "horizons": dict(HORIZONS)},
                tiers=tuple(tiers), windows=_windows(len(tiers) - 1), transfers=tuple(transfers),
                predicted=Predicted(step_ms=7.0, model_tflops=1.0, hardware_tflops=1.5,
                                    tokens_per_s=2.0, peak_hbm_bytes=10.0, dram_bytes=3.0,
                                    nvme_bytes=1.0),
                solver=SolveRecord(backend="manual", status="ok", solve_s=0.0, gap=None),
                bounds=Bounds(lp_step_ms=6.5))
    base.update(kw)
    return Plan(**base)


def test_window_names_follow_execution_order():
    assert window_names(3) == ["f0", "f1", "f2", "turn", "b2", "b1", "b0"]


@pytest.mark.parametrize("name,ord_", [("f0", 0), ("f2", 2), ("turn", 3), ("b2", 4), ("b0", 6)])
def test_window_ord_and_name_are_inverse(name, ord_):
    assert window_ord(name, 3) == ord_
    assert window_name(ord_, 3) == name


@pytest.mark.parametrize("bad", ["f3", "b3", "x1", "f01", "", "turn2"])
def test_window_ord_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match="unknown window"):
        window_ord(bad, 3)


def test_legal_ords_follow_the_contract_table():
    # L=8, boundary 2 in segment (2, 5): use = 2*8 - 5 + 1 = 12 (window b4).
    kw = dict(drain_windows=2, prefetch_windows=3, nvme_lead_windows=1)
    assert legal_ords("d2h", 2, 5, 8, **kw) == range(2, 4)          # 2 <= ord <= 2+2-1
    assert legal_ords("nvme_write", 2, 5, 8, **kw) == range(2, 5)   # 2 <= ord <= 2+2+1-1
    assert legal_ords("nvme_read", 2, 5, 8, **kw) == range(8, 12)   # 12-3-1 <= ord <= 11
    assert legal_ords("h2d", 2, 5, 8, **kw) == range(9, 12)         # 12-3 <= ord <= 11


def test_legal_ords_without_horizons_keep_only_the_order():
    none = dict(drain_windows=None, prefetch_windows=None, nvme_lead_windows=None)
    for kind in ("d2h", "nvme_write", "nvme_read", "h2d"):
        assert legal_ords(kind, 2, 5, 8, **none) == range(2, 12)


def test_a_consistent_plan_validates():
    plan = _plan()
    assert plan.validate() is plan
    assert plan.segments() == [(0, 1), (1, 3)]
    assert plan.segments_backward() == [(1, 3), (0, 1)]
    assert plan.segment_end_of(2) == 3
    assert [t.kind for t in plan.transfers_in("f0")] == ["d2h", "nvme_write"]


def test_plan_json_round_trip_is_exact(tmp_path):
    plan = _plan(keep_internals=(2,), resident_weights=(2,), q8_blocks=(0,))
    plan.validate()
    path = plan.save(tmp_path / "sub" / "plan.json")
    assert Plan.load(path) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temp file left behind


def test_plan_json_has_the_normative_keys():
    d = _plan().to_dict()
    assert list(d) == ["version", "provenance", "boundaries", "keep_internals",
                       "resident_weights", "q8_blocks", "windows", "transfers", "predicted",
                       "solver", "bounds"]
    assert d["boundaries"][1] == {"index": 1, "tier": "dram"}
    assert set(d["windows"][0]) == {"name", "compute_ms", "h2d_bytes", "d2h_bytes",
                                    "nvme_read_bytes", "nvme_write_bytes", "time_ms",
                                    "exposed_ms", "hbm_checkpoint_bytes"}
    assert set(d["bounds"]) == {"lp_step_ms", "memory_step_ms", "roofline_step_ms",
                                "ideal_step_ms"}


def test_plan_without_resident_weights_key_defaults_to_keep_internals():
    d = _plan(keep_internals=(2,), resident_weights=(2,)).to_dict()
    del d["resident_weights"]
    assert Plan.from_dict(d).resident_weights == (2,)


def test_validate_catches_a_read_of_an_unwritten_checkpoint():
    # boundary 0: half the NVMe write runs in f1, the other half in b2, but the whole read runs
    # in f2: at the end of f2 cum nvme_read = 1.0 > cum nvme_write = 0.5.
    transfers = (
        _t(0, "d2h", "f0"), _t(0, "nvme_write", "f1", 0.5), _t(0, "nvme_write", "b2", 0.5),
        _t(0, "nvme_read", "f2"), _t(0, "h2d", "b1"),
        _t(1, "d2h", "f1"), _t(1, "h2d", "turn"),
    )
    # nvme_read legal from use-H_p-H_n = 6-2-1 = 3 (turn); pass no horizons to reach f2.
    plan = _plan(transfers=transfers, provenance={})
    with pytest.raises(PlanValidationError,
                       match=r"boundary 0: nvme_read in window f2 reads 1.00 of the checkpoint "
                             r"but only 0.50 has been written by then"):
        plan.validate()


def test_validate_catches_a_prefetch_before_the_drain():
    transfers = (_t(1, "d2h", "turn"), _t(1, "h2d", "f2"))
    plan = _plan(tiers=("recompute", "dram", "recompute", "hbm"), transfers=transfers,
                 provenance={})
    with pytest.raises(PlanValidationError, match=r"boundary 1: h2d in window f2 sends 1.00"):
        plan.validate()


def _replace_transfer(index, new):
    base = list(_plan().transfers)
    base[index] = new
    return tuple(base)


@pytest.mark.parametrize("case,kw,pattern", [
    ("wrong version", dict(version=2), r"version 2 is not supported"),
    ("unknown tier", dict(tiers=("gpu", "dram", "recompute", "hbm")), r"boundary 0: tier 'gpu'"),
    ("last boundary not hbm", dict(tiers=("nvme", "dram", "recompute", "dram")),
     r"boundary 3: the last boundary"),
    ("transfer for an hbm boundary", dict(transfers=_plan().transfers + (_t(3, "d2h", "f2"),)),
     r"boundary 3: d2h in window f2 but the boundary's tier is hbm"),
    ("nvme transfer for a dram boundary",
     dict(transfers=_plan().transfers + (_t(1, "nvme_write", "f1"),)),
     r"boundary 1: nvme_write in window f1 but the boundary's tier is dram"),
    ("d2h after the drain horizon", dict(transfers=_replace_transfer(5, _t(1, "d2h", "turn"))),
     r"boundary 1: d2h in window turn is outside its legal windows \(f1..f2"),
    ("h2d in its consumer's window", dict(transfers=_replace_transfer(6, _t(1, "h2d", "b2"))),
     r"boundary 1: h2d in window b2 is outside its legal windows"),
    ("fractions not summing to one",
     dict(transfers=_replace_transfer(5, _t(1, "d2h", "f1", 0.6))),
     r"boundary 1: d2h fractions of this dram checkpoint sum to 0.600000"),
    ("missing transfers for an offloaded boundary", dict(transfers=_plan().transfers[:5]),
     r"boundary 1: d2h fractions .* sum to 0.000000"),
    ("keep without resident weights", dict(keep_internals=(2,)),
     r"block 2: keep_internals without resident weights"),
    ("keep with the next boundary recomputed", dict(keep_internals=(1,), resident_weights=(1,)),
     r"block 1: keep_internals needs boundary 2 materialized"),
    ("segment longer than k_max",
     dict(provenance={"horizons": dict(HORIZONS), "k_max": 1}),
     r"segment \(1, 3\) spans 2 blocks > k_max=1"),
    ("windows out of order", dict(windows=_windows()[::-1]), r"position 0 holds 'b0'"),
    ("windows missing", dict(windows=_windows()[:-1]), r"position 6 holds '<missing>'"),
])
def test_validate_rejects(case, kw, pattern):
    with pytest.raises(PlanValidationError, match=pattern):
        _plan(**kw).validate()


def test_check_matches_refuses_another_sequence_length():
    plan = _plan()
    plan.check_matches(model_config_sha256="abc", seq_len=8, micro_batch=2)
    with pytest.raises(PlanValidationError, match=r"seq_len=8 .* seq_len=16"):
        plan.check_matches(seq_len=16)


def test_plan_module_imports_no_solver_or_torch():
    import subprocess
    import sys
    code = ("import sys, lazytrain.planner.plan; "
            "bad=[m for m in ('torch','pyscipopt','highspy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _window_with(name: str, **kw) -> tuple[WindowRecord, ...]:
    import dataclasses
    return tuple(dataclasses.replace(w, **kw) if w.name == name else w for w in _windows())


@pytest.mark.parametrize("case,kw,pattern", [
    ("nan checkpoint bytes", dict(windows=_window_with("b1", hbm_checkpoint_bytes=float("nan"))),
     r"window b1: hbm_checkpoint_bytes must be a finite number >= 0; got nan"),
    ("negative checkpoint bytes", dict(windows=_window_with("f0", hbm_checkpoint_bytes=-1)),
     r"window f0: hbm_checkpoint_bytes must be a finite number >= 0; got -1"),
    ("infinite time", dict(windows=_window_with("turn", time_ms=float("inf"))),
     r"window turn: time_ms must be a finite number >= 0; got inf"),
    ("negative bytes", dict(windows=_window_with("f2", h2d_bytes=-5.0)),
     r"window f2: h2d_bytes must be a finite number >= 0"),
    ("string bytes", dict(windows=_window_with("f1", d2h_bytes="5")),
     r"window f1: d2h_bytes must be a finite number >= 0; got '5'"),
    ("nan predicted step", dict(predicted=Predicted(
        step_ms=float("nan"), model_tflops=1.0, hardware_tflops=1.5, tokens_per_s=2.0,
        peak_hbm_bytes=10.0, dram_bytes=3.0, nvme_bytes=1.0)),
     r"predicted: step_ms must be a finite number >= 0; got nan"),
    ("negative predicted peak", dict(predicted=Predicted(
        step_ms=7.0, model_tflops=1.0, hardware_tflops=1.5, tokens_per_s=2.0,
        peak_hbm_bytes=-10.0, dram_bytes=3.0, nvme_bytes=1.0)),
     r"predicted: peak_hbm_bytes must be a finite number >= 0"),
    ("k_max as a string", dict(provenance={"horizons": dict(HORIZONS), "k_max": "2"}),
     r"provenance k_max must be an integer >= 1 \(or null\); got '2'"),
    ("horizon as a string", dict(provenance={"horizons": dict(HORIZONS, drain_windows="2")}),
     r"provenance horizons drain_windows must be an integer >= 1 \(or null\); got '2'"),
    ("horizons as a list", dict(provenance={"horizons": [2, 2, 1]}),
     r"provenance horizons must be an object; got \[2, 2, 1\]"),
])
def test_validate_rejects_bad_numbers_and_provenance_types(case, kw, pattern):
    with pytest.raises(PlanValidationError, match=pattern):
        _plan(**kw).validate()


@pytest.mark.parametrize("case,edit,pattern", [
    ("float keep index", lambda d: d.update(keep_internals=[2.7], resident_weights=[2]),
     r"keep_internals must be an integer; got 2.7 \(float\)"),
    ("float resident index", lambda d: d.update(resident_weights=[2.2]),
     r"resident_weights must be an integer; got 2.2"),
    ("float transfer boundary", lambda d: d["transfers"][0].update(boundary=0.9),
     r"transfer boundary must be an integer; got 0.9"),
    ("bool version", lambda d: d.update(version=True),
     r"version must be an integer; got True \(bool\)"),
    ("string version", lambda d: d.update(version="1"), r"version must be an integer; got '1'"),
    ("provenance as a list", lambda d: d.update(provenance=[["k_max", 1]]),
     r"plan provenance must be a JSON object; got list"),
])
def test_from_dict_rejects_non_integer_indices_and_versions_instead_of_truncating(case, edit,
                                                                                   pattern):
    d = json.loads(_plan().to_json())
    edit(d)
    with pytest.raises(PlanValidationError, match=pattern):
        Plan.from_dict(d)


def test_loading_a_missing_or_non_plan_file_names_the_path(tmp_path):
    import pytest as _pytest

    from lazytrain.planner.plan import Plan, PlanValidationError

    with _pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        Plan.load(tmp_path / "nope.json")
    text = tmp_path / "notes.md"
    text.write_text("# not json\n")
    with _pytest.raises(PlanValidationError, match="notes.md is not a plan JSON file"):
        Plan.load(text)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with _pytest.raises(PlanValidationError, match="list.json is not a plan JSON object"):
        Plan.load(listed)
