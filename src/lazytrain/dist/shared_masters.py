"""One master copy per node (fp32 or bf16, `train.master_dtype`), shared by the node's ranks, and
how an update reaches them.

Why: every data-parallel rank streams every block's weights to its GPU, so every rank must read
every master; with private copies a node of N ranks holds N identical masters. For the seed
scenario (Qwen3.6-27B, 26.90e9 params, bf16 layout 2 B master + 2 B grad + 8 B Adam moments) on
8 x H800 sharing 1 TB that is 8 x 2 + 8 x 2 + 8 = 40 B/param per node (134.5 GB a rank, over
the 125 GB share); one shared master makes it 2 + 8 x 2 + 8 = 26 B/param (87.4 GB a rank).
In the engine's fp32 layout (SmolLM2-135M, P = 134.5e6, N = 2 ranks on one node, 4 B master +
4 B grad + 8 B moments): private 2 x (4 + 4) + 8 = 24 B/param (3.23 GB a node), shared
4 + 2 x 4 + 8 = 20 B/param (2.69 GB).

Memory: local rank 0 of each node creates
`dist.shm_dir/lazytrain-<job>-node<k>-pid<p>-masters.bin`
(tmpfs), reserves its pages with posix_fallocate (a full tmpfs fails here with a clear error,
not later with SIGBUS), and every local rank maps it with `torch.from_file(shared=True)`;
once all have mapped it, local rank 0 unlinks it, so the memory goes away with the last
process, whatever way the job ends. A job killed between creation and unlink leaves the file;
the next job's local rank 0 removes such leftovers of dead creators (`remove_stale_files`,
the pid in the name). Local rank 0 writes the initial weights
(`HostParams.fills_masters`); the others wait at a barrier before reading them.

Updates (`SharedMasterSync.publish`, on the optimizer worker thread, in the same group order on
every rank, after the group's reduced gradient is in):
  1. the owner has stepped AdamW in place on its node's copy;
  2. more than one node: the owner broadcasts the master over its `cross` group (the ranks with
     its local index, one per node), which writes it into every other node's copy once;
  3. more than one rank on the node: the node's writer (the owner, or the rank that received
     the broadcast) broadcasts a 1-element token over the `node` group; the node's other ranks
     return from `publish` only then, so their next weight load of the group (which waits for
     the update) reads the new master.
Why the in-place update cannot race with a reader: the owner's reduction of group g completes
only after every rank contributed g's final gradient, i.e. after every rank finished the last
backward that reads g's master in this step; the next read (the next step's load of g) waits
for step 3. Traffic per group: reduce (W-1)/W x 4 B x P plus, across nodes only,
(nnodes-1)/nnodes x 4 B x P (`lazytrain.planner.topology`).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from lazytrain.dist.process_group import DistContext, barrier, broadcast_object
from lazytrain.errors import JobFailure
from lazytrain.models.host_params import ParamGroup


def enabled(ctx: DistContext, shared_masters: bool) -> bool:
    """True when the node's ranks share one master copy (`dist.shared_masters` and more than
    one rank on the node; a lone rank gains nothing from a shared mapping)."""
    return bool(shared_masters) and ctx.distributed and ctx.local_world_size > 1


def new_job_id(ctx: DistContext) -> str:
    """A random id from rank 0, the same on every rank (collective): names the shared files."""
    return broadcast_object(ctx, uuid.uuid4().hex[:12] if ctx.is_main else None)


def master_file(shm_dir: str | Path, job_id: str, node_rank: int, *,
                pid: int | None = None) -> Path:
    """The node's file; named after the creating process so a later job can tell a leftover
    (its creator is dead) from a live job's file (`remove_stale_files`)."""
    pid = os.getpid() if pid is None else pid
    return Path(shm_dir) / f"lazytrain-{job_id}-node{node_rank}-pid{pid}-masters.bin"


