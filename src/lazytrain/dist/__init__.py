"""Data parallelism over `torch.distributed`: process groups, per-block gradient reduction,
ZeRO-1 optimizer-state sharding, node-shared masters and the data-parallel rank context.

Modules: `process_group` (init from torchrun's environment, timeouts, the groups), `rank` (the
rank context the trainer runs under, `lazytrain.train.rank.RankContext`, and joining the job),
`sharding` (which rank owns which parameter group; the sharded optimizer), `reducer` (the
engine's `grad_sync` hook), `parallel` (the engine's data-parallel parts, this rank's share of a
step), `shared_masters` (one master copy per node). Imports neither `train` nor `cli`: the
trainer and the checkpoint protocol (`lazytrain.train`) take the rank context. The planner side (shared host resources) is
`lazytrain.planner.topology`, which imports no torch.
"""
