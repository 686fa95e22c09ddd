"""Shared host resources of a multi-GPU node: the per-rank planning problem, the gradient
all-reduce term, and the predicted scaling table.

Decomposition (stated, not solved jointly): data-parallel ranks run the same model on equal
micro-batches, so on one node every rank faces the same problem; the planner solves ONE
per-rank problem and every rank runs that plan. The per-rank problem divides what the node's
ranks share (N = ranks per node, S = min(N, gpus_per_pcie_switch) busy GPUs per switch):

    dram_bytes           node DRAM / N
    nvme_bytes           node NVMe capacity / N
    nvme_read/write      node NVMe bandwidth (all drives together) / N   (all ranks stream at once)
    h2d, d2h, duplex     per-GPU link / S  (GPUs behind one switch share its x16 uplink, assumed
                         of the same generation as the GPU links; S = 1: a root port per GPU)
    host bytes/param     (master + grad) + moments / N_world   (ZeRO-1: Adam moments sharded
                         over all ranks, `lazytrain.dist.sharding`; moments 8 B/param, 2 B with
                         8-bit Adam)

What is not divided: HBM (per GPU), compute. Host memory bandwidth and the root complex are
assumed not to be the bottleneck (not modelled).

All-reduce (a separate term, not a window channel): the runtime reduces each group's fp32
gradient in host DRAM to its owner and broadcasts the updated fp32 master back over gloo, the
bytes of a ring all-reduce, 2 (N_world - 1) / N_world x 4 B x params, at `allreduce_bytes_per_s`
per rank. It does not use the PCIe channels of the windows (host-side tensors), so it is
modelled as one serial link: group j's reduction starts when window b{j} of the step's last
micro-batch ends (its gradient is final) or when the previous reduction ends; the ends' after
the backward. What runs past the end of the backward is exposed (the next step's block 0 and
ends wait for their updated masters) and is added to the step:

    step_ms(N) = plan.step_ms(per-rank problem) + exposed_allreduce_ms

Imports only the planner's types (no torch; the solver only inside `scaling_table`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from lazytrain.planner.problem import PlanningProblem

MOMENT_BYTES_PER_PARAM = 8.0
"""Adam m and v in fp32, bytes per parameter (the part ZeRO-1 shards)."""
MOMENT_BYTES_PER_PARAM_Q8 = 2.0
"""Adam m and v in 8 bits, bytes per parameter."""
GRAD_REDUCE_BYTES_PER_PARAM = 4.0
"""fp32 gradient (reduce) and fp32 master (broadcast), bytes per parameter of each half."""
SCALING_COUNTS = (1, 2, 4, 8)
"""Ranks per node of the predicted scaling table."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Topology:
    """How many ranks share one node and how its resources are wired."""

    nproc_per_node: int = 1
    """N: ranks on the node (one GPU each), >= 1."""
    nnodes: int = 1
    """Nodes in the job (each node has its own DRAM and NVMe), >= 1."""
    gpus_per_node: int = 1
    """GPUs in the node (N may not exceed it)."""
    gpus_per_pcie_switch: int = 1
    """GPUs behind one PCIe switch."""
    nvme_devices_per_node: int = 1
    """NVMe drives whose total bandwidth the hardware spec gives (informational)."""
    allreduce_bytes_per_s: float = 10e9
    """Bus bandwidth of the gradient reduce + master broadcast per rank, bytes/s."""

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "nnodes", "gpus_per_node", "gpus_per_pcie_switch",
                     "nvme_devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"topology {name} must be >= 1; got {getattr(self, name)}")
        if self.nproc_per_node > self.gpus_per_node:
            raise ValueError(f"dist.nproc_per_node is {self.nproc_per_node} but the node has "
                             f"{self.gpus_per_node} GPUs; set hardware.gpus_per_node")
        if not self.allreduce_bytes_per_s > 0:
            raise ValueError("dist.allreduce_gb_per_s must be > 0")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def with_ranks(self, n: int) -> "Topology":
        return dataclasses.replace(self, nproc_per_node=n)


def topology_from_config(cfg, hardware) -> Topology:
    """The topology of `cfg` (dist section, hardware topology overrides) on `hardware`."""
    h = cfg.hardware
    pick = lambda override, default: default if override is None else override  # noqa: E731
    return Topology(nproc_per_node=cfg.dist.nproc_per_node,
                    gpus_per_node=pick(h.gpus_per_node, hardware.gpus_per_node),
                    gpus_per_pcie_switch=pick(h.gpus_per_pcie_switch,
                                              hardware.gpus_per_pcie_switch),
                    nvme_devices_per_node=pick(h.nvme_devices_per_node,
                                               hardware.nvme_devices_per_node),
                    allreduce_bytes_per_s=cfg.dist.allreduce_gb_per_s * 1e9)


def host_bytes_per_param_rank(full: float, *, moments: float, world_size: int) -> float:
    """Host bytes per parameter on one rank with ZeRO-1: (full - moments) + moments / N."""
    return full - moments + moments / world_size


