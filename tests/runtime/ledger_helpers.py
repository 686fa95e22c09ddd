"""Plans with the planner's real memory model for the tiny engine-test models, and the
ledger's measured figures of one instrumented step."""

from __future__ import annotations

from lazytrain.config import load_config
from lazytrain.planner.build import build_problem
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.spec.hardware import get_hardware
from lazytrain.spec.model import ModelSpec

from engine_helpers import BATCH, SEQ


def real_problem(adapter, *, grad_accum=2, master_dtype="fp32", hbm_gb=1.0):
    """The `build_problem` problem (the planner's fixed HBM working set, staging pools and host
    states) for the adapter's config and the engine tests' batch shape on the `cpu` preset."""
    cfg = load_config(None, [f"data.seq_len={SEQ}", f"train.micro_batch={BATCH}",
                             f"train.grad_accum={grad_accum}", "train.compute_dtype=fp32",
                             f"train.master_dtype={master_dtype}", f"hardware.hbm_gb={hbm_gb}"])
    spec = ModelSpec.from_hf_config(adapter.config.to_dict(), name="tiny")
    return build_problem(spec, get_hardware("cpu", {"hbm_gb": hbm_gb}), cfg)


def real_plan(adapter, tiers, keep=(), *, resident=None, grad_accum=2, master_dtype="fp32",
              q8_blocks=(), hbm_gb=1.0):
    """A plan of `tiers` whose problem is `real_problem`'s."""
    problem = real_problem(adapter, grad_accum=grad_accum, master_dtype=master_dtype,
                           hbm_gb=hbm_gb)
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep),
                                     resident_weights=resident, q8_blocks=q8_blocks)
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))
