"""Measure the save-level inputs per block kind: S1 / S2 bytes and the L1 re-forward's time.

Owns `save_level_entries`, what `profile/profiler.measure_profile` adds to each kind of the
profile's `block_kinds` (schema in `lazytrain.spec.costs`):

- `saved_l1_bytes`, `saved_l2_bytes`: the bytes the runtime's L1 / L2 forward keeps
  (`models/saved_tensors.forward_saving`, the engine's own saved-tensor hooks: every saved
  storage once, the block input, the flat weights and the kwargs tensors (rotary tables,
  masks) by reference, so not counted; L1 up to the token mixer's output, plus that output).
- `reforward_l1_ms`: what an L1 backward costs beyond an L2 one, `backward_saved` at L1 (the
  truncated re-forward with the token mixer stood in by its saved output, its backward, the
  kept mixer graph's backward) less `backward_saved` at L2 (the kept graph's backward, B), each
  on a fresh `forward_saving` (not timed), at least 0: the planner charges `B + Fr1` at L1 and
  `B` at L2 (docs/execution_model.md, "Save levels").
- `backward_l1_ms`, `backward_l2_ms`: those two series, a record.

A kind whose layer has no single token mixer (`saved_tensors.token_mixer`) gets the L2 bytes
only and no L1 entries: `profile_costs` then keeps the analytic S1 / Fr1 for it. Knows nothing
of plans or the planner.
"""

from __future__ import annotations

from typing import Sequence

from lazytrain.models.saved_tensors import backward_saved, forward_saving
from lazytrain.profile.bench_blocks import BlockBench, time_samples
from lazytrain.runtime.block_autograd import grad_leaves
from lazytrain.runtime.steady import Timing, median_timing


def saved_bytes(bench: BlockBench, j: int, level: str) -> int:
    """Bytes block j's `forward_saving` keeps at `level` ("L1" or "L2") for the bench's
    micro-batch (deterministic: measured once).

    Raises:
        ValueError: L1 on a layer without one token mixer (`saved_tensors.token_mixer`).
    """
    _out, saved = _forward(bench, j, level)
    return saved.nbytes


def _forward(bench: BlockBench, j: int, level: str):
    flat = bench.weights(j)
    group = bench.params.blocks[j]
    with bench.api.compute_scope():
        return forward_saving(bench.adapter, j, bench.h, grad_leaves(group, flat), flat,
                              bench.kwargs[j], level=level)


def backward_samples(bench: BlockBench, j: int, level: str, *, repeats: int,
                     warmup: int) -> list[float]:
    """The timed repeats of block j's `backward_saved` at `level`, ms: each on a fresh
    `forward_saving` (not timed) of the bench's micro-batch, the output gradient random."""
    flat = bench.weights(j)
    group = bench.params.blocks[j]
    pending = []

    def one_backward():
        saved = pending.pop()
        with bench.api.compute_scope():
            backward_saved(bench.adapter, j, saved, bench.h, grad_leaves(group, flat), flat,
                           bench.kwargs[j], bench.grad_out)

    times = []
    for _ in range(warmup + max(1, repeats)):
        pending.append(_forward(bench, j, level)[1])
        times.append(time_samples(one_backward, device=bench.device, repeats=1, warmup=0)[0])
    return times[warmup:]


def save_level_entries(bench: BlockBench, kinds: Sequence[str], *, repeats: int = 5,
                       warmup: int = 2, timing: Timing = median_timing,
                       log=lambda _msg: None) -> dict[str, dict]:
    """Per block kind (first block of each kind): saved_l2_bytes and, where the layer has a
    token mixer, saved_l1_bytes, reforward_l1_ms, backward_l1_ms and backward_l2_ms (module
    docstring).

    Args:
        bench: the micro-batch and weights (`profile/bench_blocks.BlockBench`).
        kinds: `BlockSpec.kind` of each block (len L).
        repeats, warmup: timed and untimed runs per series.
        timing: how a try's repeats become one time (`runtime.steady`).
        log: progress lines (stderr in the CLI).
    """
    out: dict[str, dict] = {}
    for kind in dict.fromkeys(kinds):
        j = list(kinds).index(kind)
        entry = {"saved_l2_bytes": saved_bytes(bench, j, "L2")}
        try:
            entry["saved_l1_bytes"] = saved_bytes(bench, j, "L1")
        except ValueError as exc:  # no single token mixer: L1 not available for this kind
            log(f"profile: block kind {kind}: {exc}")
            out[kind] = entry
            continue
        times = timing(lambda: {
            level_key: backward_samples(bench, j, level, repeats=repeats, warmup=warmup)
            for level_key, level in (("backward_l1_ms", "L1"), ("backward_l2_ms", "L2"))},
            f"save levels of block kind {kind}")
        entry.update(times)
        entry["reforward_l1_ms"] = max(0.0, times["backward_l1_ms"] - times["backward_l2_ms"])
        out[kind] = entry
    return out
