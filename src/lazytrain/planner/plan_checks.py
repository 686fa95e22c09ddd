"""The checks of `Plan.validate()`: a plan against the contract of docs/execution_model.md
(provenance types, structure, finite figures, legal transfer windows, fractions summing to 1,
cumulative precedence, save levels and their internals' tiers and transfers), one concern per
function; every message names the field, boundary or block, and window.

Reads a `Plan` through its fields only; knows no solver and no torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict
from typing import TYPE_CHECKING

from lazytrain.contract import WEIGHT_PATH_NAMES
from lazytrain.errors import UserError
from lazytrain.planner.windows import (
    INTERNAL_TRANSFER_KINDS, OFFLOAD_TIERS, SAVE_LEVELS, SAVED_TIERS, TIERS, TRANSFER_KINDS,
    internal_legal_ords, legal_ords, window_name, window_names, window_ord,
)

if TYPE_CHECKING:
    from lazytrain.planner.plan import Plan

PLAN_VERSION = 1
"""The Plan JSON version this code reads and writes (extended, never renamed)."""
FRACTION_TOL = 1e-6
"""Tolerance on sums and cumulative comparisons of transfer fractions (dimensionless)."""


class PlanValidationError(UserError, ValueError):
    """A plan breaks the execution-model contract; the message names boundary and window."""


def check_plan(plan: Plan) -> None:
    """Every check of `Plan.validate()`, in order: provenance, structure, numbers, transfers,
    save levels (with their internals' transfers).

    Raises:
        PlanValidationError: naming the boundary and window of the first inconsistency.
    """
    _check_provenance(plan)
    _check_structure(plan)
    _check_numbers(plan)
    _check_transfers(plan)
    _check_save_levels(plan)
    _check_internal_transfers(plan)


def _fail(msg: str) -> None:
    raise PlanValidationError(msg)


def as_int(value, what: str) -> int:
    """`value` if it is an int (not a bool), else PlanValidationError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(f"{what} must be an integer; got {value!r} ({type(value).__name__})")
    return int(value)


def _is_count(value, minimum: int) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral)
            and value >= minimum)


def _check_provenance(plan: Plan) -> None:
    """Types of the provenance fields validation reads: k_max int >= 1, horizons an object of
    ints (drain, prefetch >= 1; nvme lead >= 0) or nulls (unlimited)."""
    prov = plan.provenance
    if not isinstance(prov, dict):
        _fail(f"plan provenance must be an object; got {type(prov).__name__}")
    horizons = prov.get("horizons")
    if horizons is not None and not isinstance(horizons, dict):
        _fail(f"provenance horizons must be an object; got {horizons!r}")
    horizons = horizons or {}
    for where, key, minimum in (("provenance", "k_max", 1),
                                ("provenance horizons", "k_max", 1),
                                ("provenance horizons", "drain_windows", 1),
                                ("provenance horizons", "prefetch_windows", 1),
                                ("provenance horizons", "nvme_lead_windows", 0)):
        value = (prov if where == "provenance" else horizons).get(key)
        if value is not None and not _is_count(value, minimum):
            _fail(f"{where} {key} must be an integer >= {minimum} (or null); got {value!r}")


def _check_numbers(plan: Plan) -> None:
    """Every window record figure and predicted figure is a finite number >= 0 (the engine
    uses `hbm_checkpoint_bytes` as a hard limit: NaN would switch the check off, a negative
    one fail it mid-step)."""
    records = [(f"window {w.name}", w) for w in plan.windows]
    if plan.predicted is not None:
        records.append(("predicted", plan.predicted))
    for where, rec in records:
        for key, value in asdict(rec).items():
            if key == "name":
                continue
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not math.isfinite(value) or value < 0):
                _fail(f"{where}: {key} must be a finite number >= 0; got {value!r}")


