"""The memory budgets a Plan was made to fit and the pinned host bytes it predicts, read from
its provenance's memory model (`provenance.memory`, written by `planner/build.py`).

Owns reading those numbers the one way the runtime uses them: the engine hands `plan_budgets`
to the ledger as its hard limits, and the pinned prediction is what the ledger's measured peak
must stay within. Torch-free; knows nothing about the ledger or the solver.
"""

from __future__ import annotations

from lazytrain.planner.plan import Plan


def plan_budgets(plan: Plan) -> tuple[int | None, int | None]:
    """(HBM bytes, pinned host bytes) the plan was made to fit: the ledger's hard limits.

    HBM: the planner's HBM budget (`provenance.memory.hbm_budget_bytes`: the device's memory
    less its reserve); past it the allocator would fail, so the ledger refuses first, naming the
    owner. Pinned: the DRAM left after the host states (DRAM-tier checkpoints and staging pools
    live there). The plan's *predictions* (usually lower) are compared with the ledger's
    measured peaks in `lazytrain report`. None where the plan carries no memory model (a
    hand-made problem).
    """
    memory = (plan.provenance or {}).get("memory") or {}
    hbm = memory.get("hbm_budget_bytes")
    pinned = None
    if "dram_free_for_checkpoints_bytes" in memory and "staging_bytes" in memory:
        pinned = max(0, memory["dram_free_for_checkpoints_bytes"] + memory["staging_bytes"]
                     - memory.get("optimizer_scratch_bytes", 0))
    return (None if hbm is None else int(hbm)), (None if pinned is None else int(pinned))


def predicted_pinned_bytes(plan: Plan) -> int | None:
    """The plan's predicted pinned host bytes: its DRAM bytes less the host states and the
    optimizer's pageable scratch (DRAM-tier checkpoints + staging pools); None without a
    memory model."""
    memory = (plan.provenance or {}).get("memory") or {}
    if plan.predicted is None:
        return None
    if plan.predicted.pinned_bytes:
        return int(plan.predicted.pinned_bytes)
    if "states_bytes" not in memory:  # a plan written before `predicted.pinned_bytes`
        return None
    return int(plan.predicted.dram_bytes - memory["states_bytes"]
               - memory.get("optimizer_scratch_bytes", 0))
