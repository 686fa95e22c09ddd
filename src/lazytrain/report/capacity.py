"""Capacity tables: the batch search of `lazytrain plan --max-batch` and the predicted
data-parallel scaling table, as fixed-width text.

Formats what `planner/capacity.py` (`BatchSearch`) and `planner/topology.py` (`ScalingRow`)
compute; plans nothing itself. Knows no torch.
"""

from __future__ import annotations

from lazytrain.planner.capacity import BatchSearch
from lazytrain.planner.topology import ScalingRow, Topology


def format_batch_table(search: BatchSearch, *, title: str = "") -> str:
    """The human-readable table (stdout of `lazytrain plan --max-batch`)."""
    lines = [title] if title else []
    lines.append(f"largest micro-batch that fits: {search.max_micro_batch} "
                 f"(policy {search.policy}); largest global batch "
                 f"{search.max_global_batch} = {search.max_micro_batch} x "
                 f"{search.grad_accums[-1]}")
    lines.append(f"{'micro':>6} {'accum':>6} {'global':>7} {'fits':>5} {'step ms':>11} "
                 f"{'tokens/s':>10} {'TFLOPS':>8} {'peak HBM GB':>12} {'DRAM GB':>8} "
                 f"{'8-bit %':>8}")
    for r in search.rows:
        if not r.feasible:
            lines.append(f"{r.micro_batch:>6} {r.grad_accum:>6} {r.global_batch:>7} "
                         f"{'no':>5}  {r.violation or ''}")
            continue
        lines.append(f"{r.micro_batch:>6} {r.grad_accum:>6} {r.global_batch:>7} {'yes':>5} "
                     f"{r.step_ms:>11.1f} {r.tokens_per_s:>10.1f} {r.model_tflops:>8.1f} "
                     f"{r.peak_hbm_bytes / 1e9:>12.2f} {r.dram_bytes / 1e9:>8.1f} "
                     f"{100 * r.q8_param_fraction:>8.2f}")
    return "\n".join(lines)


def format_scaling_table(rows: list[ScalingRow]) -> str:
    """The rows as a fixed-width text table (tokens/s, step time, tiers, DRAM per rank)."""
    base = next((r.tokens_per_s for r in rows if r.ranks == 1 and r.tokens_per_s), None)
    lines = ["ranks  step_s  tokens/s  speedup  allreduce_exposed_s  tiers (hbm/dram/nvme/rec)"
             "  DRAM/rank GB (budget)"]
    for r in rows:
        if r.step_ms is None:
            lines.append(f"{r.ranks:>5}  no plan fits (DRAM/rank budget "
                         f"{r.dram_budget_bytes / 1e9:.0f} GB): {r.note}")
            continue
        tiers = "/".join(str(r.tiers.get(k, 0)) for k in ("hbm", "dram", "nvme", "recompute"))
        speed = f"{r.tokens_per_s / base:7.2f}x" if base else "      -"
        lines.append(f"{r.ranks:>5}  {r.step_ms / 1e3:6.2f}  {r.tokens_per_s:8.0f}  {speed}  "
                     f"{r.allreduce_exposed_ms / 1e3:19.2f}  {tiers:>25}  "
                     f"{r.dram_per_rank_bytes / 1e9:8.1f} ({r.dram_budget_bytes / 1e9:.0f})")
    return "\n".join(lines)


def scaling_text(rows: list[ScalingRow], topo: Topology, *, policy: str) -> str:
    """The scaling table under a line saying how it was predicted (`policy`: the one its
    per-rank plans used)."""
    masters = ("one shared master copy per node" if topo.shared_masters
               else "a master copy per rank (dist.shared_masters: false)")
    return (f"scaling (policy {policy}; per-rank plan + exposed gradient all-reduce; "
            f"{masters}; tokens/s of the whole node):\n" + format_scaling_table(rows))


def over_dram_hint(topo: Topology) -> str:
    """What to change when a data-parallel rank's plan does not fit (after the error)."""
    return (f"with {topo.nproc_per_node} ranks per node each gets 1/{topo.nproc_per_node} of "
            f"the node's DRAM: use fewer ranks per node (table above)"
            + ("" if topo.shared_masters else
               " or dist.shared_masters: true (one master copy per node)"))