def _check_structure(plan: Plan) -> None:
    """Version, tier vocabulary, tier[L], windows, keep/resident/q8 indices, k_max."""
    if plan.version != PLAN_VERSION:
        _fail(f"plan version {plan.version!r} is not supported; expected {PLAN_VERSION}")
    L = plan.num_blocks
    if L < 1:
        _fail(f"plan needs boundaries 0..L with L >= 1; got {len(plan.tiers)} boundaries")
    for i, t in enumerate(plan.tiers):
        if t not in TIERS:
            _fail(f"boundary {i}: tier {t!r} is not one of {TIERS}")
    if plan.tiers[L] != "hbm":
        _fail(f"boundary {L}: the last boundary (head input) must be hbm; got {plan.tiers[L]!r}")
    names = [w.name for w in plan.windows]
    expected = window_names(L)
    if names != expected:
        bad = next((k for k, (a, b) in enumerate(zip(names, expected)) if a != b),
                   min(len(names), len(expected)))
        got = names[bad] if bad < len(names) else "<missing>"
        want = expected[bad] if bad < len(expected) else "<none>"
        _fail(f"windows must be {expected[0]}..{expected[-1]} in execution order ({len(expected)}"
              f" windows); position {bad} holds {got!r}, expected {want!r}")
    for label, blocks in (("keep_internals", plan.keep_internals),
                          ("resident_weights", plan.resident_weights),
                          ("q8_blocks", plan.q8_blocks)):
        for j in blocks:
            if not 0 <= j < L:
                _fail(f"{label}: block {j} outside 0..{L - 1}")
        if len(set(blocks)) != len(blocks):
            _fail(f"{label}: duplicate block indices {sorted(blocks)}")
    paths = plan.weight_paths
    if paths and (len(paths) != L or set(paths) - set(WEIGHT_PATH_NAMES)):
        _fail(f"weight_paths: give one of {WEIGHT_PATH_NAMES} per block ({L}); got "
              f"{list(paths)}")
    resident = set(plan.resident_weights)
    for j in plan.keep_internals:
        if j not in resident:
            _fail(f"block {j}: keep_internals without resident weights (window b{j} would "
                  f"run on a weight buffer reused since f{j}); add {j} to resident_weights")
        if not plan.is_materialized(j + 1):
            _fail(f"block {j}: keep_internals needs boundary {j + 1} materialized (a kept block"
                  f" ends its segment); boundary {j + 1} is recompute")
    k_max = plan.provenance.get("k_max", (plan.provenance.get("horizons") or {}).get("k_max"))
    if k_max is not None:
        for s, e in plan.segments():
            if e - s > k_max:
                _fail(f"segment ({s}, {e}) spans {e - s} blocks > k_max={k_max} "
                      f"(recomputed in window b{e - 1})")


def _required_kinds(tier: str) -> tuple[str, ...]:
    return {"dram": ("d2h", "h2d"), "nvme": TRANSFER_KINDS}.get(tier, ())


def _check_transfers(plan: Plan) -> None:
    """Legal windows, totals of 1 per (boundary, kind), cumulative precedence."""
    L = plan.num_blocks
    hz = plan.horizons()
    # by (boundary, kind): {ord: fraction}
    table: dict[tuple[int, str], dict[int, float]] = {}
    for t in plan.transfers:
        if not 0 <= t.boundary <= L:
            _fail(f"boundary {t.boundary}: transfer in window {t.window} names a boundary "
                  f"outside 0..{L}")
        tier = plan.tiers[t.boundary]
        if t.kind not in TRANSFER_KINDS:
            _fail(f"boundary {t.boundary}: transfer kind {t.kind!r} in window {t.window} is not "
                  f"one of {TRANSFER_KINDS}")
        if t.kind not in _required_kinds(tier):
            _fail(f"boundary {t.boundary}: {t.kind} in window {t.window} but the boundary's tier"
                  f" is {tier} (which has no {t.kind} transfers)")
        try:
            o = window_ord(t.window, L)
        except ValueError as exc:
            raise PlanValidationError(f"boundary {t.boundary}: {t.kind} names {exc}") from None
        if not (t.fraction > 0.0 and t.fraction <= 1.0 + FRACTION_TOL):
            _fail(f"boundary {t.boundary}: {t.kind} in window {t.window} has fraction "
                  f"{t.fraction!r}; expected 0 < fraction <= 1")
        e = plan.segment_end_of(t.boundary)
        legal = legal_ords(t.kind, t.boundary, e, L, **hz)
        if o not in legal:
            span = (f"{window_name(legal[0], L)}..{window_name(legal[-1], L)}" if len(legal)
                    else "none")
            _fail(f"boundary {t.boundary}: {t.kind} in window {t.window} is outside its legal "
                  f"windows ({span}; segment ({t.boundary}, {e}) first needs it in b{e - 1})")
        cell = table.setdefault((t.boundary, t.kind), {})
        cell[o] = cell.get(o, 0.0) + t.fraction
    for i, tier in enumerate(plan.tiers):
        for kind in _required_kinds(tier):
            total = sum(table.get((i, kind), {}).values())
            if abs(total - 1.0) > FRACTION_TOL:
                _fail(f"boundary {i}: {kind} fractions of this {tier} checkpoint sum to "
                      f"{total:.6f}; expected 1 (windows "
                      f"{[window_name(o, L) for o in sorted(table.get((i, kind), {}))]})")
        if tier in OFFLOAD_TIERS:
            _check_precedence(plan, i, tier, table)


def _check_precedence(plan: Plan, i: int, tier: str,
                      table: dict[tuple[int, str], dict[int, float]]) -> None:
    """cum nvme_write <= cum d2h; cum nvme_read <= cum nvme_write; cum h2d <= cum source."""
    L = plan.num_blocks
    rules = [("h2d", "d2h" if tier == "dram" else "nvme_read", "sends",
              "drained to DRAM" if tier == "dram" else "read back from NVMe")]
    if tier == "nvme":
        rules = [("nvme_write", "d2h", "writes", "staged in DRAM"),
                 ("nvme_read", "nvme_write", "reads", "written")] + rules
    for kind, src, verb, have in rules:
        dst, srcs = table.get((i, kind), {}), table.get((i, src), {})
        cum_dst = cum_src = 0.0
        for o in sorted(set(dst) | set(srcs)):
            cum_dst += dst.get(o, 0.0)
            cum_src += srcs.get(o, 0.0)
            if cum_dst > cum_src + FRACTION_TOL:
                _fail(f"boundary {i}: {kind} in window {window_name(o, L)} {verb} "
                      f"{cum_dst:.2f} of the checkpoint but only {cum_src:.2f} has been "
                      f"{have} by then")


