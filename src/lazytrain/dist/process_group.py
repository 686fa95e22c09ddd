"""Process groups for data parallelism: initialisation from torchrun's environment and the rank
context every other `dist` module receives.

Owns: reading torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), choosing the backend (`auto`: nccl when the engine runs on CUDA, else gloo),
the collective timeout (a dead peer makes every survivor raise within `timeout_s` instead of
hanging), and the two extra gloo groups the runtime needs:

- `grads`: the per-block gradient reductions and scalar sums, issued from the main thread;
- `params`: the broadcasts of updated masters, issued from the optimizer worker thread.

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

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: writes metrics, summary and checkpoint markers; logs."""
        return self.rank == 0


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
    if name == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=name, timeout=timeout)
    grads = dist.new_group(backend="gloo", timeout=timeout)
    params = dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank,
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
                       backend=name, grads_group=grads, params_group=params)


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
