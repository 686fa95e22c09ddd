"""The data-parallel rank context over `torch.distributed` (the interface is
`lazytrain.train.rank.RankContext`), and joining the job torchrun started.

What a rank does differently from one process, all through this context:
- process groups from torchrun's environment (`process_group.init_from_env`, `dist.*` config);
  `join` sets `dist.nproc_per_node` / `dist.nnodes` to what torchrun started (`launch_config`),
  so each rank's plan gets its real share of the node, and checks that every rank sees the run
  directory (`check_shared_run_dir`);
- the masters: one copy per node in shared memory, written by local rank 0
  (`shared_masters`, `dist.shared_masters`), or one private copy per rank;
- the engine: per-group reduction + ZeRO-1 sharded AdamW (`parallel.engine_parts`), seeded per
  rank (`rank_seed`: independent dropout masks), on GPU LOCAL_RANK;
- the data: every rank draws world_size x grad_accum micro-batches per step and keeps its share
  (`parallel.local_share`);
- its own `rank-R/` subdirectory of the run (plan.json, windows.jsonl) and of the NVMe tier;
- a failed collective (a peer died, or `dist.timeout_s` passed) becomes `RankFailureError`
  naming this rank and the step, on every surviving rank.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from lazytrain.config import apply_overrides
from lazytrain.dist import parallel, shared_masters
from lazytrain.dist.process_group import (DistContext, barrier, broadcast_object,
                                          init_from_env, shutdown)
from lazytrain.dist.shared_masters import OwnerUpdateError
from lazytrain.errors import JobFailure
from lazytrain.planner.build import hardware_from_config
from lazytrain.runtime.build import device_type, resolve_device

T = TypeVar("T")


def rank_seed(seed: int, rank: int) -> int:
    """The engine's RNG seed on `rank`: different per rank, so the ranks' micro-batches get
    independent dropout masks (one seed everywhere would repeat rank 0's masks on every rank).
    Rank 0 keeps `seed`. The model's initial weights use `seed` on every rank (equal masters)."""
    return seed + 1_000_003 * rank


class RankFailureError(JobFailure, RuntimeError):
    """A collective failed on this rank: a peer died or the collective timed out."""


@dataclass(frozen=True, slots=True)
class DataParallelRank:
    """The rank context of one rank of a data-parallel job (module docstring)."""

    groups: DistContext
    """Process groups and rank layout (`process_group.init_from_env`)."""
    timeout_s: float
    """`dist.timeout_s`, named in a rank failure's message."""
    device: str = "cpu"
    """The engine's torch device type: on "cuda" the rank runs on GPU LOCAL_RANK."""

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    @property
    def local_rank(self) -> int:
        return self.groups.local_rank

    @property
    def node_rank(self) -> int:
        return self.groups.node_rank

    @property
    def nnodes(self) -> int:
        return self.groups.nnodes

    @property
    def is_main(self) -> bool:
        return self.groups.is_main

    @property
    def subdir(self) -> str:
        return f"rank-{self.groups.rank}"

    @property
    def device_index(self) -> int | None:
        return self.groups.local_rank if self.device == "cuda" else None

    def all_sum(self, value: float) -> float:
        """`value` summed over the ranks (float64 on the `grads` group)."""
        if not self.groups.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.groups.grads_group)
        return float(t.item())

    def barrier(self) -> None:
        barrier(self.groups)

    def broadcast_object(self, obj: Any) -> Any:
        return broadcast_object(self.groups, obj)

    def seed(self, seed: int) -> int:
        return rank_seed(seed, self.groups.rank)

    def local_share(self, items: Sequence[T], *, grad_accum: int) -> list[T]:
        return parallel.local_share(items, ctx=self.groups, grad_accum=grad_accum)

    def master_store(self, *, shared: bool, shm_dir: str | Path) -> dict:
        if not shared_masters.enabled(self.groups, shared):
            return {}
        return shared_masters.node_store(self.groups, shm_dir=shm_dir)

    def engine_parts(self, adapter, *, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float, shared_masters: bool) -> dict:
        return parallel.engine_parts(adapter, ctx=self.groups, lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, shared_masters=shared_masters)

    def failure(self, exc: BaseException, *, step: int,
                last_checkpoint: Path | None) -> BaseException | None:
        """`RankFailureError` naming this rank, the step, the cause and the checkpoint to
        resume from."""
        cause = ("another rank's optimizer step failed" if isinstance(exc, OwnerUpdateError)
                 else f"a collective failed (a peer rank died, or waited longer than "
                      f"dist.timeout_s={self.timeout_s:g} s)")
        return RankFailureError(
            f"rank {self.rank} of {self.world_size}: {cause} at step {step}; the last "
            f"complete checkpoint is {last_checkpoint or 'none'}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}")

    def shutdown(self) -> None:
        shutdown(self.groups)



