"""The weight path of each block (how its weights reach the device) and what it costs in memory.

Owns `with_weight_paths`, the one way a problem takes a path vector: it sets
`PlanningProblem.weight_paths` and folds the paths' memory into the problem's constant pools,
so the evaluator, the MILP, the heuristics and the simulator read the paths' memory where they
already read the fixed pools, and their per-load bytes from `PlanningProblem.load_bytes` /
`convert_bytes`:

- host_convert: no extra memory (today's staging ring).
- pinned_copy: with masters in another dtype than the compute dtype, a pinned compute-dtype
  copy of the block, P[j] bytes of DRAM (pinned); with masters in the compute dtype, the
  masters themselves are page-locked in place: no extra DRAM.
- gpu_cast: `GPU_CAST_LANDING_SLOTS` device landing buffers of the largest gpu_cast block's
  master bytes (P[j] x `master_bytes_ratio`), in HBM, whatever the number of such blocks.

Pure Python; no solver, no torch. Source: docs/execution_model.md, "Weight paths".
"""

from __future__ import annotations

from lazytrain.contract import GPU_CAST_LANDING_SLOTS, WEIGHT_PATH_NAMES
from lazytrain.planner.problem import PlanningProblem


def path_memory_bytes(problem: PlanningProblem, paths) -> tuple[int, int]:
    """(HBM, DRAM) bytes the weight paths `paths` (one per block) add, bytes: the gpu_cast
    landing slots and the pinned compute-dtype copies (module docstring)."""
    P, r = problem.weight_bytes, problem.master_bytes_ratio
    cast = [P[j] for j, path in enumerate(paths) if path == "gpu_cast"]
    hbm = int(GPU_CAST_LANDING_SLOTS * max(cast) * r) if cast else 0
    dram = 0 if r == 1 else sum(P[j] for j, path in enumerate(paths) if path == "pinned_copy")
    return hbm, int(dram)


def with_weight_paths(problem: PlanningProblem, paths) -> PlanningProblem:
    """`problem` with weight path `paths[j]` for block j and the paths' memory in its fixed
    pools (replacing what a previous path vector added, so it can be applied again).

    Args:
        problem: the planning problem.
        paths: one of `WEIGHT_PATH_NAMES` per block; empty: every block host_convert.

    Raises:
        ValueError: wrong length or an unknown path (naming the known ones).
    """
    paths = tuple(paths)
    if paths == problem.weight_paths:
        return problem
    bad = sorted(set(paths) - set(WEIGHT_PATH_NAMES))
    if bad or len(paths) not in (0, problem.num_blocks):
        raise ValueError(f"weight_paths: {len(paths)} entries with unknown {bad}; give one of "
                         f"{WEIGHT_PATH_NAMES} per block ({problem.num_blocks})")
    hbm, dram = path_memory_bytes(problem, paths)
    return problem.replace(
        weight_paths=paths,
        fixed_hbm_bytes=problem.fixed_hbm_bytes - problem.weight_path_hbm_bytes + hbm,
        nvme_staging_bytes=problem.nvme_staging_bytes - problem.weight_path_dram_bytes + dram,
        weight_path_hbm_bytes=hbm, weight_path_dram_bytes=dram)


def host_free_paths(paths) -> bool:
    """True when no block converts its weights on the host."""
    return "host_convert" not in paths


def candidate_paths(problem: PlanningProblem) -> list[tuple[str, ...]]:
    """The path vectors the planner compares, host-free ones first (a tie keeps the earlier):
    masters in the compute dtype: pinned masters for every block (no memory, no host work:
    it dominates) and host_convert; otherwise every block pinned_copy, pinned_copy for the
    first n blocks whose copies fit the DRAM the states and pools leave (the rest gpu_cast,
    or host_convert), every block gpu_cast, and every block host_convert."""
    L = problem.num_blocks
    if problem.master_bytes_ratio == 1:
        return [("pinned_copy",) * L, ("host_convert",) * L]
    states = problem.host_bytes_per_param * (sum(problem.params_per_block) + problem.ends_params)
    free = problem.dram_bytes - states - (problem.nvme_staging_bytes
                                          - problem.weight_path_dram_bytes)
    n, used = 0, 0
    while n < L and used + problem.weight_bytes[n] <= free:
        used += problem.weight_bytes[n]
        n += 1
    out = [("pinned_copy",) * L]
    if 0 < n < L:
        out += [("pinned_copy",) * n + ("gpu_cast",) * (L - n),
                ("pinned_copy",) * n + ("host_convert",) * (L - n)]
    out += [("gpu_cast",) * L, ("host_convert",) * L]
    return out