def _check_save_levels(plan: Plan) -> None:
    """save_levels / saved_tiers: both empty or one valid entry per block; a kept block is L0
    with tier none; L0 has tier none; L1/L2 name hbm or dram (docs/execution_model.md, "Save
    levels")."""
    L, levels, tiers = plan.num_blocks, plan.save_levels, plan.saved_tiers
    if not levels:
        if tiers or plan.internal_transfers:
            _fail("saved_tiers / internal_transfers given without save_levels; give save_levels"
                  f" (one of {SAVE_LEVELS} per block) or leave all three out")
        return
    for field_, values, vocab in (("save_levels", levels, SAVE_LEVELS),
                                  ("saved_tiers", tiers, SAVED_TIERS)):
        if len(values) != L:
            _fail(f"{field_}: give one of {vocab} per block ({L}); got {len(values)} entries")
        bad = next((j for j, v in enumerate(values) if v not in vocab), None)
        if bad is not None:
            _fail(f"{field_}: block {bad} has {values[bad]!r}; expected one of {vocab}")
    keep = set(plan.keep_internals)
    for j, (level, tier) in enumerate(zip(levels, tiers)):
        if j in keep and (level, tier) != ("L0", "none"):
            _fail(f"block {j}: kept (keep_internals) but save_levels {level!r} / saved_tiers "
                  f"{tier!r}; a kept block is L0 with tier 'none' (keep holds the whole graph)")
        if level == "L0" and tier != "none":
            _fail(f"block {j}: save_levels 'L0' saves nothing but saved_tiers is {tier!r}; "
                  f"set it to 'none'")
        if level != "L0" and tier == "none":
            _fail(f"block {j}: save_levels {level!r} needs saved_tiers 'hbm' or 'dram'; got "
                  f"'none'")


def _check_internal_transfers(plan: Plan) -> None:
    """Internal transfers: a dram-tier block, a known kind, a legal window, 0 < fraction <= 1,
    each kind's fractions summing to 1 for every dram-tier block, and every h2d window strictly
    later than every d2h window of the block (an h2d never adopts a copy still held)."""
    L, hz = plan.num_blocks, plan.horizons()
    horizons = {"drain_windows": hz["drain_windows"], "prefetch_windows": hz["prefetch_windows"]}
    table: dict[tuple[int, str], dict[int, float]] = {}
    for t in plan.internal_transfers:
        where = f"internal_transfers: block {t.block} {t.kind} in window {t.window}"
        if not 0 <= t.block < L:
            _fail(f"{where} names a block outside 0..{L - 1}")
        if t.kind not in INTERNAL_TRANSFER_KINDS:
            _fail(f"{where}: kind must be one of {INTERNAL_TRANSFER_KINDS}")
        if plan.saved_tier_of(t.block) != "dram":
            _fail(f"{where}, but the block's saved_tiers is {plan.saved_tier_of(t.block)!r}; "
                  f"only a 'dram' block moves its internals (drop the transfer or set 'dram')")
        try:
            o = window_ord(t.window, L)
        except ValueError as exc:
            raise PlanValidationError(f"internal_transfers: block {t.block} {t.kind} names "
                                      f"{exc}") from None
        if not (t.fraction > 0.0 and t.fraction <= 1.0 + FRACTION_TOL):
            _fail(f"{where} has fraction {t.fraction!r}; expected 0 < fraction <= 1")
        legal = internal_legal_ords(t.kind, t.block, L, **horizons)
        if o not in legal:
            span = (f"{window_name(legal[0], L)}..{window_name(legal[-1], L)}" if len(legal)
                    else "none")
            _fail(f"{where} is outside its legal windows ({span}); move it there")
        cell = table.setdefault((t.block, t.kind), {})
        cell[o] = cell.get(o, 0.0) + t.fraction
    for j in range(L):
        if plan.saved_tier_of(j) != "dram":
            continue
        for kind in INTERNAL_TRANSFER_KINDS:
            cell = table.get((j, kind), {})
            if abs(sum(cell.values()) - 1.0) > FRACTION_TOL:
                _fail(f"internal_transfers: block {j}'s {kind} fractions sum to "
                      f"{sum(cell.values()):.6f} (windows "
                      f"{[window_name(o, L) for o in sorted(cell)]}); a 'dram' block needs "
                      f"them to sum to 1")
        last_d2h, first_h2d = max(table[j, "d2h"]), min(table[j, "h2d"])
        if first_h2d <= last_d2h:
            _fail(f"internal_transfers: block {j}'s h2d in window {window_name(first_h2d, L)} "
                  f"is not after its d2h in window {window_name(last_d2h, L)}; every h2d "
                  f"must come in a later window than every d2h")
