"""Shared host resources of a multi-GPU node: the per-rank planning problem, the gradient
all-reduce term, and the predicted scaling table.

Decomposition (stated, not solved jointly): data-parallel ranks run the same model on equal
micro-batches, so on one node every rank faces the same problem; the planner solves ONE
per-rank problem and every rank runs that plan. The per-rank problem divides what the node's
ranks share (N = ranks per node, N_world = N x nnodes, S = min(N, gpus_per_pcie_switch) busy
GPUs per switch):

    dram_bytes           node DRAM / N
    nvme_bytes           node NVMe capacity / N
    nvme_read/write      node NVMe bandwidth (all drives together) / N   (all ranks stream at once)
    h2d, d2h, duplex     per-GPU link / S  (GPUs behind one switch share its x16 uplink, assumed
                         of the same generation as the GPU links; S = 1: a root port per GPU)
    host bytes/param     master / N + grad + moments / N_world   (shared masters, the default)
                         master + grad + moments / N_world       (dist.shared_masters: false)

Host bytes/param: with `dist.shared_masters` the node holds ONE master copy in shared memory,
mapped by its N local ranks (each group's owner updates it in place), so each rank is charged
1/N of it; the gradient accumulator stays per rank (every rank accumulates its own); the Adam
moments are ZeRO-1 sharded over all N_world ranks (`lazytrain.dist.sharding`; 8 B/param, 2 B
with 8-bit Adam). Seed scenario (Qwen3.5-27B, 26.90e9 params, bf16 row 2 + 2 + 8 B/param) on a
1000 GB node, states only (staging and DRAM-tier checkpoints come on top), one node:

    N   shared: 2/N + 2 + 8/N        unshared: 2 + 2 + 8/N     DRAM budget 1000 GB / N
    1   12.00 B/param = 322.8 GB     12 B/param = 322.8 GB     1000 GB
    2    7.00 B/param = 188.3 GB      8 B/param = 215.2 GB      500 GB
    4    4.50 B/param = 121.1 GB      6 B/param = 161.4 GB      250 GB
    8    3.25 B/param =  87.4 GB      5 B/param = 134.5 GB      125 GB  (unshared: no plan)

What is not divided: HBM (per GPU), compute. Host memory bandwidth and the root complex are
assumed not to be the bottleneck (not modelled).

All-reduce (a separate term, not a window channel): the runtime reduces each group's fp32
gradient in host DRAM to its owner and sends the updated fp32 master back over gloo. Bytes per
group of P params, at `allreduce_bytes_per_s` per rank (bytes/s):

    shared masters:  reduce (W - 1)/W x 4 B x P  +  broadcast (nnodes - 1)/nnodes x 4 B x P
    unshared:        reduce (W - 1)/W x 4 B x P  +  broadcast (W - 1)/W x 4 B x P
                     (= 2 (W - 1)/W x 4 B x P, a ring all-reduce)          W = N_world

With shared masters the broadcast only crosses nodes (the owner sends to the rank of the same
local index on every other node; inside a node a 1-element token says the update is in, not
counted); on one node it is free. The term does not use the PCIe channels of the windows
(host-side tensors), so it is modelled as one serial link: group j's reduction starts when
window b{j} of the step's last micro-batch ends (its gradient is final) or when the previous
reduction ends; the ends' after the backward. What runs past the end of the backward is exposed
(the next step's block 0 and ends wait for their updated masters) and is added to the step:

    step_ms(N) = plan.step_ms(per-rank problem) + exposed_allreduce_ms      (ms)

Reads no config: the topology of a run config is `planner/build.py`'s (`topology_of`,
`rank_problem_of`), which imports this module. No torch; the scaling table plans through
`policy.plan`. The table's text is `report/capacity.py`'s.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from lazytrain.contract import (ADAM_MOMENT_BYTES, ADAM_MOMENT_BYTES_Q8, REDUCE_BYTES_PER_PARAM,
                                backward_window)
from lazytrain.planner.infeasible import PlanInfeasibleError
from lazytrain.planner.policy import PlannerOptions, plan
from lazytrain.planner.problem import PlanningProblem

MOMENT_BYTES_PER_PARAM = float(ADAM_MOMENT_BYTES)
"""Adam m and v in fp32, bytes per parameter (the part ZeRO-1 shards)."""
MOMENT_BYTES_PER_PARAM_Q8 = float(ADAM_MOMENT_BYTES_Q8)
"""Adam m and v in 8 bits, bytes per parameter."""
GRAD_REDUCE_BYTES_PER_PARAM = float(REDUCE_BYTES_PER_PARAM)
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
    shared_masters: bool = True
    """One master copy per node in shared memory (module docstring), not one per rank."""

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


def assign_owners(numels: dict[str, int], world_size: int) -> dict[str, int]:
    """Group name -> owner rank of its Adam moments (ZeRO-1 by parameter group): largest group
    first, each to the rank with the fewest owned elements so far (ties: the lower rank, then
    the earlier group) - the LPT rule, which keeps the largest rank's share within 4/3 of the
    optimum; in group order instead, the big embedding/head group (last) lands on top of a full
    rank (1.66x the mean share for the seed on 8 ranks). Deterministic: every rank computes the
    same owners. `lazytrain.dist.sharding` uses it; the planner charges the largest share.

    Args:
        numels: group name -> elements, in group order (blocks 0..L-1, then ends).
        world_size: number of ranks, >= 1.
    """
    load = [0] * world_size
    owners = {}
    order = sorted(range(len(numels)), key=lambda i: -list(numels.values())[i])
    names = list(numels)
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owners[names[i]] = r
        load[r] += numels[names[i]]
    return {name: owners[name] for name in names}


def largest_owner_share(numels: dict[str, int], world_size: int) -> float:
    """The largest fraction of all elements one rank owns under `assign_owners` (>= 1/W)."""
    owners = assign_owners(numels, world_size)
    load = [0] * world_size
    for name, r in owners.items():
        load[r] += numels[name]
    return max(load) / max(1, sum(load))


def host_bytes_per_param_rank(full: float, *, moments: float, local_ranks: int,
                              world_size: int, shared_masters: bool,
                              moment_share: float | None = None) -> float:
    """Host bytes per parameter on one rank: master / N_local (shared masters) + grad +
    moments / N_world (ZeRO-1), bytes.

    Args:
        full: master + grad + moments of one process, bytes/param (the problem's
            `host_bytes_per_param` or `host_bytes_per_param_q8`).
        moments: the Adam moments' part of `full`, bytes/param.
        local_ranks, world_size: N_local ranks sharing the node, N_world ranks in the job.
        shared_masters: one master copy per node (charged 1/N_local to each rank).
        moment_share: the fraction of all moments the charged rank owns (the largest,
            `largest_owner_share`); None: an even 1/N_world.
    """
    # The problem gives only the sum; master and grad have the same width (2 + 2 bf16, 4 + 4
    # fp32: planner/build.py HOST_BYTES_PER_PARAM), so each is half of what the moments leave.
    master = grad = (full - moments) / 2
    share = 1 / world_size if moment_share is None else moment_share
    return master / (local_ranks if shared_masters else 1) + grad + moments * share


def rank_problem(problem: PlanningProblem, topo: Topology) -> PlanningProblem:
    """The per-rank problem of the module docstring (node-level `problem` in, one rank's out)."""
    n, world = topo.nproc_per_node, topo.world_size
    share = min(n, topo.gpus_per_pcie_switch)
    sizes = {f"block{j}": p for j, p in enumerate(problem.params_per_block)}
    sizes["ends"] = problem.ends_params
    ranks = dict(local_ranks=n, world_size=world, shared_masters=topo.shared_masters,
                 moment_share=largest_owner_share(sizes, world))
    prov = dict(problem.provenance)
    prov["dist"] = {"nproc_per_node": n, "nnodes": topo.nnodes, "world_size": world,
                    "gpus_per_pcie_switch": topo.gpus_per_pcie_switch,
                    "nvme_devices_per_node": topo.nvme_devices_per_node,
                    "node_dram_bytes": problem.dram_bytes,
                    "allreduce_bytes_per_s": topo.allreduce_bytes_per_s,
                    "shared_masters": topo.shared_masters}
    return problem.replace(
        name=problem.name if n == 1 else f"{problem.name} [1 of {n} ranks/node]",
        dram_bytes=problem.dram_bytes // n, nvme_bytes=problem.nvme_bytes // n,
        nvme_read_bytes_per_s=problem.nvme_read_bytes_per_s / n,
        nvme_write_bytes_per_s=problem.nvme_write_bytes_per_s / n,
        h2d_bytes_per_s=problem.h2d_bytes_per_s / share,
        d2h_bytes_per_s=problem.d2h_bytes_per_s / share,
        duplex_bytes_per_s=problem.duplex_bytes_per_s / share,
        host_bytes_per_param=host_bytes_per_param_rank(
            problem.host_bytes_per_param, moments=MOMENT_BYTES_PER_PARAM, **ranks),
        host_bytes_per_param_q8=host_bytes_per_param_rank(
            problem.host_bytes_per_param_q8, moments=MOMENT_BYTES_PER_PARAM_Q8, **ranks),
        provenance=prov)


def allreduce_ms(params: int, topo: Topology) -> float:
    """Reduce + master broadcast time of one group of `params` parameters, ms:
    ((W-1)/W + (M-1)/M) x 4 B x params / bandwidth, with W = N_world and M = nnodes for shared
    masters (the broadcast only crosses nodes) or M = W without (a ring all-reduce)."""
    world = topo.world_size
    bcast = topo.nnodes if topo.shared_masters else world
    nbytes = ((world - 1) / world + (bcast - 1) / bcast) * GRAD_REDUCE_BYTES_PER_PARAM * params
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
        start = max(link_free, ends_at.get(backward_window(j), backward_end))
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


def scaling_table(problem: PlanningProblem, topo: Topology, options: PlannerOptions | None = None,
                  *, counts=SCALING_COUNTS) -> list[ScalingRow]:
    """One `ScalingRow` per rank count in `counts` (<= gpus_per_node), planning each per-rank
    problem through `planner.policy.plan` (no LP bound, no least-wear phase).

    Args:
        problem: the node-level problem (the hardware's node DRAM and NVMe).
        topo: the topology; its nproc_per_node is replaced by each count.
        options: the planner options (None: `PlannerOptions(policy="heuristic")`; a MILP per
            rank count takes a solve each).
        counts: rank counts per node to predict.
    """
    opts = (options or PlannerOptions(policy="heuristic")).replace(lp_bound=False,
                                                                   least_wear_slack=None)
    rows = []
    for n in counts:
        if n > topo.gpus_per_node:
            continue
        t = topo.with_ranks(n)
        rp = rank_problem(problem, t)
        try:
            ranked = plan(rp, opts)
        except PlanInfeasibleError as exc:  # a budget cannot be met at this rank count
            rows.append(ScalingRow(ranks=n, step_ms=None, tokens_per_s=None,
                                   dram_budget_bytes=rp.dram_bytes, note=str(exc)[:160]))
            continue
        violations = ranked.provenance.get("violations") or []
        if violations:  # heuristics return their best plan even when it breaks a budget
            rows.append(ScalingRow(ranks=n, step_ms=None, tokens_per_s=None,
                                   dram_per_rank_bytes=ranked.predicted.dram_bytes,
                                   dram_budget_bytes=rp.dram_bytes, note=violations[0]))
            continue
        exposed = exposed_allreduce_ms(ranked, rp, t)
        step = ranked.predicted.step_ms + exposed
        tokens = rp.tokens_per_micro_batch * rp.grad_accum * t.world_size
        rows.append(ScalingRow(ranks=n, step_ms=step, tokens_per_s=tokens / (step / 1e3),
                               allreduce_exposed_ms=exposed, tiers=dict(Counter(ranked.tiers)),
                               dram_per_rank_bytes=ranked.predicted.dram_bytes,
                               dram_budget_bytes=rp.dram_bytes))
    return rows
