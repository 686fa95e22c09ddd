"""`BlockCosts`: per-block times (ms) and sizes (bytes) for one micro-batch, analytic or measured.

Symbols as in docs/execution_model.md: F (forward, no autograd), Fg (forward with autograd,
the re-forward before backward), B (backward), P (weight bytes streamed H2D), G (gradient
bytes drained D2H), A (boundary activation bytes), I (autograd-saved internal activations of a
block, excluding its input boundary).

Analytic model (`analytic_costs`), per block j and micro-batch of T = micro_batch * seq_len:
- FLOPs: fwd = T * (2 * active_params + attention core) (`BlockSpec.fwd_flops_per_token`);
  bwd = 2 x the matmul FLOPs + 2.5 x the attention-core FLOPs (FlashAttention-2's backward
  recomputes the scores: arXiv 2307.08691 section 3.1); fwd_grad = 1.05 x fwd
  (`FWD_GRAD_FACTOR`: saving activations costs memory traffic, not FLOPs; an estimate, replaced
  by the measured profile).
- time = FLOPs / (peak_flops * matmul_efficiency).
- P = params x compute-dtype bytes; G = params x grad-dtype bytes (grads drain in the compute
  dtype: bf16 with bf16 compute, fp32 with fp32); A = T x hidden x compute-dtype bytes;
  I = T x (saved_elems_per_token x dtype bytes + saved_fp32_per_token x 4) + the SDPA mask
  B x S^2 x dtype bytes of a softmax-attention block (`attention_mask_bytes`)
  (`lazytrain.spec.families`: the tensors autograd saves in the HF implementation, an upper
  bound checked against the runtime's ledger).
- Head (the `turn` window): final norm + LM head + loss forward and backward in token chunks,
  6 x T x vocab x hidden FLOPs. Embedding: a gather, 2 x A bytes at HBM bandwidth.

Profile file (`profile_costs`; `lazytrain profile` writes it), JSON:

    {"version": 1,
     "model_config_sha256": hex,          # optional; checked when present
     "seq_len": int, "micro_batch": int, "compute_dtype": "bf16"|"fp32",
     "block_kinds": {kind: {"fwd_ms": f, "fwd_grad_ms": f, "bwd_ms": f,
                            "internal_bytes": int (optional), "workspace_bytes": int (optional),
                            "reforward_ms": f (optional: the truncated re-forward),
                            "saved_l1_bytes": int, "saved_l2_bytes": int,   # optional: what
                            "reforward_l1_ms": f}},  # save levels L1 / L2 keep; L1 re-forward
     "ends": {"embed_ms": f, "head_ms": f},                       # optional
     "bandwidths": {"h2d_gb_per_s": f, "d2h_gb_per_s": f, "duplex_gb_per_s": f,
                    "nvme_read_gb_per_s": f, "nvme_write_gb_per_s": f},   # optional, any subset
     "step_const_ms": f,       # optional: per optimizer step time outside the windows (exposed
                               # optimizer, ends load; the problem's const_ms), ms
     "window_overhead_ms": f,  # optional: the engine's fixed cost of every window (Python,
                               # bookkeeping, worker hand-offs; the problem's
                               # window_overhead_ms), ms
     "host": {                 # optional: host work measured as the runtime does it
        "master_dtype": "fp32"|"bf16",   # the masters it was measured with (required here)
        "convert_gb_per_s": f,     # master -> compute-dtype staging copy, compute-dtype GB
                                   # written per s (the conversion worker)
        "accumulate_gb_per_s": f,  # drained compute-dtype gradient added into the master-dtype
                                   # accumulator, gradient GB per s (the accumulation worker)
        "accumulate_first_gb_per_s": f,  # record: the first micro-batch's copy instead of add
        "staging_copy_gb_per_s": f,      # record: memcpy into a 4 KiB-aligned NVMe bounce buffer
        "optimizer_ms_per_mparam": f,    # fused fp32 AdamW update, ms per 1e6 parameters
        "optimizer_q8_ms_per_mparam": f}}  # optional: 8-bit AdamW update (bitsandbytes), the same

`profile_costs` applies `convert_gb_per_s` / `accumulate_gb_per_s` to the HardwareSpec's
`host_convert_bytes_per_s` / `host_accumulate_bytes_per_s`, expressed in the spec's reference
dtypes (`reference_host_rates`: `planner/build.py` rescales them back to exactly the measured
rates for the run's dtypes). The staging copy and the fp32 optimizer rate alone are records:
the cost model charges no host time to NVMe staging (the d2h copy lands in the bounce buffer that
O_DIRECT writes from) and the fp32 optimizer runs on its own thread outside the windows (its
exposure is in `step_const_ms`). With both optimizer rates, their difference is the 8-bit
update's extra time (`ModelCosts.q8_update_ms_per_gparam`), which the planner charges to the
step for each block a plan gives 8-bit moments.

Other keys (`measurements`, `cpu_contention`, `refit`, `device`) are records for the report.

Kinds are `BlockSpec.kind` (dense, linear_attention, moe, ...); each block takes its kind's
measured times. Sizes P, G, A stay analytic (they are exact).

The MegaTrain-rule calibration of the h800-paper preset lives here too
(`calibrate_matmul_efficiency`), because it needs the cost model; it is a closed form, not a fit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from lazytrain.contract import HEAD_CHUNK_TOKENS
from lazytrain.spec.block import BlockSpec
from lazytrain.spec.hardware import (
    ACCUMULATE_TRAFFIC_PER_BYTE, CONVERT_TRAFFIC_PER_BYTE, HardwareSpec, apply_overrides,
)
from lazytrain.spec.model import ModelSpec

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per element of each compute dtype."""

