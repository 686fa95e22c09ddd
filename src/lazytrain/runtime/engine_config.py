"""What a streaming `Engine` is given and what one step returns: `EngineSettings` (how it runs
its steps), `StepStats` (what a step measured) and the compute dtypes by config name.

Plain values: no device, store or model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazytrain.contract import HEAD_CHUNK_TOKENS

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(kw_only=True, frozen=True, slots=True)
class StepStats:
    """What one `Engine.step` measured."""

    loss: float
    """Mean next-token loss over the step's label tokens, plus `coef * aux` per micro-batch when
    the MoE model enables the router aux loss (as HF's `*ForCausalLM`)."""
    tokens: int
    """Label tokens of the step (non-ignored positions), all micro-batches."""
    step_s: float
    """Wall time of the step, s (the optimizer tail overlaps the next step)."""
    peak_bytes: dict[str, int] = field(default_factory=dict)
    """Peak bytes per store accounting key over the step's windows."""
    window_ms: dict[str, float] = field(default_factory=dict)
    """Measured time per window, ms, summed over micro-batches."""
    lr: float | None = None
    grad_norm: float | None = None
    """Global gradient norm before clipping (None when clipping is off)."""
    windows: tuple[dict, ...] = ()
    """Per micro-batch window records (runtime/instrument.py schema, without "step");
    empty when the engine runs without instrumentation."""


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineSettings:
    """How an `Engine` runs its steps (the parts of `train.*` / `runtime.*` the engine reads).

    Raises:
        ValueError: a `compute_dtype` other than fp32 / bf16, or `head_chunk_tokens` < 1.
    """

    compute_dtype: str = "fp32"
    """"fp32" or "bf16": device copies of the weights and the activations."""
    lr: float = 1e-4
    """Learning rate of a step that passes none (`Engine.step(lr=...)` overrides it)."""
    clip_grad_norm: float | None = None
    """Max global gradient norm; None or 0: no clipping."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (checked against each step's list)."""
    seed: int = 0
    """Seeds torch's RNG once, at construction (dropout, repeatable runs)."""
    head_chunk_tokens: int = HEAD_CHUNK_TOKENS
    """Flattened tokens per head/loss chunk (`runtime.head_chunk_tokens`); a chunk covers
    max(1, head_chunk_tokens // micro_batch) positions."""
    instrument: bool = False
    """Record every window's waits and bytes per channel (runtime/instrument.py) into
    `StepStats.windows`."""
    budgets: bool = False
    """Reserve against the HBM and pinned budgets the plan was made for (`plan_budgets`): an
    allocation past them raises HbmBudgetExceeded / HostBudgetExceeded naming the owner and
    window, before the memory is requested. False: book only. With `budgets` or `instrument`
    the ledger also books the compute allocations (block workspace, kept graphs, head) through
    a dispatch mode on the CPU backends; without both, only the device API's own allocations."""
    model_config_sha256: str | None = None
    """The plan provenance's `model_config_sha256` to expect; None: the adapter's
    `hf_config_sha256` (plans built by hand record it). A planner-made plan records
    `ModelSpec.config_sha256` (the parsed architecture): pass that."""

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"train.compute_dtype: {self.compute_dtype!r}; use fp32 or bf16")
        if self.head_chunk_tokens < 1:
            raise ValueError(f"runtime.head_chunk_tokens must be >= 1; got "
                             f"{self.head_chunk_tokens}")
