"""The planning problem: every number the planner needs, in bytes, ms and bytes/s.

`PlanningProblem` is the one input of the window evaluator, the MILP, the heuristics, the bounds
and the event simulator. It is built from a `ModelSpec`, a `HardwareSpec` and the run config by
`lazytrain.planner.build.build_problem`; tests build tiny ones by hand. It knows nothing of torch or
of a solver. The meaning of every field is fixed by `docs/execution_model.md`.

Index legend: block j = 0..L-1 maps boundary j to boundary j+1; boundary i = 0..L.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lazytrain.contract import HOST_BYTES_PER_PARAM, HOST_BYTES_PER_PARAM_Q8, WEIGHT_PATH_NAMES
from lazytrain.spec.hardware import HOST_RATE_FIELDS, Q8_UPDATE_EXTRA_MS_PER_GPARAM, Bandwidths

LINK_FIELDS = tuple(f.name for f in dataclasses.fields(Bandwidths)
                    if f.name not in HOST_RATE_FIELDS)
"""The copy and file channel rates (h2d, d2h, duplex, nvme_read, nvme_write): each > 0."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PlanningProblem(Bandwidths):
    """Per-micro-batch costs and capacities for one (model, hardware, run config).

    Per-block tuples have length L (= `num_blocks`); `boundary_bytes` has length L+1. The
    channel rates (`h2d_bytes_per_s`, `d2h_bytes_per_s`, `duplex_bytes_per_s`,
    `nvme_read_bytes_per_s`, `nvme_write_bytes_per_s`, `host_convert_bytes_per_s`,
    `host_accumulate_bytes_per_s`) are the fields of `spec.hardware.Bandwidths`, with the host
    rates rescaled to the run's dtypes.

    Raises:
        ValueError: on a length mismatch, a negative cost or a non-positive bandwidth, naming
            the field.
    """

    name: str = "problem"
    """Human-readable label (model @ hardware), used in plan provenance and messages."""

    fwd_ms: tuple[float, ...]
    """F[j]: block forward without autograd, ms."""
    fwd_grad_ms: tuple[float, ...]
    """Fg[j]: block forward with autograd (the re-forward before backward), ms."""
    bwd_ms: tuple[float, ...]
    """B[j]: block backward, ms."""
    reforward_ms: tuple[float, ...] = ()
    """Fr[j]: the truncated re-forward before block j's backward (its tail skipped), ms.
    Empty: Fr = Fg (full re-forward; problems saved before truncation). Read through
    `reforward`."""
    saved_bytes: tuple[tuple[int, int], ...] = ()
    """(S1[j], S2[j]): the bytes block j keeps from `f{j}` for `b{j}` at save level L1 (the
    token mixer's saved tensors and its output) and L2 (every tensor its backward reads),
    excluding its input boundary, weights and the micro-batch inputs; deduplicated by storage
    (docs/execution_model.md, "Save levels"). Empty: levels unavailable (every block L0)."""
    reforward_l1_ms: tuple[float, ...] = ()
    """Fr1[j]: the re-forward in b{j} at level L1 (post-attention norm, MLP, truncated tail), ms.
    Empty exactly when `saved_bytes` is."""
    weight_bytes: tuple[int, ...]
    """P[j]: compute-dtype weight bytes streamed H2D per load of block j."""
    grad_bytes: tuple[int, ...]
    """G[j]: gradient bytes drained D2H after block j's backward."""
    internal_bytes: tuple[int, ...]
    """I[j]: autograd-saved activations of block j, excluding its input boundary, bytes."""
    boundary_bytes: tuple[int, ...]
    """A[i]: boundary activation bytes, i = 0..L ([micro_batch, seq, hidden] in compute dtype)."""
    params_per_block: tuple[int, ...]
    """Parameter count of each block (host state and the 8-bit option scale with it)."""
    ends_params: int = 0
    """Parameters outside the blocks (embedding, final norm, untied head)."""

    embed_ms: float = 0.0
    """Embedding forward (also the cost of re-embedding boundary 0 in backward), ms."""
    head_ms: float = 0.0
    """Final norm + LM head + loss, one forward and one backward of a chunk-local objective
    (SFT's cross entropy, as the profiler times it), ms. The `turn` window computes
    `turn_head_ms`; forward-only passes price their head from this figure."""
    head_turn_factor: float = 1.0
    """The `turn` window's head compute in units of `head_ms`, >= 1: 1 for a chunk-local
    objective (SFT, GRPO: each chunk's forward and backward once); 1 + the forward share of
    `head_ms` for DPO, whose head first runs a forward without gradient for the log-probs
    [B, S], then recomputes each chunk's forward with its backward (`planner/build.py`
    `head_turn_factor`)."""
    const_ms: float = 0.0
    """Per optimizer step constant (exposed optimizer tail, bookkeeping), ms."""
    ends_grad_bytes: int = 0
    """Embedding/head gradient bytes drained in `post`."""
    window_overhead_ms: float = 0.0
    """o: the engine's fixed cost of every window (pre, f{j}, turn, b{j}, post: 2L+3 per
    micro-batch), ms: Python, window bookkeeping, worker hand-offs. Plan-independent; added to
    each window's time after its max / sum of channels. 0: not modelled (analytic presets)."""

    # h2d, d2h, duplex, nvme_read, nvme_write and the two host rates (bytes/s, the host
    # rates in the run's dtypes): the inherited `Bandwidths` fields (spec/hardware.py)
    copies_overlap_compute: bool = True
    """True on a GPU (copy engines run beside compute: window = max of channels); False on CPU
    (channels contend for the cores: window = compute + sum of channel times)."""

    hbm_bytes: int
    """HBM budget for everything on the device (after the safety margin), bytes."""
    fixed_hbm_bytes: int = 0
    """Weight double buffers, gradient buffer, resident ends, block and head workspace, bytes."""
    dram_bytes: int
    """Host DRAM budget, bytes."""
    nvme_bytes: int = 0
    """NVMe scratch budget for checkpoints, bytes (0: no NVMe tier)."""
    nvme_staging_bytes: int = 0
    """Constant DRAM staging, bytes: the NVMe bounce pool plus the pinned weight pool and gradient
    landing buffers (planner/build.py puts all three here; the split is in provenance "memory").
    The name is kept for compatibility with saved problems and plans."""
    nvme_bounce_bytes: int = 0
    """The NVMe bounce pool's share of `nvme_staging_bytes`, bytes. The DRAM rows, the
    evaluator's DRAM and the predicted pinned bytes leave it out and count instead, per window,
    one padded buffer per NVMe boundary any legal schedule may hold there
    (`planner/staging.py` `bounce_bound_by_window`), as the runtime holds one per boundary in
    flight."""
    host_scratch_bytes: int = 0
    """The pageable (not pinned) share of `nvme_staging_bytes`: the bf16 masters' fp32
    optimizer scratch."""
    host_bytes_per_param: float = HOST_BYTES_PER_PARAM["fp32"]
    """Host bytes per parameter for master weights + grads + Adam moments (fp32 master: 16;
    MegaTrain bf16 master: 12): `lazytrain.contract.HOST_BYTES_PER_PARAM`, what the runtime's
    host store and optimizer allocate."""
    host_bytes_per_param_q8: float = HOST_BYTES_PER_PARAM_Q8["fp32"]
    """Host bytes per parameter for a block whose Adam moments are 8-bit (fp32 master 4 + fp32
    grad 4 + 2 x 1 B moments; block-wise scales are negligible):
    `lazytrain.contract.HOST_BYTES_PER_PARAM_Q8`."""
    weight_paths: tuple[str, ...] = ()
    """How each block's weights reach the device (`planner/weight_paths.py` `WEIGHT_PATHS`):
    "host_convert" (master -> compute dtype on the host per load), "pinned_copy" (H2D from a
    pinned compute-dtype copy the optimizer refreshes; with masters already in the compute
    dtype, from the pinned masters themselves) or "gpu_cast" (H2D of the master, cast on the
    device). Empty: every block "host_convert". Set through `weight_paths.with_weight_paths`,
    which also folds the paths' memory into `fixed_hbm_bytes` and `nvme_staging_bytes`."""
    weight_path_hbm_bytes: int = 0
    """The share of `fixed_hbm_bytes` the weight paths add (gpu_cast landing slots), bytes."""
    weight_path_dram_bytes: int = 0
    """The share of `nvme_staging_bytes` the weight paths add (pinned copies), bytes."""
    weight_path_choice: bool = False
    """Whether the policy chooses the weight paths before planning (`planner/path_choice.py`);
    `planner/build.py` sets it for a run's problem, hand-made problems keep their paths."""
    cast_gradients: bool = False
    """Whether, with one micro-batch per step, block gradients are cast to the master dtype on
    the device and land in the accumulator (the runtime's `GradDrain(land_all=True)`: D2H of
    G[j] x `master_bytes_ratio`, no host add, `grad_cast_bytes` in `fixed_hbm_bytes`);
    `planner/build.py` sets it for a run's problem. Masters in the compute dtype land without
    a cast whatever this says."""
    master_bytes_ratio: float = 2.0
    """Master-dtype bytes / compute-dtype bytes of a weight (fp32 master, bf16 compute: 2;
    masters in the compute dtype: 1): a gpu_cast load moves P[j] x this over the link."""
    q8_penalty_ms_per_gparam: float = 1.0
    """Objective penalty for 8-bit states, ms per 1e9 parameters (keeps q8 for when DRAM needs it)."""
    q8_update_ms_per_gparam: float = Q8_UPDATE_EXTRA_MS_PER_GPARAM
    """How much longer a block's AdamW update takes with 8-bit moments than with fp32 ones, ms
    per 1e9 of its parameters, >= 0: charged to the step once per optimizer step for every
    block in a plan's `q8_blocks` (docs/execution_model.md, "Host work"). A measured profile's
    figure (`host.optimizer_q8_ms_per_mparam` - `host.optimizer_ms_per_mparam`) or the
    reference server's (`spec.hardware.Q8_UPDATE_EXTRA_MS_PER_GPARAM`, 1093.75)."""

    drain_windows: int = 4
    """H_d: windows a D2H offload may spread over, starting at the boundary's production."""
    prefetch_windows: int = 4
    """H_p: windows before use in which an H2D prefetch may run."""
    nvme_lead_windows: int = 4
    """H_n: extra windows of lead for NVMe writes and reads."""
    k_max: int = 64
    """Longest segment (number of blocks between consecutive materialized boundaries)."""
    allow_keep: bool = True
    """Whether keep-internals and resident weights (device weights held from f_j to b_j, with or
    without the kept graph) are offered to the planner."""
    allow_q8: bool = False
    """Whether the 8-bit optimizer-state option is offered to the planner."""

    grad_accum: int = 1
    """Micro-batches per optimizer step (the windows repeat per micro-batch)."""
    tokens_per_micro_batch: int = 1
    """micro_batch * seq_len, tokens (model TFLOPS and tokens/s)."""
    model_flops_per_micro_batch: float = 0.0
    """6 * N * tokens (model FLOPs, the number papers quote), FLOP."""
    hardware_flops_per_micro_batch_base: float = 0.0
    """FLOPs actually executed with no recompute (incl. attention); recompute adds to it, FLOP."""
    block_fwd_flops: tuple[float, ...] = field(default=())
    """Forward FLOPs of each block (for hardware TFLOPS with recompute); empty: unknown."""

    provenance: dict = field(default_factory=dict)
    """Plan provenance fields (model, model_config_sha256, hardware, seq_len, ...)."""

    @property
    def reforward(self) -> tuple[float, ...]:
        """Fr[j]: the re-forward in b{j} unless j is kept, ms: `reforward_ms`, or `fwd_grad_ms`
        when that is empty."""
        return self.reforward_ms or self.fwd_grad_ms

    def __post_init__(self) -> None:
        L = len(self.fwd_ms)
        if L < 1:
            raise ValueError("fwd_ms must have one entry per block; got none")
        for name in ("fwd_grad_ms", "bwd_ms", "weight_bytes", "grad_bytes", "internal_bytes",
                     "params_per_block"):
            if len(getattr(self, name)) != L:
                raise ValueError(f"{name} must have {L} entries (one per block); "
                                 f"got {len(getattr(self, name))}")
        if self.reforward_ms and len(self.reforward_ms) != L:
            raise ValueError(f"reforward_ms must have {L} entries (one per block) or none "
                             f"(full re-forward); got {len(self.reforward_ms)}")
        if any(v < 0 for v in self.reforward_ms):
            raise ValueError("reforward_ms must be >= 0 everywhere")
        self._check_save_levels(L)
        if len(self.boundary_bytes) != L + 1:
            raise ValueError(f"boundary_bytes must have {L + 1} entries (boundaries 0..L); "
                             f"got {len(self.boundary_bytes)}")
        for name in ("fwd_ms", "fwd_grad_ms", "bwd_ms", "weight_bytes", "grad_bytes",
                     "internal_bytes", "boundary_bytes"):
            if any(v < 0 for v in getattr(self, name)):
                raise ValueError(f"{name} must be >= 0 everywhere")
        for name in LINK_FIELDS:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        if not self.q8_update_ms_per_gparam >= 0:
            raise ValueError(f"q8_update_ms_per_gparam must be >= 0 (the 8-bit update's extra "
                             f"time; 0: not charged); got {self.q8_update_ms_per_gparam}")
        if not self.head_turn_factor >= 1:
            raise ValueError(f"head_turn_factor must be >= 1 (the turn runs the head's forward "
                             f"and backward at least once); got {self.head_turn_factor}")
        if not self.window_overhead_ms >= 0:
            raise ValueError(f"window_overhead_ms must be >= 0 (0: not modelled); "
                             f"got {self.window_overhead_ms}")
        for name in HOST_RATE_FIELDS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (0: host work not modelled); "
                                 f"got {getattr(self, name)}")
        for name in ("drain_windows", "prefetch_windows", "k_max", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        bad = sorted(set(self.weight_paths) - set(WEIGHT_PATH_NAMES))
        if bad or len(self.weight_paths) not in (0, L):
            raise ValueError(f"weight_paths must be empty or one of {WEIGHT_PATH_NAMES} per "
                             f"block ({L}); got {len(self.weight_paths)} entries, unknown {bad}")
        if not self.master_bytes_ratio > 0:
            raise ValueError(f"master_bytes_ratio must be > 0 (master bytes / compute bytes); "
                             f"got {self.master_bytes_ratio}")
        if self.nvme_lead_windows < 0:
            raise ValueError(f"nvme_lead_windows must be >= 0; got {self.nvme_lead_windows}")

    def _check_save_levels(self, L: int) -> None:
        """`saved_bytes` and `reforward_l1_ms`: both empty, or L entries each with
        0 <= S1 <= S2 and 0 <= Fr1 <= Fr (the L1 re-forward runs a part of the L0 one)."""
        if not self.saved_bytes and not self.reforward_l1_ms:
            return
        # a JSON round trip gives lists: keep the field hashable and comparable
        object.__setattr__(self, "saved_bytes", tuple(tuple(p) for p in self.saved_bytes))
        object.__setattr__(self, "reforward_l1_ms", tuple(self.reforward_l1_ms))
        for name in ("saved_bytes", "reforward_l1_ms"):
            if len(getattr(self, name)) != L:
                raise ValueError(f"{name} must have {L} entries (one per block) or be empty "
                                 f"together with the other save-level field (levels "
                                 f"unavailable); got {len(getattr(self, name))}")
        for j, pair in enumerate(self.saved_bytes):
            if len(pair) != 2 or not 0 <= pair[0] <= pair[1]:
                raise ValueError(f"saved_bytes[{j}] must be (S1, S2) with 0 <= S1 <= S2 (L1 "
                                 f"keeps a subset of L2's tensors); got {tuple(pair)}")
        reforward = self.reforward
        for j, ms in enumerate(self.reforward_l1_ms):
            if not 0 <= ms <= reforward[j] * (1 + 1e-9):
                raise ValueError(f"reforward_l1_ms[{j}] must lie in [0, reforward_ms[{j}] = "
                                 f"{reforward[j]}] (the L1 re-forward is part of the L0 one); "
                                 f"got {ms}")

    @property
    def turn_head_ms(self) -> float:
        """The head's compute in `turn`, ms: `head_ms` x `head_turn_factor` (what the
        evaluator, the MILP, the bounds and the event simulator charge there)."""
        return self.head_ms * self.head_turn_factor

    @property
    def save_levels_available(self) -> bool:
        """Whether the problem offers save levels L1/L2 (`saved_bytes` given)."""
        return bool(self.saved_bytes)

    @property
    def paths(self) -> tuple[str, ...]:
        """`weight_paths`, one per block ("host_convert" where empty)."""
        return self.weight_paths or ("host_convert",) * self.num_blocks

    @property
    def load_bytes(self) -> tuple[float, ...]:
        """H2D bytes of one load of each block: P[j], or P[j] x `master_bytes_ratio` for
        gpu_cast (the master crosses the link). Source: docs/execution_model.md, "Weight
        paths"."""
        r = self.master_bytes_ratio
        return tuple(float(b) * (r if path == "gpu_cast" else 1.0)
                     for b, path in zip(self.weight_bytes, self.paths))

    @property
    def convert_bytes(self) -> tuple[float, ...]:
        """Compute-dtype bytes the host converts per load of each block: P[j] for
        host_convert, 0 otherwise. Source: docs/execution_model.md, "Weight paths"."""
        return tuple(float(b) if path == "host_convert" else 0.0
                     for b, path in zip(self.weight_bytes, self.paths))

    @property
    def accumulates_on_host(self) -> bool:
        """Whether drained block gradients are added on the host: False with one micro-batch
        per step, where every drain is the step's first and lands in the accumulator itself
        (cast on the device when the master dtype differs; docs/execution_model.md, "Weight
        paths")."""
        if self.grad_accum != 1:
            return True
        return not (self.master_bytes_ratio == 1 or self.cast_gradients)

    @property
    def drain_bytes(self) -> tuple[float, ...]:
        """D2H bytes of each block's gradient drain: G[j], or G[j] x `master_bytes_ratio`
        where it is cast on the device and lands in the master-dtype accumulator
        (`cast_gradients` and one micro-batch per step)."""
        r = self.master_bytes_ratio if self.cast_gradients and self.grad_accum == 1 else 1.0
        return tuple(float(g) * r for g in self.grad_bytes)

    def block_accumulate_bytes(self, grad_bytes: float) -> float:
        """The host-accumulated bytes of a drained block gradient of `grad_bytes`: all of
        them, or 0 where `accumulates_on_host` is False."""
        return grad_bytes if self.accumulates_on_host else 0.0

    @property
    def num_blocks(self) -> int:
        """L, the number of transformer blocks."""
        return len(self.fwd_ms)

    def replace(self, **changes) -> "PlanningProblem":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