def rank_problem(problem: PlanningProblem, topo: Topology) -> PlanningProblem:
    """The per-rank problem of the module docstring (node-level `problem` in, one rank's out)."""
    n, world = topo.nproc_per_node, topo.world_size
    share = min(n, topo.gpus_per_pcie_switch)
    prov = dict(problem.provenance)
    prov["dist"] = {"nproc_per_node": n, "nnodes": topo.nnodes, "world_size": world,
                    "gpus_per_pcie_switch": topo.gpus_per_pcie_switch,
                    "nvme_devices_per_node": topo.nvme_devices_per_node,
                    "node_dram_bytes": problem.dram_bytes,
                    "allreduce_bytes_per_s": topo.allreduce_bytes_per_s}
    return problem.replace(
        name=problem.name if n == 1 else f"{problem.name} [1 of {n} ranks/node]",
        dram_bytes=problem.dram_bytes // n, nvme_bytes=problem.nvme_bytes // n,
        nvme_read_bytes_per_s=problem.nvme_read_bytes_per_s / n,
        nvme_write_bytes_per_s=problem.nvme_write_bytes_per_s / n,
        h2d_bytes_per_s=problem.h2d_bytes_per_s / share,
        d2h_bytes_per_s=problem.d2h_bytes_per_s / share,
        duplex_bytes_per_s=problem.duplex_bytes_per_s / share,
        host_bytes_per_param=host_bytes_per_param_rank(
            problem.host_bytes_per_param, moments=MOMENT_BYTES_PER_PARAM, world_size=world),
        host_bytes_per_param_q8=host_bytes_per_param_rank(
            problem.host_bytes_per_param_q8, moments=MOMENT_BYTES_PER_PARAM_Q8,
            world_size=world),
        provenance=prov)


def allreduce_ms(params: int, topo: Topology) -> float:
    """Ring all-reduce time of one group: 2 (N-1)/N x 4 B x params / bandwidth, ms."""
    world = topo.world_size
    nbytes = 2 * (world - 1) / world * GRAD_REDUCE_BYTES_PER_PARAM * params
    return nbytes / topo.allreduce_bytes_per_s * 1e3


def exposed_allreduce_ms(plan, problem: PlanningProblem, topo: Topology) -> float:
    """The all-reduce time past the end of the backward (module docstring), ms.

    Args:
        plan: the per-rank plan (its `windows`, in execution order, one micro-batch).
        problem: the per-rank problem (parameters per block, ends).
        topo: the topology (world size, bandwidth).
    """
    if topo.world_size == 1:
        return 0.0
    t, ends_at = 0.0, {}
    for w in plan.windows:
        t += w.time_ms
        ends_at[w.name] = t
    backward_end = t
    link_free = 0.0
    for j in range(problem.num_blocks - 1, -1, -1):
        start = max(link_free, ends_at.get(f"b{j}", backward_end))
        link_free = start + allreduce_ms(problem.params_per_block[j], topo)
    link_free = max(link_free, backward_end) + allreduce_ms(problem.ends_params, topo)
    return max(0.0, link_free - backward_end)


@dataclass(kw_only=True, frozen=True, slots=True)
class ScalingRow:
    """Predicted performance of one rank count (per-rank plan + all-reduce term)."""

    ranks: int
    step_ms: float | None
    """Step time, ms (None: no per-rank plan fits)."""
    tokens_per_s: float | None
    """Whole job: ranks x tokens per step / step time."""
    allreduce_exposed_ms: float = 0.0
    tiers: dict = dataclasses.field(default_factory=dict)
    """Boundary count per tier of the per-rank plan."""
    dram_per_rank_bytes: float = 0.0
    """Predicted DRAM of one rank (states + staging + DRAM-tier checkpoints), bytes."""
    dram_budget_bytes: int = 0
    """Node DRAM / N, bytes."""
    note: str = ""
    """Why no plan fits, when step_ms is None."""


def scaling_table(problem: PlanningProblem, topo: Topology, *, policy: str = "heuristic",
                  counts=SCALING_COUNTS, **plan_kwargs) -> list[ScalingRow]:
    """One `ScalingRow` per rank count in `counts` (<= gpus_per_node), planning each per-rank
    problem with `policy` (`lazytrain.planner.policy.plan_with_policy`, no LP bound).

    Args:
        problem: the node-level problem (the hardware's node DRAM and NVMe).
        topo: the topology; its nproc_per_node is replaced by each count.
        policy, plan_kwargs: as `plan_with_policy`.
    """
    from lazytrain.planner.policy import plan_with_policy

    rows = []
    for n in counts:
        if n > topo.gpus_per_node:
            continue
        t = topo.with_ranks(n)
        rp = rank_problem(problem, t)
        try:
            plan = plan_with_policy(rp, policy, lp_bound=False, **plan_kwargs)
        except ValueError as exc:  # PlanInfeasibleError: a budget cannot be met
            rows.append(ScalingRow(ranks=n, step_ms=None, tokens_per_s=None,
                                   dram_budget_bytes=rp.dram_bytes, note=str(exc)[:160]))
            continue
        violations = plan.provenance.get("violations") or []
        if violations:  # heuristics return their best plan even when it breaks a budget
            rows.append(ScalingRow(ranks=n, step_ms=None, tokens_per_s=None,
                                   dram_per_rank_bytes=plan.predicted.dram_bytes,
                                   dram_budget_bytes=rp.dram_bytes, note=violations[0]))
            continue
        exposed = exposed_allreduce_ms(plan, rp, t)
        step = plan.predicted.step_ms + exposed
        tokens = rp.tokens_per_micro_batch * rp.grad_accum * t.world_size
        rows.append(ScalingRow(ranks=n, step_ms=step, tokens_per_s=tokens / (step / 1e3),
                               allreduce_exposed_ms=exposed, tiers=dict(Counter(plan.tiers)),
                               dram_per_rank_bytes=plan.predicted.dram_bytes,
                               dram_budget_bytes=rp.dram_bytes))
    return rows


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
