"""Plan JSON v1's save-level fields: old plans (written without them) load, keep their digest
and price with the full re-forward; new plans round-trip; `Plan.validate` refuses every
broken rule of docs/execution_model.md "Save levels" with a message naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazytrain.planner.evaluate import Decisions, build_plan, evaluate
from lazytrain.planner.plan import InternalTransfer, Plan, SolveRecord, plan_digest
from lazytrain.planner.plan_checks import PlanValidationError
from lazytrain.planner.windows import internal_legal_ords
from test_save_levels_evaluate import H, _mixed, _problem

OLD_KEYS = {"version", "provenance", "boundaries", "keep_internals", "resident_weights",
            "q8_blocks", "windows", "transfers", "predicted", "solver", "bounds"}


def _old_plan_dict() -> dict:
    """A plan as written before save levels: made on a problem without re-forward data, so
    no field of the extension is written."""
    bare = _problem(reforward_ms=(), reforward_l1_ms=(), saved_bytes=())
    return build_plan(bare, Decisions(tiers=(H,) * 4),
                      solver=SolveRecord(backend="manual")).to_dict()


def test_an_old_plan_writes_no_new_key_and_round_trips_with_its_digest():
    d = json.loads(json.dumps(_old_plan_dict()))
    assert set(d) == OLD_KEYS
    assert all("hbm_saved_bytes" not in w for w in d["windows"])
    plan = Plan.from_dict(d).validate()
    assert plan.save_levels == () and plan.saved_tiers == () and plan.internal_transfers == ()
    assert all(w.hbm_saved_bytes == 0.0 for w in plan.windows)
    assert plan.to_dict() == d
    assert plan.digest() == plan_digest(d)


def test_an_old_plan_prices_every_block_with_the_full_re_forward():
    plan = Plan.from_dict(_old_plan_dict())
    assert plan.reforwards_in_full and plan.level_of(1) == "L0"
    ev = evaluate(_problem(), plan)  # the problem now has Fr = 9 and levels
    # b{j} = B + Fg = 20 + 12 (not B + Fr = 29); step 10 + 10 + 10 + 15 + 3 x 32 + 20
    assert [w.compute_ms for w in ev.windows[4:]] == pytest.approx([32.0] * 3)
    assert ev.step_ms == pytest.approx(161.0)


def test_a_plan_with_levels_round_trips_its_fields_and_digest():
    plan = build_plan(_problem(), _mixed(), solver=SolveRecord(backend="manual"))
    d = json.loads(plan.to_json())
    assert d["save_levels"] == ["L1", "L2", "L0"]
    assert d["saved_tiers"] == ["hbm", "dram", "none"]
    assert d["internal_transfers"] == [
        {"block": 1, "kind": "d2h", "window": "f2", "fraction": 1.0},
        {"block": 1, "kind": "h2d", "window": "b2", "fraction": 1.0}]
    assert d["windows"][2]["hbm_saved_bytes"] == pytest.approx(5e8)
    back = Plan.from_dict(d).validate()
    assert back == plan and back.digest() == plan.digest()
    assert back.level_of(0) == "L1" and back.saved_tier_of(1) == "dram"
    assert back.saved_blocks() == [0, 1] and not back.reforwards_in_full
    assert [t.kind for t in back.internal_transfers_in("b2")] == ["h2d"]
    assert len(back.internal_transfers_of(1)) == 2 and back.internal_transfers_of(0) == []


def test_the_dram_tier_legal_windows_by_hand():
    # L = 3, block 1: d2h in j + 1 = 2 .. min(j + H_d, 2L - j - 1 = 4); h2d in
    # 2L - j - H_p .. 4 (at least j + 1 = 2)
    assert list(internal_legal_ords("d2h", 1, 3, drain_windows=4, prefetch_windows=4)) == [2, 3, 4]
    assert list(internal_legal_ords("d2h", 1, 3, drain_windows=1, prefetch_windows=1)) == [2]
    assert list(internal_legal_ords("h2d", 1, 3, drain_windows=1, prefetch_windows=1)) == [4]
    assert list(internal_legal_ords("h2d", 1, 3, drain_windows=None,
                                    prefetch_windows=None)) == [2, 3, 4]
    # block L - 1 = 2: d2h only in the turn (ord 3), h2d at most in the turn: no pair
    assert list(internal_legal_ords("d2h", 2, 3, drain_windows=4, prefetch_windows=4)) == [3]
    assert list(internal_legal_ords("h2d", 2, 3, drain_windows=4, prefetch_windows=4)) == [3]


def _good() -> Plan:
    return build_plan(_problem(), _mixed(), solver=SolveRecord(backend="manual"))


def _moves(*spec) -> tuple[InternalTransfer, ...]:
    return tuple(InternalTransfer(block=b, kind=k, window=w, fraction=x) for b, k, w, x in spec)


GOOD_MOVES = ((1, "d2h", "f2", 1.0), (1, "h2d", "b2", 1.0))

BROKEN = {
    "levels of the wrong length": (
        dict(save_levels=("L1", "L2")), "save_levels: give one of"),
    "an unknown level": (
        dict(save_levels=("L1", "L3", "L0")), "save_levels: block 1 has 'L3'"),
    "tiers without levels": (
        dict(save_levels=(), internal_transfers=()), "saved_tiers / internal_transfers given"),
    "an unknown tier": (
        dict(saved_tiers=("hbm", "nvme", "none")), "saved_tiers: block 1 has 'nvme'"),
    "a kept block at L2": (
        dict(keep_internals=(2,), resident_weights=(2,), save_levels=("L1", "L2", "L2"),
             saved_tiers=("hbm", "dram", "hbm")), "block 2: kept"),
    "L0 with a tier": (
        dict(saved_tiers=("hbm", "dram", "hbm")), "block 2: save_levels 'L0' saves nothing"),
    "L1 without a tier": (
        dict(saved_tiers=("none", "dram", "none")), "block 0: save_levels 'L1' needs"),
    "a transfer of an hbm block": (
        dict(internal_transfers=_moves(*GOOD_MOVES, (0, "d2h", "f1", 1.0))),
        "block 0 d2h in window f1, but the block's saved_tiers is 'hbm'"),
    "a d2h in the forward that saves": (
        dict(internal_transfers=_moves((1, "d2h", "f1", 1.0), (1, "h2d", "b2", 1.0))),
        r"outside its legal windows \(f2..b2\)"),
    "an h2d in the window that reads": (
        dict(internal_transfers=_moves((1, "d2h", "f2", 1.0), (1, "h2d", "b1", 1.0))),
        r"h2d in window b1 is outside its legal windows \(f2..b2\)"),
    "a d2h that moves half": (
        dict(internal_transfers=_moves((1, "d2h", "f2", 0.5), (1, "h2d", "b2", 1.0))),
        "block 1's d2h fractions sum to 0.500000"),
    "an h2d in the d2h's window": (
        dict(internal_transfers=_moves((1, "d2h", "turn", 1.0), (1, "h2d", "turn", 1.0))),
        "block 1's h2d in window turn is not after its d2h in window turn"),
    "an NVMe kind": (
        dict(internal_transfers=_moves(*GOOD_MOVES, (1, "nvme_write", "turn", 1.0))),
        "kind must be one of"),
    "a zero fraction": (
        dict(internal_transfers=_moves(*GOOD_MOVES, (1, "d2h", "turn", 0.0))),
        "has fraction 0.0"),
    "an unknown window": (
        dict(internal_transfers=_moves((1, "d2h", "f9", 1.0), (1, "h2d", "b2", 1.0))),
        "unknown window 'f9'"),
    "a dram tier with no transfers": (
        dict(internal_transfers=()), "block 1's d2h fractions sum to 0.000000"),
}


@pytest.mark.parametrize("change, message", BROKEN.values(), ids=BROKEN.keys())
def test_validation_names_the_broken_save_level_rule(change, message):
    _good().validate()
    with pytest.raises(PlanValidationError, match=message):
        dataclasses.replace(_good(), **change).validate()


def test_the_last_block_cannot_take_the_dram_tier():
    # block 2 = L - 1: its only legal d2h window is the turn and no h2d comes after it
    bad = dataclasses.replace(
        _good(), save_levels=("L1", "L2", "L2"), saved_tiers=("hbm", "dram", "dram"),
        internal_transfers=_moves(*GOOD_MOVES, (2, "d2h", "turn", 1.0), (2, "h2d", "turn", 1.0)))
    with pytest.raises(PlanValidationError, match="block 2's h2d in window turn is not after"):
        bad.validate()
