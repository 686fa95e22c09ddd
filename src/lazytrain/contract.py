"""The contract between planner and runtime: every number both sides must agree on, once.

The planner models the runtime's fixed buffers, host state and in-window order with these
numbers (`planner/build.py`, `planner/staging.py`, `planner/chains.py`, `spec/costs.py`,
`sim/`); the runtime allocates and orders by the same ones (`runtime/streams.py`,
`runtime/ends.py`, `runtime/activations.py`, `runtime/nvme.py`, `runtime/optim.py`,
`models/host_params.py`). Each side imports the name from here and restates nothing: a
change here moves both, and `tests/test_contract.py` builds the runtime's objects with their
defaults and the planner's memory model and checks each against this module.

Imports only the standard library (no torch, no solver), so every package may import it
(`tests/test_layering.py`).

Index legend: block j = 0..L-1; windows f0..f{L-1}, turn, b{L-1}..b0 (as in `planner/windows.py`).
"""

from __future__ import annotations

# --- device buffers (HBM) ---------------------------------------------------------------------

DEVICE_WEIGHT_SLOTS = 4
"""Device weight buffers of the engine's ring, each the largest block's compute-dtype weights:
two for double buffering (block j+1 loads while j runs), two so segment recompute loads are
double-buffered too. Runtime: `runtime/streams.py` `DeviceWeights(num_slots=...)` default.
Planner: `planner/build.py` counts this many x max P in `fixed_hbm_bytes`; the simulator's
`SimOptions.weight_buffers` default."""

DEVICE_GRAD_BUFFERS = 2
"""Block gradients the drain may still be copying while a block's backward runs: in window
b{j} the engine drains block j+1's gradient, and block j+2's copy may not have run yet (the
drain keeps GRAD_DRAIN_BUFFERS copies in flight; `runtime/engine.py`, backward loop). Block
j's own per-parameter gradients and their flat pack are in the block workspace
(`spec/costs.block_workspace_bytes`). Planner: `planner/build.py` counts this many x max G in
`fixed_hbm_bytes`; the simulator's `SimOptions.grad_buffers` default."""

HEAD_CHUNK_TOKENS = 1024
"""Default flattened tokens (micro-batch x positions) per LM-head/loss chunk: the logits exist
for [B, max(1, HEAD_CHUNK_TOKENS // B), V] at a time. Runtime: the default of
`runtime.head_chunk_tokens` (`config/sections.py`), of `EngineSettings(head_chunk_tokens=...)`
and the profiler's head (`runtime/ends.py`). Planner: the head workspace of `spec/costs.py`."""

ENDS_GRAD_BYTES_PER_PARAM = 4
"""The ends' (embedding, final norm, untied head) device gradient is one fp32 accumulator,
bytes per parameter, whatever the compute dtype. Runtime: `runtime/ends.py`
`ResidentEnds.reset_gradient`. Planner: `planner/build.py` `ends_bytes`."""

WEIGHT_PATH_NAMES = ("host_convert", "pinned_copy", "gpu_cast")
"""How a block's weights reach the device, per block (Plan JSON `weight_paths`; absent: every
block "host_convert"): the master converted to the compute dtype on the host into a staging
buffer per load; an H2D from a pinned compute-dtype copy the optimizer refreshes in its update
(with masters already in the compute dtype: from the pinned masters themselves, no copy); the
master's H2D into an fp32 landing slot and a cast on the device. Runtime: `runtime/streams.py`
`DeviceWeights`, `runtime/optim.py`; planner: `planner/weight_paths.py`, PlanningProblem
`load_bytes` / `convert_bytes`."""

GPU_CAST_LANDING_SLOTS = DEVICE_WEIGHT_SLOTS
"""Device landing buffers (master dtype, the largest gpu_cast block each) the gpu_cast path
lands masters in before the cast into a weight slot: one per weight slot, since every load in
flight (prefetch, recompute reloads) may hold one until its block's compute casts it. Runtime: `runtime/streams.py` `DeviceWeights`; planner: `planner/weight_paths.py` counts
this many in `fixed_hbm_bytes`."""

# --- host state (DRAM) ------------------------------------------------------------------------

MASTER_BYTES = {"fp32": 4, "bf16": 2}
"""train.master_dtype -> bytes per parameter of the host master and, separately, of its
gradient accumulator (same dtype). Runtime: `models/host_params.py` `MASTER_DTYPES`."""

ADAM_MOMENT_BYTES = 8
"""Bytes per parameter of the two fp32 AdamW moments (m, v), with either master dtype.
Runtime: `runtime/optim.py` (torch AdamW on fp32); the moments a checkpoint holds
(`train/checkpoint.py` `checkpoint_bytes_per_param`)."""

ADAM_MOMENT_BYTES_Q8 = 2
"""The same with 8-bit moments (2 x 1 B; the block-wise scales are negligible). Runtime:
`runtime/optim8bit.py`."""