def launch_config(cfg, ctx: DistContext, log):
    """`cfg` with `dist.nproc_per_node` and `dist.nnodes` set to what torchrun started (and
    `hardware.gpus_per_node` raised to the ranks per node when the preset has fewer), so each
    rank's plan gets its real share of the node and of the job
    (`planner.build.rank_problem_from_config`)."""
    n = ctx.local_world_size
    sets = [] if cfg.dist.nproc_per_node == n else [f"dist.nproc_per_node={n}"]
    if cfg.dist.nnodes != ctx.nnodes:
        sets.append(f"dist.nnodes={ctx.nnodes}")
    if (cfg.hardware.gpus_per_node or hardware_from_config(cfg).gpus_per_node) < n:
        sets.append(f"hardware.gpus_per_node={n}")
    if not sets:
        return cfg
    log(f"note: torchrun started {ctx.nnodes} node(s) x {n} ranks; planning with "
        f"{', '.join(sets)}")
    return apply_overrides(cfg, sets)


def check_shared_run_dir(ctx: DistContext, run_dir: Path) -> None:
    """Collective: every rank must see rank 0's run directory (checkpoints are written there by
    all ranks, metrics by rank 0); on several hosts it must be on a shared file system.

    Raises:
        RuntimeError: on every rank, naming the ranks that do not see it and the fix.
    """
    token = broadcast_object(ctx, uuid.uuid4().hex if ctx.is_main else None)
    probe = run_dir / f".lazytrain-rank0-{token}"
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    barrier(ctx)
    try:
        seen = probe.is_file() and probe.read_text() == token
    except OSError:
        seen = False
    flags: list = [None] * ctx.world_size
    dist.all_gather_object(flags, (ctx.rank, ctx.node_rank, seen), group=ctx.grads_group)
    if ctx.is_main:
        probe.unlink(missing_ok=True)
    blind = [(r, n) for r, n, ok in flags if not ok]
    if blind:
        names = ", ".join(f"rank {r} (node {n})" for r, n in blind)
        raise RuntimeError(f"train.run_dir {run_dir} is not shared: {names} cannot see the file "
                           f"rank 0 wrote there; every rank writes its checkpoint shard into "
                           f"it, so on several hosts put it on a shared file system (NFS, "
                           f"Lustre) and pass the same path on every node")


def join(cfg, *, run_dir: Path, log: Callable[[str], None]) -> tuple[DataParallelRank, Any]:
    """Join the job torchrun started: this rank's context and the config with its share of the
    node (`launch_config`, said in one line by rank 0); checks the shared run directory.

    Raises:
        ValueError: a bad `dist.backend`; RuntimeError: the rendezvous failed or timed out, or
            a rank does not see `run_dir` (`check_shared_run_dir`).
    """
    device = device_type(resolve_device(cfg.runtime.device))
    ctx = init_from_env(backend=cfg.dist.backend, device=device, timeout_s=cfg.dist.timeout_s)
    cfg = launch_config(cfg, ctx, log if ctx.is_main else (lambda msg: None))
    check_shared_run_dir(ctx, run_dir)
    return DataParallelRank(ctx, timeout_s=cfg.dist.timeout_s, device=device), cfg
