"""The memory model a Plan was made under: the HBM and DRAM split `planner/build.py`
(`memory_budget`) writes into the plan's `provenance["memory"]`, as one typed, frozen value.

Owns the names, units and meaning of that split and the one way to read it back
(`memory_model_of`), which every reader uses: the runtime's budgets (`planner/budgets.py`), the
training preflight (`train/plan_preflight.py`), `lazytrain report` (`report/tables.py`) and the
plan table's host DRAM line. The Plan JSON is unchanged: the same keys in `provenance["memory"]`
(`reference_bytes` only with a GRPO KL reference copy), every value an int of bytes. A plan
written without a memory model (a hand-made problem, an older plan) reads as `MemoryModel()`:
every figure None, meaning unknown, and each reader says what it does then.

Torch-free; imports only the error base classes.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from lazytrain.errors import UserError


class MemoryModelError(UserError, ValueError):
    """A plan's `provenance.memory` that is not an object of byte counts; the message names the
    key and the fix (exit 2)."""


@dataclass(frozen=True)
class MemoryModel:
    """The budget split of one plan, every figure in bytes; None: not in the plan (unknown).

    HBM (docs/execution_model.md "HBM capacity"):
        hbm_budget_bytes: the device's memory less `hardware.hbm_reserve_fraction`.
        fixed_hbm_bytes: the working set every window holds: weight_buffers_bytes +
            grad_buffers_bytes + ends_bytes + max(block_workspace_bytes, head_workspace_bytes)
            + block_inputs_bytes + grad_cast_bytes.
        weight_buffers_bytes: the engine's device weight ring (DEVICE_WEIGHT_SLOTS x max block
            weights).
        grad_buffers_bytes: the device gradient buffers (DEVICE_GRAD_BUFFERS x max block grads).
        grad_cast_bytes: with one micro-batch per step and masters in another dtype, the
            device buffers gradients are cast into before landing in the accumulator
            (GRAD_DRAIN_BUFFERS x max block grads in the master dtype); 0 otherwise.
        ends_bytes: embedding, final norm and untied head weights plus their fp32 gradient.
        block_workspace_bytes: a block's backward working set.
        head_workspace_bytes: the head's working set in `turn`.
        block_inputs_bytes: one micro-batch's rotary tables, masks and positions.
    DRAM:
        states_bytes: host states, HOST_BYTES_PER_PARAM x params (16 B fp32, 12 B bf16 masters).
        staging_bytes: the constant pools: weight_pool_bytes + grad_landing_bytes +
            nvme_bounce_bytes + optimizer_scratch_bytes.
        weight_pool_bytes: the pinned pool for streamed weights.
        grad_landing_bytes: the pinned gradient landing buffers.
        nvme_bounce_bytes: the NVMe bounce buffers (aligned to 4 KiB).
        optimizer_scratch_bytes: bf16 masters' fp32 AdamW scratch (pageable; 0 for fp32).
        reference_bytes: with `train.method: grpo` and `grpo.kl_coef` > 0, the KL reference
            copy of the weights in the compute dtype, held in pageable host DRAM beside the
            plan (`grpo_phase.reference_bytes`); None: no copy.
        dram_free_for_checkpoints_bytes: hardware DRAM - reference - states - staging, what is
            left for DRAM-tier checkpoints; negative when the states alone do not fit.
    """

    hbm_budget_bytes: int | None = None
    fixed_hbm_bytes: int | None = None
    weight_buffers_bytes: int | None = None
    grad_buffers_bytes: int | None = None
    ends_bytes: int | None = None
    block_workspace_bytes: int | None = None
    head_workspace_bytes: int | None = None
    block_inputs_bytes: int | None = None
    grad_cast_bytes: int | None = None
    states_bytes: int | None = None
    staging_bytes: int | None = None
    weight_pool_bytes: int | None = None
    grad_landing_bytes: int | None = None
    nvme_bounce_bytes: int | None = None
    optimizer_scratch_bytes: int | None = None
    reference_bytes: int | None = None
    dram_free_for_checkpoints_bytes: int | None = None

    @classmethod
    def from_dict(cls, memory: dict | None) -> "MemoryModel":
        """The model of a `provenance["memory"]` object; None or {}: `MemoryModel()` (all
        unknown). Keys this version does not know are ignored (a newer plan's extra figures).

        Raises:
            MemoryModelError: `memory` is not an object, or a known key holds something other
                than a number of bytes.
        """
        if memory is None:
            return cls()
        if not isinstance(memory, dict):
            raise MemoryModelError(f"plan provenance.memory must be a JSON object of byte "
                                   f"counts; got {type(memory).__name__}: re-plan to write it")
        values = {}
        for f in dataclasses.fields(cls):
            value = memory.get(f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise MemoryModelError(f"plan provenance.memory.{f.name} must be a number of "
                                       f"bytes; got {value!r}: re-plan to write it")
            values[f.name] = int(value)
        return cls(**values)

    def to_dict(self) -> dict:
        """The `provenance["memory"]` object: the known figures under their keys, in field
        order (the inverse of `from_dict`)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def pageable_bytes(self) -> int | None:
        """Host bytes outside the pinned pools: the host states plus the optimizer's pageable
        scratch (0 where not recorded); None when the states are unknown."""
        if self.states_bytes is None:
            return None
        return self.states_bytes + (self.optimizer_scratch_bytes or 0)

    @property
    def dram_budget_bytes(self) -> int | None:
        """The DRAM budget the plan was made to fit (the hardware's DRAM less a GRPO KL
        reference copy, `reference_bytes`): states + staging + what is free for checkpoints;
        None when any of the three is unknown."""
        parts = (self.states_bytes, self.staging_bytes, self.dram_free_for_checkpoints_bytes)
        return None if None in parts else sum(parts)

    def pinned_bytes_of(self, dram_bytes: int | float) -> int | None:
        """The pinned part of `dram_bytes` (a plan's predicted DRAM, bytes): DRAM-tier
        checkpoints and staging pools, i.e. `dram_bytes` less `pageable_bytes`; may be
        negative for figures that do not belong together. None when the states are unknown."""
        pageable = self.pageable_bytes
        return None if pageable is None else int(dram_bytes - pageable)


def memory_model_of(provenance: dict | None) -> MemoryModel:
    """The memory model in a plan's provenance (a `Plan.provenance` or a plan JSON's
    "provenance" object); `MemoryModel()` (all unknown) when it has none.

    Raises:
        MemoryModelError: as `MemoryModel.from_dict`.
    """
    return MemoryModel.from_dict((provenance or {}).get("memory"))
