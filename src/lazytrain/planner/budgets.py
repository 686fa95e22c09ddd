"""The memory budgets a Plan was made to fit and the pinned host bytes it predicts, read from
its provenance's memory model (`memory_model.memory_model_of`; written by `planner/build.py`).

Owns reading those numbers the one way the runtime uses them: the engine hands `plan_budgets`
to the ledger as its hard limits, and the pinned prediction is what the ledger's measured peak
must stay within. Torch-free; knows nothing about the ledger or the solver.
"""

from __future__ import annotations

from lazytrain.planner.memory_model import memory_model_of
from lazytrain.planner.plan import Plan


def plan_budgets(plan: Plan) -> tuple[int | None, int | None]:
    """(HBM bytes, pinned host bytes) the plan was made to fit: the ledger's hard limits.

    HBM: the planner's HBM budget (`provenance.memory.hbm_budget_bytes`: the device's memory
    less its reserve); past it the allocator would fail, so the ledger refuses first, naming the
    owner. Pinned: the DRAM budget less what this plan keeps in pageable host memory, its host
    states (smaller where its blocks have 8-bit moments) and the optimizer's scratch, i.e.
    `predicted.dram_bytes - predicted.pinned_bytes`; DRAM-tier checkpoints, the NVMe bounce
    buffers and the staging pools live in the rest. So the plan's predicted pinned bytes are
    within this limit exactly when its predicted DRAM is within the DRAM budget, which is the
    MILP's DRAM row (`milp_rows.add_dram_capacity`). Plans without `predicted.pinned_bytes`:
    the DRAM left after the full-precision states and the scratch. The plan's *predictions* are
    compared with the ledger's measured peaks in `lazytrain report`. None where the plan
    carries no memory model (a hand-made problem).
    """
    memory = memory_model_of(plan.provenance)
    hbm, pinned = memory.hbm_budget_bytes, None
    if memory.dram_free_for_checkpoints_bytes is not None and memory.staging_bytes is not None:
        pinned = max(0, memory.dram_free_for_checkpoints_bytes + memory.staging_bytes
                     - (memory.optimizer_scratch_bytes or 0))
        pred = plan.predicted
        if memory.dram_budget_bytes is not None and pred is not None and pred.pinned_bytes:
            pinned = max(0, memory.dram_budget_bytes - (pred.dram_bytes - pred.pinned_bytes))
    return hbm, (None if pinned is None else int(pinned))


def pinned_overrun_bytes(plan: Plan) -> int:
    """Bytes by which the plan's predicted pinned host bytes pass the runtime's pinned limit
    (`plan_budgets`), >= 0; 0 where either is unknown. A plan the planner returns as fitting
    has 0: its DRAM row holds the same bytes."""
    predicted, (_, limit) = predicted_pinned_bytes(plan), plan_budgets(plan)
    if predicted is None or limit is None:
        return 0
    return max(0, predicted - limit)


def predicted_pinned_bytes(plan: Plan) -> int | None:
    """The plan's predicted pinned host bytes: its DRAM bytes less the host states and the
    optimizer's pageable scratch (DRAM-tier checkpoints + staging pools); None without a
    memory model."""
    if plan.predicted is None:
        return None
    if plan.predicted.pinned_bytes:
        return int(plan.predicted.pinned_bytes)
    # a plan written before `predicted.pinned_bytes`: None without its host states
    return memory_model_of(plan.provenance).pinned_bytes_of(plan.predicted.dram_bytes)