_STALE_RE = re.compile(r"^lazytrain-[0-9a-f]+-node\d+-pid(\d+)-masters\.bin$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_files(shm_dir: str | Path) -> list[Path]:
    """Unlink this user's shared-master files whose creating process is gone.

    A file lives only between its creation and the moment every local rank has mapped it; a job
    killed in between (SIGKILL, OOM) leaves it behind, holding the master's bytes of tmpfs
    memory. Called by local rank 0 before it creates its own file. Returns the removed paths.
    """
    removed = []
    root = Path(shm_dir)
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        m = _STALE_RE.match(path.name)
        try:
            if m and path.stat().st_uid == os.getuid() and not _alive(int(m.group(1))):
                path.unlink()
                removed.append(path)
        except OSError:  # raced with another cleaner, or not ours to remove
            continue
    return removed


def _create(path: Path, nbytes: int) -> None:
    """Create `path` with `nbytes` reserved (local rank 0).

    Raises:
        ValueError: the directory is missing or has less than `nbytes` free.
        OSError: the file could not be created or reserved.
    """
    if not path.parent.is_dir():
        raise ValueError(f"dist.shm_dir {path.parent} is not a directory; point it at a tmpfs "
                         f"such as /dev/shm, or set dist.shared_masters: false")
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ValueError(f"dist.shm_dir {path.parent} has {free:,} bytes free; the node's "
                         f"shared masters need {nbytes:,} bytes ({nbytes / 1e9:.2f} GB): "
                         f"enlarge it (docker "
                         f"--shm-size, or mount a bigger tmpfs) or set dist.shared_masters: "
                         f"false (one private copy per rank)")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def node_master_allocator(ctx: DistContext, *, shm_dir: str | Path,
                          job_id: str) -> Callable[[int, torch.dtype], torch.Tensor]:
    """The `masters` callable of `HostParams`: (elements, dtype) -> [elements] tensor mapped
    from the node's shared file (module docstring). Collective: every rank calls it once, at
    the same point.

    Raises:
        RuntimeError: on every rank, when local rank 0 of some node could not create its file
            (names the node, the directory and the fix).
    """
    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        pids: list = [None] * ctx.world_size  # the creator's pid names the node's file
        dist.all_gather_object(pids, os.getpid(), group=ctx.grads_group)
        creator = pids[ctx.global_rank(node=ctx.node_rank, local=0)]
        path = master_file(shm_dir, job_id, ctx.node_rank, pid=creator)
        error = None
        if ctx.local_rank == 0:
            try:
                remove_stale_files(shm_dir)
                _create(path, numel * dtype.itemsize)
            except (OSError, ValueError) as exc:
                error = f"node {ctx.node_rank}: {exc}"
        try:
            errors: list = [None] * ctx.world_size
            dist.all_gather_object(errors, error, group=ctx.grads_group)
            failed = [e for e in errors if e]
            if failed:
                raise RuntimeError(f"shared masters: {failed[0]}")
            try:
                flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
            finally:
                barrier(ctx)  # every local rank has mapped the file (or failed trying)
        finally:  # whatever happened (another node failed, a peer died, SIGTERM from torchrun)
            if ctx.local_rank == 0:
                path.unlink(missing_ok=True)  # the mappings keep the memory alive
        return flat

    return allocate


def node_store(ctx: DistContext, *, shm_dir: str | Path) -> dict:
    """The `masters` and `fills_masters` arguments of the model loaders (`HostParams`) that
    put this rank's masters in its node's shared copy: a fresh job id, the allocator, and
    local rank 0 as the one writer. Collective (every rank, same point); after loading, the
    caller must `barrier` before any rank reads the masters."""
    return {"masters": node_master_allocator(ctx, shm_dir=shm_dir, job_id=new_job_id(ctx)),
            "fills_masters": ctx.local_rank == 0}


class SharedMasterSync:
    """Step 2-3 of the module docstring for one rank.

    Args:
        ctx: the rank context (its `node_group` and `cross_group`).
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx

    def publish(self, group: ParamGroup, owner: int, *, failed: bool = False) -> None:
        """Make the owner's in-place update of `group.master` visible on every rank; returns
        when this rank's node copy holds it (worker thread, the same group order everywhere).
        The tokens carry `failed` (the owner's update raised): every rank then raises at once
        instead of waiting `dist.timeout_s` for an update that will not come.

        Raises:
            OwnerUpdateError: on the other ranks, when the owner's update failed.
        """
        ctx = self.ctx
        _, owner_local = ctx.node_of(owner)
        status = torch.tensor([1.0 if failed else 0.0])
        if ctx.nnodes > 1 and ctx.local_rank == owner_local:
            dist.broadcast(status, src=owner, group=ctx.cross_group)
            if not status.item():
                dist.broadcast(group.master, src=owner, group=ctx.cross_group)
        if ctx.local_world_size > 1:
            writer = ctx.global_rank(node=ctx.node_rank, local=owner_local)
            dist.broadcast(status, src=writer, group=ctx.node_group)
        _raise_if_failed(status, group, owner, ctx.rank)


class BroadcastSync:
    """Private masters: the owner broadcasts the updated master to every rank (`params` group).

    Args:
        params_group: gloo group of every rank.
    """

    def __init__(self, params_group) -> None:
        self.params_group = params_group

    def publish(self, group: ParamGroup, owner: int, *, failed: bool = False) -> None:
        """As `SharedMasterSync.publish`, by a status then a master broadcast from the owner."""
        status = torch.tensor([1.0 if failed else 0.0])
        dist.broadcast(status, src=owner, group=self.params_group)
        if not status.item():
            dist.broadcast(group.master, src=owner, group=self.params_group)
        _raise_if_failed(status, group, owner, dist.get_rank())


class OwnerUpdateError(JobFailure, RuntimeError):
    """The owner of a parameter group failed to update it (its own error is on its rank)."""


def _raise_if_failed(status: torch.Tensor, group: ParamGroup, owner: int, rank: int) -> None:
    if status.item() and rank != owner:
        raise OwnerUpdateError(f"rank {owner} failed to update {group.name} (its optimizer "
                               f"step raised; see rank {owner}'s error)")
