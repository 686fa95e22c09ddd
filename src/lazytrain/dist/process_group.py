"""Process groups for data parallelism: initialisation from torchrun's environment and the rank
context every other `dist` module receives.

Owns: reading torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), choosing the backend (`auto`: nccl when the engine runs on CUDA, else gloo),
the collective timeout (a dead peer makes every survivor raise within `timeout_s` instead of
hanging), and the extra gloo groups the runtime needs:

- `grads`: the per-block gradient reductions and scalar sums, issued from the main thread;
- `params`: the broadcasts of updated masters, issued from the optimizer worker thread;
- `node`: the ranks of this node (the "update is in" tokens of node-shared masters, worker
  thread), and `cross`: the ranks with this rank's local index on every node (the cross-node
  broadcasts of node-shared masters, worker thread); `lazytrain.dist.shared_masters`.

Rank layout: torchrun numbers ranks node by node, rank = node_rank x LOCAL_WORLD_SIZE +
local_rank, with the same LOCAL_WORLD_SIZE on every node; `init_from_env` checks it.

Both act on host fp32 tensors (the engine's gradient accumulators and masters live in DRAM), so
both are gloo groups even when the default group is nccl; two groups because collectives on one
group must be issued in the same order on every rank, and the main thread and the worker thread
interleave differently on different ranks. Knows nothing about models or plans.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(kw_only=True, frozen=True, slots=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int = 0
    """Global rank, 0..world_size-1."""
    world_size: int = 1
    """Number of processes (ranks) in the job."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    local_world_size: int = 1
    """Ranks on this node (they share DRAM, NVMe and PCIe switches)."""
    backend: str = "none"
    """Default group's backend: gloo, nccl, or none (one process)."""
    grads_group: object = None
    """gloo group for gradient reductions and scalar sums (main thread); None: one process."""
    params_group: object = None
    """gloo group for master broadcasts (optimizer worker thread); None: one process."""
    node_rank: int = 0
    """Index of this node (torchrun's GROUP_RANK), 0..nnodes-1."""
    nnodes: int = 1
    """Nodes in the job (world_size / local_world_size)."""
    node_group: object = None
    """gloo group of this node's ranks (worker thread); None: one process."""
    cross_group: object = None
    """gloo group of the ranks with this local_rank on every node (worker thread)."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: writes metrics, summary and checkpoint markers; logs."""
        return self.rank == 0

    def global_rank(self, *, node: int, local: int) -> int:
        """The rank of local rank `local` on node `node` (module docstring's layout)."""
        return node * self.local_world_size + local

    def node_of(self, rank: int) -> tuple[int, int]:
        """(node, local rank) of global `rank`."""
        return divmod(rank, self.local_world_size)


def env_world_size() -> int:
    """WORLD_SIZE from the environment (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_backend(backend: str, *, device: str) -> str:
    """`auto` -> nccl on cuda, gloo on cpu.

    Raises:
        ValueError: unknown backend, or nccl with a CPU engine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"dist.backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError("dist.backend: nccl needs runtime.device=cuda; use gloo on CPU")
    return backend


def init_from_env(*, backend: str = "auto", device: str = "cpu",
                  timeout_s: float = 300.0) -> DistContext:
    """Join the job torchrun started (env:// rendezvous); a single process gets a local context.

    Args:
        backend: auto, gloo or nccl (`resolve_backend`).
        device: the engine's device ("cpu" or "cuda"); on cuda this process uses GPU LOCAL_RANK.
        timeout_s: collective timeout, s: a collective that waits longer (a peer died) raises
            on every surviving rank.

    Returns:
        The context; `world_size == 1` without torchrun's variables (nothing initialised).

    Raises:
        ValueError: bad backend; RuntimeError: the rendezvous failed or timed out.
    """
    world = env_world_size()
    if world <= 1:
        return DistContext()
    name = resolve_backend(backend, device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":  # gloo on GPUs too: otherwise every rank would run on GPU 0
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=name, timeout=timeout)
    grads = dist.new_group(backend="gloo", timeout=timeout)
    params = dist.new_group(backend="gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    node_rank = int(os.environ.get("GROUP_RANK", "0"))
    if world % local_world or rank != node_rank * local_world + local_rank:
        raise RuntimeError(f"rank {rank}: torchrun's layout is not node by node (GROUP_RANK "
                           f"{node_rank}, LOCAL_RANK {local_rank}, LOCAL_WORLD_SIZE "
                           f"{local_world}, WORLD_SIZE {world}); start every node with the "
                           f"same --nproc_per_node")
    nnodes = world // local_world
    node_groups = [dist.new_group([n * local_world + k for k in range(local_world)],
                                  backend="gloo", timeout=timeout) for n in range(nnodes)]
    cross_groups = [dist.new_group([n * local_world + k for n in range(nnodes)],
                                   backend="gloo", timeout=timeout) for k in range(local_world)]
    return DistContext(rank=rank, world_size=world, local_rank=local_rank,
                       local_world_size=local_world, backend=name, grads_group=grads,
                       params_group=params, node_rank=node_rank, nnodes=nnodes,
                       node_group=node_groups[node_rank], cross_group=cross_groups[local_rank])


def barrier(ctx: DistContext) -> None:
    """All ranks meet here (gloo group: works with either default backend). No-op alone."""
    if ctx.distributed:
        dist.barrier(group=ctx.grads_group)


def broadcast_object(ctx: DistContext, obj=None, *, src: int = 0):
    """`obj` from rank `src` on every rank (pickled; small objects: plans, flags)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ctx.grads_group)
    return box[0]


def shutdown(ctx: DistContext) -> None:
    """Destroy the process groups (after the last collective)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