FWD_GRAD_FACTOR = 1.05
"""Fg / F: forward with autograd vs without (saving activations; same FLOPs). An estimate."""
BWD_MATMUL_FACTOR = 2.0
"""Backward / forward FLOPs of a matmul (grad of input + grad of weight)."""
BWD_ATTN_CORE_FACTOR = 2.5
"""Backward / forward FLOPs of the attention core (FlashAttention-2, arXiv 2307.08691)."""
HEAD_SOFTMAX_BYTES_PER_LOGIT = 12
"""Device bytes per logit of a head chunk at the loss backward's peak, fp32 and bf16 compute:
the fp32 log-softmax output (saved), the nll-loss gradient and the log-softmax gradient, 3 x 4 B
alive together; the compute-dtype logits and (bf16) their fp32 upcast are freed by then and
never exceed this in the forward (logits + upcast + log-softmax: 2 + 4 + 4 B at most).
Measured with the runtime's allocation ledger: 12.0-12.04 B/logit."""
HEAD_NORM_BYTES_PER_ELEM = 12
"""Device bytes per [chunk, hidden] element the final norm holds through the head's backward
(its fp32 normalized input, its output and the chunk's input gradient), B (measured <= 12)."""
HEAD_NORM_BACKWARD_BYTES_PER_ELEM = 16
"""Further device bytes per [chunk, hidden] element of the final norm's own backward (fp32
gradients of its internals), B; the peak only where the vocabulary is narrower than hidden."""


