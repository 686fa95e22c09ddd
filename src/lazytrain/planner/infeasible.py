"""Why no plan fits: `PlanInfeasibleError` and the shortfalls it names.

A `Shortfall` is one budget (HBM, DRAM or NVMe) a plan overflows, by how much and where; the
error lists every one with its fix (`shortfall_fix`, which offers only what the problem does not
already use). `shortfall_error` builds the error for a plan from the evaluator's figures. Raised
by the feasibility phase (`planner/feasibility.py`), the policy and the batch search; knows no
solver and no torch, so a caller may catch the error without loading the MILP.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.contract import HOST_BYTES_PER_PARAM
from lazytrain.errors import JobFailure
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.memory_model import memory_model_of
from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.units import GB

SLACK_TOL_GB = 1e-6
"""A capacity slack above this (1 kB) means the budget cannot be met: PlanInfeasibleError."""


SHORTFALL_FIX = {
    "HBM": "raise hardware.hbm_gb or shrink train.micro_batch / data.seq_len",
    # DRAM holds the optimizer states (host_bytes_per_param x params) besides the checkpoints,
    # so the batch is rarely what overflows it; `shortfall_fix` drops the options a
    # problem already uses.
    "DRAM": "raise hardware.dram_gb, use train.master_dtype: bf16 (12 B/param instead of 16), "
            "set planner.allow_q8: true (8-bit Adam states), or give checkpoints an NVMe budget "
            "(hardware.nvme_gb)",
    "NVMe": "raise hardware.nvme_gb or shrink train.micro_batch / data.seq_len",
}
"""What to change for each budget a plan overflows, every option (the `; <fix>` of the error
line when the problem is unknown)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Shortfall:
    """One budget a plan overflows: by how much, where, the need and the budget (bytes)."""

    budget: str
    """"HBM" | "DRAM" | "NVMe"."""
    window: str | None
    """The window of the peak (HBM); None for DRAM/NVMe, which hold for the whole step."""
    short_bytes: float
    need_bytes: float | None = None
    budget_bytes: float | None = None

    def text(self) -> str:
        """`HBM short by 3.20 GB at window b17 (needs 83.20 GB, budget 80.00 GB)`."""
        where = f"at window {self.window}" if self.window else "for the whole step"
        out = f"{self.budget} short by {self.short_bytes / GB:.2f} GB {where}"
        if self.need_bytes is not None and self.budget_bytes is not None:
            out += f" (needs {self.need_bytes / GB:.2f} GB, budget {self.budget_bytes / GB:.2f} GB)"
        return out


class PlanInfeasibleError(JobFailure):
    """A capacity budget cannot be met by any plan the model allows.

    Fields: `budget` ("HBM" | "DRAM" | "NVMe"), `window` (window name, None for DRAM/NVMe which
    hold for the whole step), `shortfall_bytes` (of the first short budget), `shortfalls` (every
    short budget, `Shortfall`), `proven` (False: only the best plan found in the time limit),
    `plan` (the plan that reaches the least shortfall, when known).
    """

    def __init__(self, *, budget: str | None = None, window: str | None = None,
                 shortfall_bytes: float = 0.0, proven: bool = True,
                 shortfalls: tuple[Shortfall, ...] = (), fixes: dict | None = None,
                 plan: Plan | None = None) -> None:
        if not shortfalls:
            shortfalls = (Shortfall(budget=budget, window=window, short_bytes=shortfall_bytes),)
        first = shortfalls[0]
        self.budget, self.window, self.shortfall_bytes = first.budget, first.window, \
            first.short_bytes
        self.shortfalls, self.proven, self.plan = tuple(shortfalls), proven, plan
        fixes = fixes or SHORTFALL_FIX
        why = ("no plan fits" if proven else "the best plan found within the time limit "
               "overflows (a longer planner.time_limit_s may find one that fits)")
        names = " and ".join(dict.fromkeys(s.budget for s in shortfalls))
        super().__init__("; ".join(s.text() for s in shortfalls)
                         + f": {why} the {names} budget{'s' if len(shortfalls) > 1 else ''}; "
                         + "; ".join(fixes[b] for b in dict.fromkeys(s.budget for s in shortfalls)))


def shortfalls_of(problem: PlanningProblem, plan: Plan) -> tuple[Shortfall, ...]:
    """Every budget `plan` overflows (evaluator figures), HBM first, with need and budget."""
    ev = evaluate(problem, plan)
    out = []
    if ev.hbm_short_bytes > 0:
        worst = max(range(len(ev.hbm_by_window)), key=ev.hbm_by_window.__getitem__)
        out.append(Shortfall(budget="HBM", window=ev.windows[worst].name,
                             short_bytes=ev.hbm_short_bytes, need_bytes=ev.peak_hbm_bytes,
                             budget_bytes=problem.hbm_bytes))
    if ev.dram_short_bytes > 0:
        out.append(Shortfall(budget="DRAM", window=None, short_bytes=ev.dram_short_bytes,
                             need_bytes=ev.dram_bytes, budget_bytes=problem.dram_bytes))
    if ev.nvme_short_bytes > 0:
        out.append(Shortfall(budget="NVMe", window=None, short_bytes=ev.nvme_short_bytes,
                             need_bytes=ev.nvme_bytes, budget_bytes=problem.nvme_bytes))
    return tuple(out)


def shortfall_error(problem: PlanningProblem, plan: Plan, *, proven: bool
                    ) -> PlanInfeasibleError:
    """The error for a plan that overflows: every short budget and its conditional fix."""
    short = shortfalls_of(problem, plan)
    if not short:  # the solver's slack and the evaluator disagree by less than a byte
        short = (Shortfall(budget="HBM", window=None, short_bytes=SLACK_TOL_GB * 1e9),)
    return PlanInfeasibleError(shortfalls=short, proven=proven, plan=plan,
                               fixes={s.budget: shortfall_fix(s.budget, problem) for s in short})


def shortfall_fix(budget: str, problem: PlanningProblem) -> str:
    """What to change for `budget` ("HBM" | "DRAM" | "NVMe"), leaving out what `problem` already
    does (bf16 masters, 8-bit states offered, an NVMe budget set). A DRAM budget that a GRPO KL
    reference copy shrinks (`provenance.memory.reference_bytes`) names `grpo.kl_coef` first,
    and `train.compute_dtype: bf16` (half the copy) when compute is fp32."""
    if budget != "DRAM":
        return SHORTFALL_FIX[budget]
    options = ["raise hardware.dram_gb"]
    reference = memory_model_of(problem.provenance).reference_bytes
    if reference:
        options.insert(0, f"set grpo.kl_coef: 0 (its KL reference copy of the weights holds "
                          f"{reference / GB:.2f} GB of hardware.dram_gb)")
        if problem.provenance.get("dtype") == "fp32":
            options.append("use train.compute_dtype: bf16 (a reference copy of 2 B/param "
                           "instead of 4)")
    master = problem.provenance.get("master_dtype")
    if master == "fp32" or (master is None
                            and problem.host_bytes_per_param > HOST_BYTES_PER_PARAM["bf16"]):
        options.append(f"use train.master_dtype: bf16 ({HOST_BYTES_PER_PARAM['bf16']:g} B/param "
                       f"instead of {HOST_BYTES_PER_PARAM['fp32']:g})")
    if not problem.allow_q8:
        options.append("set planner.allow_q8: true (8-bit Adam states)")
    if problem.nvme_bytes <= 0:
        options.append("give checkpoints an NVMe budget (hardware.nvme_gb)")
    return ", ".join(options[:-1]) + ", or " + options[-1] if len(options) > 1 else options[0]