HOST_BYTES_PER_PARAM = {d: float(2 * b + ADAM_MOMENT_BYTES) for d, b in MASTER_BYTES.items()}
"""train.master_dtype -> host bytes per parameter (float): master + gradient + fp32 moments
(fp32: 16; bf16, MegaTrain's layout: 12). Planner: `planner/build.py` states and `PlanningProblem`
`host_bytes_per_param`; runtime: what `HostParams` and `BlockOptimizer` allocate."""

HOST_BYTES_PER_PARAM_Q8 = {d: float(2 * b + ADAM_MOMENT_BYTES_Q8)
                           for d, b in MASTER_BYTES.items()}
"""The same for a block with 8-bit moments (fp32: 10; bf16: 6); `host_bytes_per_param_q8`."""

OPTIMIZER_SCRATCH_BYTES_PER_PARAM = 8
"""bf16 masters only: AdamW steps an fp32 [2, largest group] scratch (weights and gradient of
the group being stepped), bytes per parameter of the largest group. Runtime:
`runtime/optim.py` `BlockOptimizer.scratch`; planner: `planner/build.py`
`optimizer_scratch_bytes`."""

REDUCE_BYTES_PER_PARAM = 4
"""Bytes per parameter of each half of a data-parallel step's exchange as the planner times it:
the gradient reduce and the master broadcast, both modelled in fp32 (`planner/topology.py`
`allreduce_ms`)."""

# --- host staging buffers (pinned DRAM) -------------------------------------------------------

WEIGHT_STAGING_BUFFERS = DEVICE_WEIGHT_SLOTS
"""Pinned compute-dtype staging buffers of streamed weights, each the largest block: one per
device weight slot (the masters are converted into them, never into a pinned copy of the
model). Runtime: `runtime/streams.py` `StagingPool`, sized by `DeviceWeights`. Planner:
`planner/build.py` `weight_pool_bytes`."""

GRAD_DRAIN_BUFFERS = 2
"""Pinned compute-dtype landing buffers of the gradient drain, each the largest block.
Runtime: `runtime/streams.py` `GradDrain(count=...)` default. Planner: `planner/build.py`
`grad_landing_bytes`."""

NVME_BOUNCE_BUFFERS = 2
"""The constant share of the DRAM staging record kept for the NVMe tier's bounce buffers, in
boundaries, each padded with `align_up` (`planner/build.py` `nvme_bounce_bytes`). The runtime's
host pool (`runtime/activations.py`) holds one padded buffer per NVMe boundary in flight, which
is not a constant: the planner's DRAM rows, the evaluator and the plan's pinned bytes replace
this share by the most any legal schedule of the plan's tiers holds in a window
(`planner/staging.py` `bounce_bound_by_window`)."""

ALIGN_BYTES = 4096
"""Alignment of the NVMe tier's buffers, file offsets and lengths, bytes: the 4 KiB logical
block of NVMe drives formatted for performance (O_DIRECT; a multiple of the 512 B minimum).
Runtime: `runtime/nvme.py`; planner: the padded staging bytes of `planner/staging.py` and
`planner/build.py`."""


def align_up(nbytes: int | float) -> int:
    """Smallest multiple of ALIGN_BYTES >= `nbytes` (bytes; a float is truncated first)."""
    return -(-int(nbytes) // ALIGN_BYTES) * ALIGN_BYTES


# --- windows and in-window order --------------------------------------------------------------

TRANSFER_ORDER = ("d2h", "nvme_write", "nvme_read", "h2d")
"""Transfer kinds in the order the engine issues a window's transfers: a kind reads the bytes
the previous kind delivered, and a plan may put both in one window. Runtime:
`runtime/activations.py` and `Engine.issue_transfers`; planner: the FIFO streams of
`planner/chains.py`."""

TURN_WINDOW = "turn"
"""The window between the last forward and the first backward (final norm, head, loss).

The window names (`TURN_WINDOW`, `forward_window`, `backward_window`) are how a plan's
windows, transfers and predictions meet the engine's: runtime `Engine` (the windows it runs
and meters, `windows.jsonl`); planner `planner/windows.py` (`window_names`, `window_ord`),
`planner/refit.py`, `planner/topology.py` and the simulator's `sim/tasks.py`."""


def forward_window(j: int) -> str:
    """Name of block j's forward window: f{j}."""
    return f"f{j}"


def backward_window(j: int) -> str:
    """Name of block j's backward window: b{j}."""
    return f"b{j}"


# --- labels -----------------------------------------------------------------------------------

IGNORE_INDEX = -100
"""The label of a position that carries no loss (prompt and template tokens, padding, the last
position after the shift), torch's `cross_entropy` default. Data: `data/tokenize.py` and
`data/batching.py` write it; models and runtime: `models/adapter.py` `shift_labels` and the
loss; `train/evaluate.py` skips it."""