@dataclass(kw_only=True, frozen=True, slots=True)
class BlockCosts:
    """Costs of one block for one micro-batch."""

    fwd_ms: float
    """F: forward without autograd, ms."""
    fwd_grad_ms: float
    """Fg: forward with autograd, ms."""
    reforward_ms: float
    """Fr: the truncated re-forward before the block's backward, `Fg * (1 - s)` with s the
    block's `BlockSpec.reforward_skip_share` (Fg where the runtime re-forwards in full), ms."""
    bwd_ms: float
    """B: backward, ms."""
    weight_bytes: int
    """P: compute-dtype weights streamed per load, bytes."""
    grad_bytes: int
    """G: gradients drained after the backward, bytes."""
    boundary_bytes: int
    """A of the block's input boundary ([micro_batch, seq, hidden], compute dtype), bytes."""
    internal_bytes: int
    """I: autograd-saved activations excluding the input boundary, bytes."""
    fwd_flops: float
    """Forward FLOPs (hardware FLOPs accounting of recompute), FLOP."""
    bwd_flops: float
    """Backward FLOPs, FLOP."""
    saved_bytes: tuple[int, int] = (0, 0)
    """(S1, S2): what the block keeps from its forward for its backward at save levels L1 and
    L2 (`BlockSpec.saved_level_bytes`, or the profile's measured bytes), bytes."""
    reforward_l1_ms: float = 0.0
    """Fr1: the L1 re-forward (post-attention norm, MLP, truncated tail), `Fg x
    BlockSpec.reforward_l1_share` or measured, ms."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelCosts:
    """Per-block costs plus the ends (embedding, head) and the working-set sizes."""

    blocks: tuple[BlockCosts, ...]
    """One entry per block."""
    boundary_bytes: tuple[int, ...]
    """A[i], i = 0..L (all equal for a fixed-width residual stream), bytes."""
    embed_ms: float
    """Embedding forward (and re-embedding boundary 0), ms."""
    head_ms: float
    """Final norm + LM head + loss, forward and backward, ms."""
    head_flops: float
    """Head FLOPs (forward + backward), FLOP."""
    ends_weight_bytes: int
    """Embedding + final norm + untied head in the compute dtype, bytes."""
    ends_grad_bytes: int
    """Their gradients, bytes."""
    block_workspace_bytes: int
    """One block's working set during its backward beside the gradient buffers:
    max(max I, max G) + max G + 3 x A (`block_workspace_bytes`), or the profile's measured
    workspace, bytes."""
    head_workspace_bytes: int
    """The head's device workspace in `turn` (`head_workspace_bytes`), bytes."""
    block_inputs_bytes: int
    """One micro-batch's block inputs besides the hidden state, held from pre to post
    (`block_inputs_bytes`), bytes."""
    tokens: int
    """micro_batch * seq_len."""
    hardware: HardwareSpec
    """The spec the times were computed for (with measured bandwidths for a profile)."""
    source: str = "analytic"
    """`analytic` or `profile:<path>`."""
    step_const_ms: float = 0.0
    """Per optimizer step time outside the windows (the profile's `step_const_ms`), ms."""
    window_overhead_ms: float = 0.0
    """The engine's fixed cost of every window (the profile's `window_overhead_ms`), ms;
    0: not modelled (analytic)."""
    q8_update_ms_per_gparam: float | None = None
    """How much longer an 8-bit AdamW update takes than the fused fp32 one, ms per 1e9
    parameters (the profile's `host.optimizer_q8_ms_per_mparam - host.optimizer_ms_per_mparam`,
    x 1000, at least 0); None: not measured (the planning problem keeps its default)."""


def analytic_costs(model: ModelSpec, hw: HardwareSpec, *, seq_len: int, micro_batch: int,
                   compute_dtype: str, head_chunk_tokens: int = HEAD_CHUNK_TOKENS) -> ModelCosts:
    """Analytic costs (module docstring) for one micro-batch.

    Args:
        model: the architecture.
        hw: the machine (peak_flops, matmul_efficiency, hbm bandwidth).
        seq_len: tokens per sequence.
        micro_batch: sequences per micro-batch.
        compute_dtype: "bf16" or "fp32" (weights streamed, activations, gradients drained).
        head_chunk_tokens: tokens per LM-head chunk (sizes the head workspace).

    Returns:
        `ModelCosts` with `source="analytic"`.

    Raises:
        ValueError: unknown compute dtype or non-positive sizes.
    """
    if compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"compute_dtype must be one of {list(DTYPE_BYTES)}; got {compute_dtype!r}")
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len and micro_batch must be >= 1; got {seq_len}, {micro_batch}")
    b = DTYPE_BYTES[compute_dtype]
    T = seq_len * micro_batch
    ms_per_flop = 1e3 / hw.achieved_flops
    A = T * model.hidden_size * b
    blocks = []
    for blk in model.blocks:
        core = blk.core_attention_flops_per_token(seq_len) * T
        fwd = blk.fwd_flops_per_token(seq_len) * T
        bwd = BWD_MATMUL_FACTOR * (fwd - core) + BWD_ATTN_CORE_FACTOR * core
        fwd_grad_ms = FWD_GRAD_FACTOR * fwd * ms_per_flop
        saved = blk.saved_level_bytes(micro_batch=micro_batch, seq_len=seq_len, dtype_bytes=b)
        blocks.append(BlockCosts(
            fwd_ms=fwd * ms_per_flop, fwd_grad_ms=fwd_grad_ms,
            reforward_ms=fwd_grad_ms * (1.0 - blk.reforward_skip_share(seq_len)),
            bwd_ms=bwd * ms_per_flop, weight_bytes=blk.params * b, grad_bytes=blk.params * b,
            boundary_bytes=A,
            internal_bytes=T * (blk.saved_elems_per_token * b + blk.saved_fp32_per_token * 4)
            + attention_mask_bytes(blk, micro_batch=micro_batch, seq_len=seq_len, dtype_bytes=b),
            fwd_flops=fwd, bwd_flops=bwd, saved_bytes=saved,
            reforward_l1_ms=fwd_grad_ms * blk.reforward_l1_share(seq_len)))
    head_flops = 6.0 * T * model.head_matmul_params
    return ModelCosts(
        blocks=tuple(blocks), boundary_bytes=(A,) * (model.num_blocks + 1),
        embed_ms=2 * A / hw.hbm_bandwidth_bytes_per_s * 1e3, head_ms=head_flops * ms_per_flop,
        head_flops=head_flops, ends_weight_bytes=model.ends_params * b,
        ends_grad_bytes=model.ends_params * b,
        block_workspace_bytes=block_workspace_bytes(blocks, A),
        head_workspace_bytes=head_workspace_bytes(
            model, micro_batch=micro_batch, seq_len=seq_len, dtype_bytes=b,
            head_chunk_tokens=head_chunk_tokens),
        block_inputs_bytes=block_inputs_bytes(model, micro_batch=micro_batch, seq_len=seq_len,
                                              dtype_bytes=b),
        tokens=T, hardware=hw)


