"""ZeRO-1 optimizer-state sharding: each parameter group (a block, or the ends) has one owner
rank, which alone holds its AdamW moments and steps it; the updated fp32 master is then
broadcast from the owner to every rank.

Why ZeRO-1 by group, and not shared host memory between local ranks: every rank streams every
block's weights to its own GPU, so every rank needs the masters readable, but only one rank needs
each block's Adam moments. Sharding the moments by group keeps the engine's flat per-group
buffers and its per-block update pipeline unchanged (the owner steps group j as soon as its
reduced gradient is in, exactly like one process), needs only `torch.distributed` collectives
(reduce + broadcast, no shared-memory protocol of our own), and works across nodes. Sharing one
master copy per node in shared memory would save more DRAM but needs a cross-process update
protocol; it is left for later (TODO(#6)).

DRAM per rank, fp32 masters (P parameters, N ranks; staging pools not counted):
    master 4 P + gradient accumulator 4 P + Adam m, v 8 P / N   = (8 + 8/N) P bytes
    (one process: 16 P). SmolLM2-135M (P = 134.5e6): N=1 2.15 GB, N=2 1.61 GB, N=8 1.21 GB.
  With bf16 masters (the planner's 12 B/param row; the engine implements fp32 only):
    (2 + 2 + 8/N) P; Qwen3.5-27B (P = 26.90e9): N=1 323 GB, N=4 161 GB, N=8 134.5 GB.
`lazytrain.planner.topology.host_bytes_per_param_rank` is the same formula for the planner.

Ownership (`assign_owners`): greedy by size in group order, each group to the rank with the
fewest owned elements so far (ties: lowest rank): deterministic, and balances both the moments'
bytes and the optimizer work. Traffic per step per rank: the reduce of a group's fp32 gradient to
its owner, then the broadcast of its fp32 master: together the 2 (N-1)/N x 4 P bytes of a ring
all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lazytrain.runtime.optim import BlockOptimizer
from lazytrain.runtime.params import HostParams, ParamGroup


def assign_owners(numels: dict[str, int], world_size: int) -> dict[str, int]:
    """Group name -> owner rank (module docstring: greedy by size, in the given order).

    Args:
        numels: group name -> elements, in group order (blocks 0..L-1, then ends).
        world_size: number of ranks, >= 1.
    """
    load = [0] * world_size
    owners = {}
    for name, n in numels.items():
        r = min(range(world_size), key=lambda k: (load[k], k))
        owners[name] = r
        load[r] += n
    return owners


def group_owners(params: HostParams, world_size: int) -> dict[str, int]:
    """`assign_owners` over the groups of `params` (blocks in order, then ends)."""
    return assign_owners({g.name: g.numel for g in params.groups}, world_size)


class ShardedOptimizer(BlockOptimizer):
    """`BlockOptimizer` whose updates run only on the owner of each group.

    A queued update of group g (on the worker thread, in submission order, which is the same on
    every rank): wait for g's gradient reduction (`reducer.wait`), step AdamW if this rank owns g
    (non-owners never create moments for g: torch's AdamW allocates them at the first step),
    then broadcast g's master from its owner over the `params` gloo group.

    Args:
        params: the host store (masters and gradient accumulators of every group).
        reducer: the `GradReducer` whose pending reductions the updates wait for.
        owners: group name -> owner rank (`group_owners`).
        rank: this process's rank.
        params_group: gloo group for the broadcasts (None: one process, no broadcast).
        lr, betas, eps, weight_decay: AdamW (torch semantics).
    """

    def __init__(self, params: HostParams, *, reducer, owners: dict[str, int], rank: int,
                 params_group=None, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.reducer, self.owners, self.rank = reducer, owners, rank
        self.params_group = params_group

    def owns(self, group: ParamGroup) -> bool:
        return self.owners[group.name] == self.rank

    def _update(self, group: ParamGroup, lr: float, grad_scale: float) -> None:
        self.reducer.wait(group)  # the owner's accumulator now holds the global gradient
        if self.owns(group):
            super()._update(group, lr, grad_scale)
        if self.params_group is not None:
            dist.broadcast(group.master, src=self.owners[group.name], group=self.params_group)

    def state_dict(self) -> dict:
        """AdamW states of the owned groups only (this rank's shard)."""
        self.wait_all()
        return {name: opt.state_dict() for name, opt in self.optims.items()
                if self.owners[name] == self.rank}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard.

        Raises:
            ValueError: the shard's groups are not the groups this rank owns (another world
                size or model).
        """
        self.wait_all()
        mine = {n for n, r in self.owners.items() if r == self.rank}
        if set(state) != mine:
            raise ValueError(f"optimizer shard holds groups {sorted(state)}, but rank "
                             f"{self.rank} owns {sorted(mine)}; resume with the same world size")
        for name in mine:
            self.optims[name].load_state_dict(state[name])


def owned_moment_bytes(optimizer: BlockOptimizer) -> int:
    """Bytes of AdamW state tensors this process holds (tests: sharding really saves DRAM)."""
    total = 0
    for opt in optimizer.optims.values():
        for st in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total
