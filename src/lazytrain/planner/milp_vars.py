"""The variable families of the placement MILP and their names.

Owns `MilpVars` (one dict of column indices per family, the legend of `planner/milp.py`),
`add_variables` (only legal transfer windows get a column, each with its objective term) and
`row_name`, the one naming scheme of rows and columns. Knows no rows; no solver, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lazytrain.planner.milp_inputs import Scaled
from lazytrain.planner.windows import legal_ords, window_name
from lazytrain.planner.solvers import LinearModel
from lazytrain.planner.staging import bounce_spans

WHOLE_TRANSFERS = ("d2h", "h2d")
"""Transfer families moved in one window (binary), so the HBM holding intervals are exact."""
KINDS = {"d2h": "d2h", "h2d": "h2d", "nvw": "nvme_write", "nvr": "nvme_read"}
"""MilpVars transfer family -> Plan transfer kind."""


def row_name(family: str, *idx) -> str:
    """`family[idx,...]`, the one naming scheme for rows and variables (e.g. hbm_cap[b17])."""
    return f"{family}[{','.join(str(x) for x in idx)}]"


@dataclass(kw_only=True, slots=True)
class MilpVars:
    """Column indices of every variable family (the legend of `planner/milp.py`)."""

    seg: dict[tuple[int, int], int] = field(default_factory=dict)
    mat: dict[int, int] = field(default_factory=dict)
    hbm: dict[int, int] = field(default_factory=dict)
    dram: dict[int, int] = field(default_factory=dict)
    nvme: dict[int, int] = field(default_factory=dict)
    emb: dict[int, int] = field(default_factory=dict)
    keep: dict[int, int] = field(default_factory=dict)
    resident: dict[int, int] = field(default_factory=dict)
    q8: dict[int, int] = field(default_factory=dict)
    d2h: dict[tuple[int, int], int] = field(default_factory=dict)
    h2d: dict[tuple[int, int], int] = field(default_factory=dict)
    nvw: dict[tuple[int, int], int] = field(default_factory=dict)
    nvr: dict[tuple[int, int], int] = field(default_factory=dict)
    t: dict[int, int] = field(default_factory=dict)
    slack_hbm: dict[int, int] = field(default_factory=dict)
    slack_host: dict[str, int] = field(default_factory=dict)
    wdone: dict[tuple[int, int], int] = field(default_factory=dict)
    nvb: dict[tuple[int, int], int] = field(default_factory=dict)
    path: dict[tuple[int, str], int] = field(default_factory=dict)
    """(block, weight path) -> column, only with free paths (`planner/milp_paths.py`)."""
    wload: dict[tuple[int, int], int] = field(default_factory=dict)
    wreload: dict[tuple[int, int, int], int] = field(default_factory=dict)
    cast_max: dict[int, int] = field(default_factory=dict)
    chain: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    lvl: dict[tuple[int, int, str], int] = field(default_factory=dict)
    """(block, level 1|2, tier hbm|dram) -> column, only with save levels (`milp_levels`)."""
    id2h: dict[tuple[int, int, int], int] = field(default_factory=dict)
    """(block, level, ord) -> whole d2h of a dram-tier block's saved internals."""
    ih2d: dict[tuple[int, int, int], int] = field(default_factory=dict)
    """(block, level, ord) -> whole h2d of a dram-tier block's saved internals."""
    legal_ends: dict[tuple[str, int, int], tuple[int, ...]] = field(default_factory=dict)
    """(family, i, o) -> segment ends e for which window o is legal (not a variable)."""

    def transfer(self, family: str) -> dict[tuple[int, int], int]:
        return getattr(self, family)

    def ords(self, family: str, i: int) -> list[int]:
        """Sorted window ords of boundary i's variables in a transfer family."""
        return sorted(o for (b, o) in self.transfer(family) if b == i)