def block_workspace_bytes(blocks: tuple[BlockCosts, ...] | list[BlockCosts], A: int) -> int:
    """One block's device working set in its backward window, beyond the two gradient buffers
    `planner/build.py` counts, bytes: `max(max_j I[j], max_j G[j]) + max_j G[j] + 3 A`.

    While autograd runs, block j's saved activations (I) are live beside the gradients it has
    produced so far; once it returns they are freed, and autograd's per-parameter gradients
    (G) are live beside the flat gradient they are packed into
    (`runtime/block_autograd.flat_grad`): the larger of I and G, plus one G. The two buffers
    are the gradients the drain may still be copying (`runtime/streams.GradDrain` keeps
    GRAD_DRAIN_BUFFERS copies in flight: blocks j+1 and j+2, each held until its copy ran).
    The 3 A: the incoming boundary gradient, the outgoing one and the block's output.
    """
    max_g = max(c.grad_bytes for c in blocks)
    return max(max(c.internal_bytes for c in blocks), max_g) + max_g + 3 * A


def attention_mask_bytes(blk: BlockSpec, *, micro_batch: int, seq_len: int,
                         dtype_bytes: int) -> int:
    """The additive mask [B, 1, S, S] a softmax-attention block's SDPA call makes from the
    boolean one and autograd saves with the graph (the `where` in HF's SDPA path, compute
    dtype), bytes: B S^2 b; 0 for linear attention. Made only where a mask is passed (a padded
    batch): counted always, as the bound."""
    if blk.attention == "linear_attention":
        return 0
    return micro_batch * seq_len * seq_len * dtype_bytes


def block_inputs_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int,
                       dtype_bytes: int) -> int:
    """One micro-batch's block inputs besides the hidden state (`ModelAdapter.block_kwargs`:
    built in pre, read by every forward and re-forward, dropped after post), bytes:

        (n_rope 2 B S d + n_mask B S^2) b + 8 B S

    the rotary tables (cos, sin) [B, S, d] in the compute dtype (b bytes) per rotary kind, a
    4D attention mask [B, 1, S, S] per softmax-attention kind and window (HF builds one where
    the batch is padded; counted always, at b bytes per element), and the int64 positions.
    n_rope = n_mask = the distinct (attention kind, window) pairs of the softmax-attention
    blocks, d their largest q/k head dim.
    """
    kinds = {(blk.attention, blk.sliding_window) for blk in model.blocks
             if blk.attention != "linear_attention"}
    d = max((blk.qk_head_dim for blk in model.blocks), default=0)
    B, S = micro_batch, seq_len
    return len(kinds) * (2 * B * S * d + B * S * S) * dtype_bytes + 8 * B * S


