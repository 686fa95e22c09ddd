"""Where the costs come from: measuring this machine's cost model and reading it back.

`profiler` measures a model's profile through the engine's own code paths (`bench_blocks`,
`bench_rates`, `overhead`); `calibrate` caches a quick profile per machine and model and
resolves which costs a plan uses. The measuring modules import torch; the cache reader and
the costed planning problem do not, so `lazytrain plan`, `simulate` and `report` stay
torch-free.
"""
