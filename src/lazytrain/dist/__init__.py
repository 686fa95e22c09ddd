"""Data parallelism over `torch.distributed`: process groups, per-block gradient reduction,
ZeRO-1 optimizer-state sharding, sharded checkpoints and the torchrun training entry.

Modules: `process_group` (init from torchrun's environment, timeouts, the rank context),
`sharding` (which rank owns which parameter group; the sharded optimizer), `reducer` (the
engine's `grad_sync` hook), `checkpoint` (per-rank shards + a rank-0 marker), `trainer` (the
train loop's data-parallel variant). The planner side (shared host resources) is
`lazytrain.planner.topology`, which imports no torch.
"""
