"""The rank context a `Trainer` runs under: where this process sits in the job and the few
collective steps the training loop takes.

`RankContext` is the interface; `OneProcess` is the trivial context of a single process (world
1: sums and broadcasts return their input, barriers return at once, a step's micro-batches are
all this process's). The data-parallel context over `torch.distributed` is
`lazytrain.dist.rank.DataParallelRank`; `join_job` picks the one torchrun's environment asks
for. The trainer asks the context and never tests "is this data-parallel?" itself.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TypeVar

from lazytrain.config import apply_overrides
from lazytrain.dist.process_group import env_world_size
from lazytrain.dist.rank import join

T = TypeVar("T")


class RankContext(Protocol):
    """What the trainer and the checkpoint protocol need to know of the job's ranks."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Ranks in the job."""
    local_rank: int
    """Rank on this node (takes the node's NVMe lock when 0)."""
    node_rank: int
    """Index of this node."""
    nnodes: int
    """Nodes in the job."""
    is_main: bool
    """Rank 0: logs, evaluates, writes metrics, summary, plan and checkpoint markers."""
    subdir: str
    """This rank's own subdirectory of the run and NVMe directories ("" for one process,
    "rank-R" for rank R): its plan.json, windows.jsonl and NVMe files."""
    device_index: int | None
    """The CUDA device of this rank (the local rank); None: the current device."""

    def all_sum(self, value: float) -> float:
        """`value` summed over the ranks (blocking)."""

    def barrier(self) -> None:
        """All ranks meet here."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; small objects)."""

    def seed(self, seed: int) -> int:
        """The engine's RNG seed on this rank (rank 0 keeps `seed`)."""

    def local_share(self, items: Sequence[T], *, grad_accum: int) -> list[T]:
        """This rank's `grad_accum` micro-batches out of a step's world_size x grad_accum."""

    def master_store(self, *, shared: bool, shm_dir: str | Path) -> dict:
        """`model_source.load_adapter` arguments placing the masters in the node's shared memory
        (`dist.shared_masters`), or {} for private masters. When not {}, the caller meets the
        node's ranks at a barrier after loading, so local rank 0 has written them."""

    def engine_parts(self, adapter, *, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float, shared_masters: bool) -> dict:
        """`Engine` arguments of this rank's gradient reduction and sharded optimizer, or {}."""

    def failure(self, exc: BaseException, *, step: int,
                last_checkpoint: Path | None) -> BaseException | None:
        """The error to raise for `exc`, caught around a collective at `step`: a rank failure
        naming this rank, the step and `last_checkpoint`; None: re-raise `exc` as it is."""

    def shutdown(self) -> None:
        """Leave the job (after the last collective)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class OneProcess:
    """The rank context of a single process (module docstring)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    nnodes: int = 1
    is_main: bool = True
    subdir: str = ""
    device_index: int | None = None

    def all_sum(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        return None

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def seed(self, seed: int) -> int:
        return seed

    def local_share(self, items: Sequence[T], *, grad_accum: int) -> list[T]:
        """All of `items`.

        Raises:
            ValueError: `items` is not `grad_accum` long.
        """
        if len(items) != grad_accum:
            raise ValueError(f"a step needs {grad_accum} micro-batches; got {len(items)}")
        return list(items)

    def master_store(self, *, shared: bool, shm_dir: str | Path) -> dict:
        return {}  # a lone process gains nothing from a shared mapping

    def engine_parts(self, adapter, *, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float, shared_masters: bool) -> dict:
        return {}  # the engine's own BlockOptimizer, no reduction

    def failure(self, exc: BaseException, *, step: int,
                last_checkpoint: Path | None) -> BaseException | None:
        return None

    def shutdown(self) -> None:
        return None


ONE_PROCESS = OneProcess()
"""The context of a single process."""


def launched_rank() -> int:
    """This process's rank as torchrun's environment gives it (RANK; 0 for one process), for
    what happens before the job is joined: rank 0 alone locks and clears the run directory."""
    return int(os.environ.get("RANK", "0"))


def join_job(cfg, *, run_dir: Path, log: Callable[[str], None]) -> tuple[RankContext, Any]:
    """This process's rank context and its config: the data-parallel context when torchrun
    started it (WORLD_SIZE > 1: `lazytrain.dist.rank.join` joins the process groups, sets the
    config's share of the node and checks that every rank sees `run_dir`), else `ONE_PROCESS`,
    with `dist.nproc_per_node` and `dist.nnodes` set to 1 (one process plans the whole node).

    Raises:
        ValueError: a bad `dist.backend`; RuntimeError: the rendezvous failed, or a rank does
            not see the run directory.
    """
    if env_world_size() > 1:
        return join(cfg, run_dir=run_dir, log=log)
    if cfg.dist.nproc_per_node > 1 or cfg.dist.nnodes > 1:
        log(f"note: not started by torchrun: one process plans the whole node "
            f"(dist.nproc_per_node {cfg.dist.nproc_per_node} -> 1, dist.nnodes "
            f"{cfg.dist.nnodes} -> 1)")
        cfg = apply_overrides(cfg, ["dist.nproc_per_node=1", "dist.nnodes=1"])
    return ONE_PROCESS, cfg


def quiet_unless_main(ctx: RankContext):
    """A context manager that silences stdout on ranks other than the main one."""
    return (contextlib.nullcontext() if ctx.is_main
            else contextlib.redirect_stdout(io.StringIO()))
