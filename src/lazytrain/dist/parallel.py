"""Wiring one rank's data-parallel engine: the reducer, the sharded optimizer, and this rank's
share of the global batch.

Global batch: every optimizer step consumes `world_size x grad_accum` micro-batches of the
configured shape, drawn in one order from the same data stream on every rank; rank r takes
micro-batches r*grad_accum .. (r+1)*grad_accum - 1. One process with `grad_accum x world_size`
micro-batches per step computes the same gradient (same plan: the micro-batch shape is the
plan's), which is what the equivalence tests check.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

from lazytrain.dist.process_group import DistContext
from lazytrain.dist.reducer import GradReducer
from lazytrain.dist.shared_masters import BroadcastSync, SharedMasterSync
from lazytrain.dist.sharding import ShardedOptimizer, group_owners
from lazytrain.runtime.build import make_engine

T = TypeVar("T")


def engine_parts(adapter, *, ctx: DistContext, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, shared_masters: bool = False) -> dict:
    """The `Engine` arguments of this rank: `GradReducer` as grad_sync and a `ShardedOptimizer`.

    Args:
        adapter: the model (its `params` are reduced and sharded).
        ctx: the rank context (`process_group.init_from_env`).
        lr, betas, eps, weight_decay: AdamW.
        shared_masters: the adapter's masters are the node's shared copy
            (`shared_masters.node_master_allocator`): updates are published in place; False:
            private copies, updates are broadcast.

    Returns:
        {"optimizer": ..., "grad_sync": ...}, to pass to `Engine`.
    """
    owners = group_owners(adapter.params, ctx.world_size)
    reducer = GradReducer(adapter.params, owners=owners, rank=ctx.rank,
                          group=ctx.grads_group if ctx.distributed else None)
    sync = None
    if ctx.distributed:
        sync = SharedMasterSync(ctx) if shared_masters else BroadcastSync(ctx.params_group)
    optimizer = ShardedOptimizer(adapter.params, reducer=reducer, owners=owners, rank=ctx.rank,
                                 sync=sync, lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay)
    return {"optimizer": optimizer, "grad_sync": reducer}


def build_engine(adapter, plan, *, ctx: DistContext, lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, shared_masters: bool = False,
                 **engine_kwargs):
    """An `Engine` for this rank over `engine_parts` (tests and benchmarks; the trainer builds
    its engine through `lazytrain.runtime.build.engine_from_config`).

    Args:
        adapter, plan: as `Engine`.
        ctx, lr, betas, eps, weight_decay, shared_masters: as `engine_parts`.
        engine_kwargs: the other `make_engine` arguments (device, clip_grad_norm, grad_accum,
            ...).
    """
    parts = engine_parts(adapter, ctx=ctx, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, shared_masters=shared_masters)
    return make_engine(adapter, plan, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                       **parts, **engine_kwargs)


def local_share(items: Sequence[T], *, ctx: DistContext, grad_accum: int) -> list[T]:
    """This rank's micro-batches out of the step's `world_size x grad_accum` (module docstring).

    Raises:
        ValueError: `items` is not world_size x grad_accum long.
    """
    if len(items) != ctx.world_size * grad_accum:
        raise ValueError(f"a step needs {ctx.world_size} x {grad_accum} micro-batches; "
                         f"got {len(items)}")
    return list(items[ctx.rank * grad_accum:(ctx.rank + 1) * grad_accum])