def head_workspace_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, dtype_bytes: int,
                         head_chunk_tokens: int = HEAD_CHUNK_TOKENS) -> int:
    """The head's device workspace in `turn` (final norm + LM head + loss and their backward,
    chunk by chunk: `runtime/ends.head_loss_chunks`), bytes:

        A + n_norm c H + max(s c V, b (c V + V H), n_bwd c H)

    with c = min(B max(1, head_chunk_tokens // B), B S) the chunk's tokens, V the vocabulary,
    H hidden, b `dtype_bytes`, A = B S H b the d loss / d boundary L buffer the chunks write,
    s = `HEAD_SOFTMAX_BYTES_PER_LOGIT` (the loss backward's peak), b (c V + V H) the logits'
    gradient beside the head weight's [V, H] gradient (the matmul backward's peak; tied or
    untied), n_norm = `HEAD_NORM_BYTES_PER_ELEM`, n_bwd = `HEAD_NORM_BACKWARD_BYTES_PER_ELEM`.
    One chunk's tensors only: the runtime frees each chunk's before the next. Source: the
    tensors autograd allocates in that loop, measured per op with the runtime's ledger.
    """
    B, S, H, V = micro_batch, seq_len, model.hidden_size, model.vocab_size
    c = min(B * max(1, head_chunk_tokens // B), B * S)
    peak = max(HEAD_SOFTMAX_BYTES_PER_LOGIT * c * V, dtype_bytes * (c * V + V * H),
               HEAD_NORM_BACKWARD_BYTES_PER_ELEM * c * H)
    return B * S * H * dtype_bytes + HEAD_NORM_BYTES_PER_ELEM * c * H + peak


def profile_costs(model: ModelSpec, profile_path: str | Path, *, hw: HardwareSpec, seq_len: int,
                  micro_batch: int, compute_dtype: str, head_chunk_tokens: int = HEAD_CHUNK_TOKENS
                  ) -> ModelCosts:
    """Costs from a measured profile (schema in the module docstring), expanded to blocks.

    Sizes P, G, A come from the analytic model; times (and I / workspace when measured) from
    the profile; measured bandwidths and host rates (`host`, see `reference_host_rates`)
    replace `hw`'s; `step_const_ms` and `window_overhead_ms` are carried to the problem.

    Raises:
        FileNotFoundError: no profile file.
        ValueError: the profile was measured for another seq_len / micro_batch / dtype / model,
            or lacks a block kind this model has (named).
    """
    path = Path(profile_path)
    if not path.is_file():
        raise FileNotFoundError(f"hardware.profile_path: profile not found: {path}")
    prof = json.loads(path.read_text())
    for key, want in (("seq_len", seq_len), ("micro_batch", micro_batch),
                      ("compute_dtype", compute_dtype)):
        if prof.get(key) != want:
            raise ValueError(f"profile {path} was measured with {key}={prof.get(key)!r}, the run "
                             f"uses {want!r}; re-run `lazytrain profile` for this config")
    sha = prof.get("model_config_sha256")
    if sha and sha != model.config_sha256:
        raise ValueError(f"profile {path} was measured on another model "
                         f"(config sha {sha[:12]} != {model.config_sha256[:12]})")
    bw = {k: v for k, v in (prof.get("bandwidths") or {}).items() if v is not None}
    hw = apply_overrides(hw, bw) if bw else hw
    hw = _with_host_rates(hw, prof.get("host"), compute_dtype=compute_dtype, path=path)
    base = analytic_costs(model, hw, seq_len=seq_len, micro_batch=micro_batch,
                          compute_dtype=compute_dtype, head_chunk_tokens=head_chunk_tokens)
    kinds = prof.get("block_kinds") or {}
    blocks, workspaces = [], []
    for blk, c in zip(model.blocks, base.blocks):
        if blk.kind not in kinds:
            raise ValueError(f"profile {path} has no measurements for block kind "
                             f"{blk.kind!r} (block {blk.index}); it has {sorted(kinds)}")
        m = kinds[blk.kind]
        reforward = float(m.get("reforward_ms", float(m["fwd_grad_ms"])
                                * (1.0 - blk.reforward_skip_share(seq_len))))
        blocks.append(BlockCosts(
            fwd_ms=float(m["fwd_ms"]), fwd_grad_ms=float(m["fwd_grad_ms"]),
            reforward_ms=reforward, **_save_level_costs(m, blk, c, seq_len=seq_len,
                                                         reforward_ms=reforward),
            bwd_ms=float(m["bwd_ms"]), weight_bytes=c.weight_bytes, grad_bytes=c.grad_bytes,
            boundary_bytes=c.boundary_bytes,
            internal_bytes=int(m.get("internal_bytes", c.internal_bytes)),
            fwd_flops=c.fwd_flops, bwd_flops=c.bwd_flops))
        if "workspace_bytes" in m:
            workspaces.append(int(m["workspace_bytes"]))
    ends = prof.get("ends") or {}
    A = base.boundary_bytes[0]
    workspace = max(workspaces) if workspaces else block_workspace_bytes(blocks, A)
    return ModelCosts(
        blocks=tuple(blocks), boundary_bytes=base.boundary_bytes,
        embed_ms=float(ends.get("embed_ms", base.embed_ms)),
        head_ms=float(ends.get("head_ms", base.head_ms)), head_flops=base.head_flops,
        ends_weight_bytes=base.ends_weight_bytes, ends_grad_bytes=base.ends_grad_bytes,
        block_workspace_bytes=workspace, head_workspace_bytes=base.head_workspace_bytes,
        block_inputs_bytes=base.block_inputs_bytes,
        tokens=base.tokens, hardware=hw, source=f"profile:{path}",
        step_const_ms=float(prof.get("step_const_ms") or 0.0),
        window_overhead_ms=float(prof.get("window_overhead_ms") or 0.0),
        q8_update_ms_per_gparam=q8_update_ms_per_gparam(prof.get("host")))


def _save_level_costs(m: dict, blk: BlockSpec, analytic: BlockCosts, *, seq_len: int,
                      reforward_ms: float) -> dict:
    """A block's save-level costs from its kind's profile entry `m`: the measured
    `saved_l1_bytes` / `saved_l2_bytes` / `reforward_l1_ms` where present, else the analytic
    bytes and `Fg x BlockSpec.reforward_l1_share`. Fr1 is capped at the kind's Fr (two timed
    series of nearly the same work may cross by noise; the L1 re-forward runs a part of the L0
    one)."""
    saved = analytic.saved_bytes
    if "saved_l1_bytes" in m and "saved_l2_bytes" in m:
        saved = (int(m["saved_l1_bytes"]), int(m["saved_l2_bytes"]))
    l1_ms = float(m.get("reforward_l1_ms", float(m["fwd_grad_ms"])
                        * blk.reforward_l1_share(seq_len)))
    return {"saved_bytes": saved, "reforward_l1_ms": min(l1_ms, reforward_ms)}


def q8_update_ms_per_gparam(host: dict | None) -> float | None:
    """The 8-bit update's extra time over the fp32 one from a profile's `host` section, ms per
    1e9 parameters: (optimizer_q8_ms_per_mparam - optimizer_ms_per_mparam) x 1000, at least 0;
    None when either rate is missing."""
    q8, fp32 = ((host or {}).get(k) for k in ("optimizer_q8_ms_per_mparam",
                                              "optimizer_ms_per_mparam"))
    if q8 is None or fp32 is None:
        return None
    return max(0.0, float(q8) - float(fp32)) * 1e3


def reference_host_rates(convert_bytes_per_s: float, accumulate_bytes_per_s: float, *,
                         master_dtype: str, compute_dtype: str) -> tuple[float, float]:
    """Host rates measured with the run's dtypes, in the HardwareSpec's reference dtypes.

    The spec quotes conversion and accumulation for fp32 masters and bf16 compute
    (`CONVERT_TRAFFIC_PER_BYTE` / `ACCUMULATE_TRAFFIC_PER_BYTE` DRAM bytes per byte) and
    `planner/build.py` (`host_rates`) scales them by the run's traffic per byte ((m + c) / c
    for a conversion, (c + 2 m) / c for an accumulation); this is its inverse, so the problem
    gets exactly the measured rates.

    Args:
        convert_bytes_per_s: compute-dtype bytes written per s by the conversion.
        accumulate_bytes_per_s: drained gradient bytes added per s.
        master_dtype, compute_dtype: the dtypes they were measured with ("fp32" | "bf16").

    Returns:
        (host_convert_bytes_per_s, host_accumulate_bytes_per_s) for the HardwareSpec.

    Raises:
        ValueError: an unknown dtype.
    """
    for name, dt in (("master_dtype", master_dtype), ("compute_dtype", compute_dtype)):
        if dt not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {list(DTYPE_BYTES)}; got {dt!r}")
    m, c = DTYPE_BYTES[master_dtype], DTYPE_BYTES[compute_dtype]
    return (convert_bytes_per_s * ((m + c) / c) / CONVERT_TRAFFIC_PER_BYTE,
            accumulate_bytes_per_s * ((c + 2 * m) / c) / ACCUMULATE_TRAFFIC_PER_BYTE)


def _with_host_rates(hw: HardwareSpec, host: dict | None, *, compute_dtype: str,
                     path: Path) -> HardwareSpec:
    """`hw` with the profile's measured host rates (its `host` section), if it has them."""
    if not host or not (host.get("convert_gb_per_s") or host.get("accumulate_gb_per_s")):
        return hw
    if host.get("master_dtype") not in DTYPE_BYTES:
        raise ValueError(f"profile {path}: host.master_dtype must be one of {list(DTYPE_BYTES)}; "
                         f"got {host.get('master_dtype')!r}; re-run `lazytrain profile`")
    conv, acc = reference_host_rates(float(host.get("convert_gb_per_s") or 0.0) * 1e9,
                                     float(host.get("accumulate_gb_per_s") or 0.0) * 1e9,
                                     master_dtype=host["master_dtype"],
                                     compute_dtype=compute_dtype)
    changes = {}
    if conv > 0:
        changes["host_convert_bytes_per_s"] = conv
    if acc > 0:
        changes["host_accumulate_bytes_per_s"] = acc
    return dataclasses.replace(hw, **changes)


# ---------------------------------------------------------------------------------------------
# The MegaTrain rule in closed form (calibration of the h800-paper preset).


def megatrain_windows(costs: ModelCosts, *, k: int = 4) -> list[tuple[str, float, float]]:
    """(window, compute_ms, link_ms) of every window under the MegaTrain rule.

    The rule: boundaries 0, k, 2k, ... and L in HBM, the rest recomputed; every block
    re-forwarded with autograd in backward (no keep-internals); no activation transfers.
    Window work follows docs/execution_model.md ("Per-window work"); link_ms is the slowest
    copy channel (h2d, d2h, duplex), so a window is compute-bound iff link_ms <= compute_ms.
    """
    c, hw, L = costs.blocks, costs.hardware, len(costs.blocks)
    mats = sorted(set(range(0, L, k)) | {L})
    seg_end = {}  # block j -> the segment (s, e) it belongs to
    for s, e in zip(mats, mats[1:]):
        for j in range(s, e):
            seg_end[j] = (s, e)

    def link(h2d: float, d2h: float) -> float:
        return max(h2d / hw.h2d_bytes_per_s, d2h / hw.d2h_bytes_per_s,
                   (h2d + d2h) / hw.duplex_bytes_per_s) * 1e3

    out = [(f"f{j}", c[j].fwd_ms, link(c[j + 1].weight_bytes if j + 1 < L else 0, 0))
           for j in range(L)]
    out.append(("turn", costs.head_ms, link(c[L - 1].weight_bytes, 0)))
    for j in range(L - 1, -1, -1):
        s, e = seg_end[j]
        comp, h2d = c[j].bwd_ms + c[j].fwd_grad_ms, c[j - 1].weight_bytes if j >= 1 else 0
        if j == e - 1:
            comp += sum(c[m].fwd_ms for m in range(s, e - 1))
            h2d += sum(c[m].weight_bytes for m in range(s, e - 1))
        out.append((f"b{j}", comp, link(h2d, c[j + 1].grad_bytes if j + 1 < L else 0)))
    return out


def megatrain_load_waits_ms(costs: ModelCosts, *, k: int = 4) -> dict[str, float]:
    """{b{e-1}: (P[e-2] + P[s]) / bw_h2d} for every segment (s, e) of the rule with recompute.

    In a compute-bound window that ends a segment, the first recompute forward waits for the
    next block's weights P[e-2] and its own P[s], which queue on the H2D stream before it
    (docs/execution_model.md, "In-window order"); later loads overlap the recompute. ms.
    """
    c, hw, L = costs.blocks, costs.hardware, len(costs.blocks)
    mats = sorted(set(range(0, L, k)) | {L})
    return {f"b{e - 1}": (c[e - 2].weight_bytes + c[s].weight_bytes) / hw.h2d_bytes_per_s * 1e3
            for s, e in zip(mats, mats[1:]) if e - s >= 2}


def megatrain_step_ms(costs: ModelCosts, *, k: int = 4) -> float:
    """Step time of one micro-batch under the MegaTrain rule, ms:
    `pre + sum_w max(compute_w + wait_w, link_w) + post` with `pre = max(embed_ms, P[0]/bw_h2d)`
    (side by side on a GPU; their sum on a CPU),
    `post = (G[0] + ends grads)/bw_d2h` and wait_w the recompute load waits
    (`megatrain_load_waits_ms`) (execution_model.md "Step time", copies overlapping; exact when
    every window is compute-bound)."""
    hw = costs.hardware
    waits = megatrain_load_waits_ms(costs, k=k)
    load = costs.blocks[0].weight_bytes / hw.h2d_bytes_per_s * 1e3
    pre = max(costs.embed_ms, load) if hw.copies_overlap_compute else costs.embed_ms + load
    post = (costs.blocks[0].grad_bytes + costs.ends_grad_bytes) / hw.d2h_bytes_per_s * 1e3
    return pre + sum(max(comp + waits.get(w, 0.0), lk)
                     for w, comp, lk in megatrain_windows(costs, k=k)) + post


def calibrate_matmul_efficiency(model: ModelSpec, hw: HardwareSpec, *, seq_len: int,
                                micro_batch: int, compute_dtype: str,
                                target_model_tflops: float, k: int = 4) -> float:
    """The matmul efficiency at which the MegaTrain rule predicts `target_model_tflops`.

    Closed form for a compute-bound scenario: every window's time is its compute (plus, where
    a segment ends, the recompute load wait), compute is proportional to 1/eff, so
    `step_ms(eff) = C1 / eff + X + W` with C1 the compute ms at eff = 1, X the pre/post link
    terms and W the load waits (both independent of eff). The target step is
    `6 * N * T / target`; hence `eff = C1 / (target_step_ms - X - W)`.
    For the h800-paper preset: Qwen3.5-27B, seq 1024, micro-batch 72, bf16, target 176.9
    TFLOPS, k = 4 (`H800_PAPER_MATMUL_EFFICIENCY`).

    Raises:
        ValueError: the scenario is not compute-bound at the resulting efficiency (the closed
            form would not hold).
    """
    unit = analytic_costs(model, _with_eff(hw, 1.0), seq_len=seq_len, micro_batch=micro_batch,
                          compute_dtype=compute_dtype)
    windows = megatrain_windows(unit, k=k)
    waits = megatrain_load_waits_ms(unit, k=k)
    c1 = sum(comp for _, comp, _ in windows)  # compute ms at eff = 1 (scales as 1/eff)
    w = sum(waits.values())  # recompute load waits, link-only: independent of eff
    # X: pre + post (P[0] H2D, embedding gather, G[0] + ends D2H); independent of eff.
    x = megatrain_step_ms(unit, k=k) - sum(max(comp + waits.get(name, 0.0), lk)
                                           for name, comp, lk in windows)
    target_step_ms = model.model_flops_per_token * unit.tokens / (target_model_tflops * 1e12) * 1e3
    eff = c1 / (target_step_ms - x - w)
    at = analytic_costs(model, _with_eff(hw, eff), seq_len=seq_len, micro_batch=micro_batch,
                        compute_dtype=compute_dtype)
    slow = [w for w, comp, lk in megatrain_windows(at, k=k) if lk > comp]
    if slow:
        raise ValueError(f"scenario is link-bound in windows {slow[:5]} at efficiency {eff:.4f}; "
                         f"the closed-form calibration does not apply")
    return eff


def _with_eff(hw: HardwareSpec, eff: float) -> HardwareSpec:
    return dataclasses.replace(hw, matmul_efficiency=eff)