def add_variables(m: LinearModel, p: Scaled, *, relax: bool = False,
                  capacity: str = "hard") -> MilpVars:
    """Create every variable family (only legal transfer windows) with its objective terms.

    `capacity` (`milp.CAPACITY_MODES`): "hard" fixes the slacks to 0; "min_shortfall" makes one HBM
    slack for all windows and puts only the slacks in the objective (GB).
    """
    L, v, binary = p.L, MilpVars(), not relax
    for s in range(L):
        for e in range(s + 1, min(L, s + p.k_max) + 1):
            v.seg[s, e] = m.add_var(row_name("seg", s, e), ub=1, integer=binary)
    for i in range(1, L):
        v.mat[i] = m.add_var(row_name("mat", i), ub=1, integer=binary)
    tiers = [("hbm", v.hbm, 0.0), ("dram", v.dram, 1.0)] + ([("nvme", v.nvme, 2.0)]
                                                            if p.has_nvme else [])
    for i in range(L):
        for name, fam, tie in tiers:
            fam[i] = m.add_var(row_name(name, i), ub=1, integer=binary,
                               obj=p.tie_ms * tie * (1 + i / L))
    for (s, e) in v.seg:
        if s == 0:
            v.emb[e] = m.add_var(row_name("emb", e), ub=1)
    for j in range(L) if p.allow_keep else ():
        v.keep[j] = m.add_var(row_name("keep", j), ub=1, integer=binary)
        v.resident[j] = m.add_var(row_name("resident", j), ub=1, integer=binary, obj=p.tie_ms)
    shortfall = capacity == "min_shortfall"
    for j in range(L) if p.allow_q8 else ():
        # the 8-bit update's time is part of the step (none in the feasibility phase)
        v.q8[j] = m.add_var(row_name("q8", j), ub=1, integer=binary,
                            obj=p.q8_penalty[j] + (0.0 if shortfall else p.q8_update[j]))
    families = ("d2h", "h2d", "nvw", "nvr") if p.has_nvme else ("d2h", "h2d")
    for fam in families:
        late = fam in ("h2d", "nvr")
        for i in range(L):
            ends: dict[int, list[int]] = {}
            for e in range(i + 1, min(L, i + p.k_max) + 1):
                for o in legal_ords(KINDS[fam], i, e, L, **p.horizons):
                    ends.setdefault(o, []).append(e)
            whole = binary and fam in WHOLE_TRANSFERS
            for o in sorted(ends):
                pos = (2 * L - o) if late else (o - i)
                v.transfer(fam)[i, o] = m.add_var(row_name(fam, i, window_name(o, L)), ub=1,
                                                  obj=p.tie_ms * pos / (2 * L), integer=whole)
                v.legal_ends[fam, i, o] = tuple(ends[o])
    for i in range(L) if p.has_nvme else ():
        writes, reads = v.ords("nvw", i), v.ords("nvr", i)
        shared = [o for o in reads if writes and o <= writes[-1]]
        # a read at ord <= i is already 0 (family 6: nothing written before i)
        for q in range(max(shared[0] - 1, i), writes[-1]) if shared else ():
            v.wdone[i, q] = m.add_var(row_name("wdone", i, window_name(q, L)), ub=1,
                                      integer=binary)
    for i, e in v.seg if p.has_nvme else ():  # (i, e) that can hold a bounce buffer
        if bounce_spans(i, e, L, **p.horizons):
            v.nvb[i, e] = m.add_var(row_name("nvb", i, e), ub=1)
    for o in range(2 * L + 1):
        v.t[o] = m.add_var(row_name("t", window_name(o, L)), obj=0.0 if shortfall else p.grad_accum)
    hbm_slack = m.add_var(row_name("slack_hbm", "all"), obj=1.0) if shortfall else None
    for o in range(2 * L + 1):
        v.slack_hbm[o] = hbm_slack if shortfall else m.add_var(
            row_name("slack_hbm", window_name(o, L)), ub=0.0)
    for budget in ("dram", "nvme"):
        v.slack_host[budget] = m.add_var(row_name("slack", budget), obj=1.0 if shortfall else 0.0,
                                         ub=math.inf if shortfall else 0.0)
    m.obj_offset = 0.0 if shortfall else p.step_const_ms
    return v

