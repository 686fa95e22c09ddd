"""ZeRO-1 optimizer-state sharding: each parameter group (a block, or the ends) has one owner
rank, which alone holds its AdamW moments and steps it; the updated fp32 master then reaches
every rank (`lazytrain.dist.shared_masters`: in place in the node's shared copy, plus a
broadcast across nodes; or a broadcast to every private copy).

Which memory is shared and which sharded, and why: every rank streams every block's weights to
its own GPU, so every rank needs every master readable: the node keeps ONE master copy in shared
memory (`dist.shared_masters`, default). Only one rank needs each block's Adam moments: they
are sharded by group over all ranks of the job (ZeRO-1), which keeps the engine's flat
per-group buffers and its per-block update pipeline unchanged (the owner steps group j as soon
as its reduced gradient is in, exactly like one process) and works across nodes. Gradient
accumulators stay per rank (each rank accumulates its own micro-batches' gradient before the
reduction).

DRAM per rank (P parameters, N ranks on the node, W in the job; staging pools not counted):
    fp32 (the engine): master 4 P / N (shared; 4 P private) + gradient 4 P + Adam m, v 8 P / W
      SmolLM2-135M (P = 134.5e6), one node (N = W):
        N=1 16 B/param 2.15 GB; N=2 shared 10 B 1.35 GB (private 12 B 1.61 GB);
        N=8 shared 5.5 B 0.74 GB (private 9 B 1.21 GB).
    bf16 (the planner's 12 B/param MegaTrain row; the engine implements fp32 only):
    master 2 P / N + gradient 2 P + 8 P / W
      Qwen3.6-27B (P = 26.90e9), 1 TB node: N=1 12 B 323 GB; N=4 shared 4.5 B 121 GB (private
      6 B 161 GB); N=8 shared 3.25 B 87.4 GB (private 5 B 134.5 GB, over the 125 GB share).
`lazytrain.planner.topology` uses the same accounting for the per-rank plan.

Ownership (`lazytrain.planner.topology.assign_owners`, which the planner also charges): largest
group first, each to the rank with the fewest owned elements so far: deterministic, and
balances both the moments' bytes and the optimizer work. Traffic per step per rank (W ranks, M nodes): the reduce of a
group's fp32 gradient to its owner, (W-1)/W x 4 P bytes, then the master's way back: across nodes
only with shared masters, (M-1)/M x 4 P; to every private copy otherwise, (W-1)/W x 4 P (the two
halves of a ring all-reduce).
"""

from __future__ import annotations

import torch

from lazytrain.models.host_params import HostParams, ParamGroup
from lazytrain.planner.topology import assign_owners
from lazytrain.runtime.optim import BlockOptimizer


def group_owners(params: HostParams, world_size: int) -> dict[str, int]:
    """`assign_owners` over the groups of `params` (blocks in order, then ends)."""
    return assign_owners({g.name: g.numel for g in params.groups}, world_size)


class ShardedOptimizer(BlockOptimizer):
    """`BlockOptimizer` whose updates run only on the owner of each group.

    A queued update of group g (on the worker thread, in submission order, which is the same on
    every rank): wait for g's gradient reduction (`reducer.wait`), step AdamW if this rank owns g
    (non-owners never create moments for g: torch's AdamW allocates them at the first step),
    then `sync.publish(g, owner)`: the updated master reaches every rank.

    Args:
        params: the host store (masters and gradient accumulators of every group).
        reducer: the `GradReducer` whose pending reductions the updates wait for.
        owners: group name -> owner rank (`group_owners`).
        rank: this process's rank.
        sync: `shared_masters.SharedMasterSync` or `BroadcastSync` (None: one process).
        lr, betas, eps, weight_decay: AdamW (torch semantics).
    """

    def __init__(self, params: HostParams, *, reducer, owners: dict[str, int], rank: int,
                 sync=None, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.reducer, self.owners, self.rank = reducer, owners, rank
        self.sync = sync

    def owns(self, group: ParamGroup) -> bool:
        return self.owners[group.name] == self.rank

    def _update(self, group: ParamGroup, lr: float, grad_scale: float) -> None:
        self.reducer.wait(group)  # the owner's accumulator now holds the global gradient
        error = None
        if self.owns(group):
            try:
                super()._update(group, lr, grad_scale)
            except Exception as exc:  # tell the others before raising (no timeout wait)
                error = exc
        if self.sync is not None:
            self.sync.publish(group, self.owners[group.name], failed=error is not None)
        if error is not None:
            raise error

    def state_dict(self) -> dict:
        """AdamW states of the owned groups only (this rank's shard)."""
        return {name: sd for name, sd in super().state_dict().items()
                if self.owners[name] == self.rank}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard.

        Raises:
            ValueError: the shard's groups are not the groups this rank owns (another world
                size or model).
        """
        mine = {n for n, r in self.owners.items() if r == self.rank}
        if set(state) != mine:
            raise ValueError(f"optimizer shard holds groups {sorted(state)}, but rank "
                             f"{self.rank} owns {sorted(mine)}: the checkpoint was written by "
                             f"another world size, or by a LazyTrain with another ownership "
                             f"rule (largest group first since this version); resume with the "
                             f"same world size and version")
        super().load_state_dict(state)  # converts groups saved in the other precision


def owned_moment_bytes(optimizer: BlockOptimizer) -> int:
    """Bytes of AdamW state tensors this process holds (tests: sharding really saves DRAM)."""
    total = 0
    for opt in optimizer.optims.values():
        for st in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total
