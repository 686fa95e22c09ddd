"""Assemble the `PlanningProblem` from a model, a machine and the run config.

Owns the memory model around the activation checkpoints: the fixed HBM working set, the host
bytes per parameter of the configured precision and the constant DRAM staging pools. Times and
sizes per block come from `lazytrain.spec.costs`. Also reads the data-parallel topology of a
config (`topology_of`, `rank_problem_of`; the per-rank division is `planner/topology.py`'s).
Imports spec, the problem type and the topology (no torch; the solver is never called here).

Every count and byte size of a runtime buffer below is a `lazytrain.contract` constant, the
numbers the runtime allocates by; this module restates none of them.

HBM (`fixed_hbm_bytes`, docs/execution_model.md "HBM capacity"):
    DEVICE_WEIGHT_SLOTS x max P    the engine's weight ring (4: two for double buffering, block
                                   j+1 loads while j runs; two so segment recompute loads are
                                   double-buffered too)
  + DEVICE_GRAD_BUFFERS x max G    two gradient buffers: the drain's copies in flight (blocks
                                   j+1 and j+2 while j's backward runs, GRAD_DRAIN_BUFFERS)
  + ends weights + grads           embedding, final norm, untied head resident, with their fp32
                                   gradient accumulator (ENDS_GRAD_BYTES_PER_PARAM, 4 B/param)
  + max(block workspace,           the larger of the two compute working sets: a block's in its
        head workspace)            backward window (max(max I, max G) + max G + 3A: saved
                                   activations, then autograd's per-parameter gradients, beside
                                   the gradients produced so far or their flat pack; boundary
                                   grads) and the head's in `turn` (one chunk's
                                   logits, softmax, their gradients and the [V, H] head weight
                                   gradient: `spec.costs.head_workspace_bytes`). The head runs
                                   only in `turn`, where no block computes, so they never add up.
  + block inputs                   one micro-batch's rotary tables, attention masks and positions,
                                   held from pre to post (`spec.costs.block_inputs_bytes`)
  + gradient cast buffers          grad_accum 1 with masters in another dtype: GRAD_DRAIN_BUFFERS
                                   x max G in the master dtype, each drained gradient is cast
                                   into one before its D2H lands in the accumulator
  and `hbm_bytes = hardware HBM x (1 - hardware.hbm_reserve_fraction)`.

DRAM (the planner's row: DRAM-tier checkpoints + staging + states <= `dram_bytes`):
  states   = HOST_BYTES_PER_PARAM x params: fp32 master 16 B (fp32 weights, grads, Adam m, v);
             bf16 master 12 B (bf16 weights and grads, fp32 m, v; MegaTrain).
  staging  = the bounded pinned pool for streamed weights (WEIGHT_STAGING_BUFFERS x max P), the
             pinned gradient landing buffers (GRAD_DRAIN_BUFFERS x max G, compute dtype, as the
             runtime drains) and the NVMe bounce pool (NVME_BOUNCE_BUFFERS x A padded to
             ALIGN_BYTES, 4 KiB), plus, with bf16 masters, the optimizer's fp32 scratch
             (OPTIMIZER_SCRATCH_BYTES_PER_PARAM, 8 B x the largest group: weights and gradient
             of the group being stepped; pageable, not pinned).
             PlanningProblem has one constant-DRAM field, `nvme_staging_bytes`; all of them go
             there (their split is in `provenance["memory"]`).
  `dram_bytes` = the hardware's DRAM less, with `train.method: grpo` and `grpo.kl_coef` > 0, the
             KL reference copy of the weights in the compute dtype (params x 2 or 4 B,
             `grpo_phase.reference_bytes`; `reference_bytes` in `provenance["memory"]`), which
             the run holds beside the plan.

Seed scenario numbers (Qwen3.5-27B, h800-paper, seq 1024 x 72, bf16; tests/planner/
test_build.py): 26.90e9 params x 12 B = 322.8 GB of states + ~8 GB staging fits 360 GB with
~29 GB left for DRAM-tier checkpoints (0.755 GB each); fp32 masters would need 16 B x 26.90e9 =
430.3 GB, more than the 360 GB budget on their own.
"""

from __future__ import annotations

import dataclasses

from lazytrain import __version__
from lazytrain.config import RunConfig
from lazytrain.contract import (
    DEVICE_GRAD_BUFFERS, DEVICE_WEIGHT_SLOTS, ENDS_GRAD_BYTES_PER_PARAM, GRAD_DRAIN_BUFFERS,
    HOST_BYTES_PER_PARAM, HOST_BYTES_PER_PARAM_Q8, NVME_BOUNCE_BUFFERS,
    OPTIMIZER_SCRATCH_BYTES_PER_PARAM, WEIGHT_STAGING_BUFFERS, align_up,
)
from lazytrain.planner.grpo_phase import reference_bytes
from lazytrain.planner.inference_plans import HEAD_FORWARD_SHARE
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.topology import Topology, rank_problem
from lazytrain.spec.costs import DTYPE_BYTES, ModelCosts, analytic_costs, profile_costs
from lazytrain.spec.hardware import (
    ACCUMULATE_TRAFFIC_PER_BYTE, CONVERT_TRAFFIC_PER_BYTE, OVERRIDE_FIELDS, PRESETS, HardwareSpec,
    get_hardware,
)
from lazytrain.spec.model import ModelSpec


def build_problem(model: ModelSpec, hardware: HardwareSpec, cfg: RunConfig, *,
                  costs: ModelCosts | None = None) -> PlanningProblem:
    """The planning problem for `model` on `hardware` under `cfg` (one micro-batch's windows).

    Args:
        model: the architecture.
        hardware: the machine (overrides already applied).
        cfg: the run config (train batch shape and dtypes, planner options, hardware reserve,
            profile path, runtime head chunk).
        costs: precomputed costs; default: from `cfg.hardware.profile_path` when set, else the
            analytic model.

    Returns:
        The `PlanningProblem`, with provenance: model, model_config_sha256, hardware,
        hardware_spec, seq_len, micro_batch, grad_accum, dtype, master_dtype, created_by,
        config (the resolved run config), horizons, costs_source, memory (the budget split).
        `head_turn_factor` is `head_turn_factor(cfg.train.method)`; a plan of a problem where
        it is not 1 records it (`planner/evaluate.py` `head_terms_of`).
    """
    t, p = cfg.train, cfg.planner
    if costs is None:
        costs = _costs(model, hardware, cfg)
    hw = costs.hardware
    mem = memory_budget(model, costs, cfg)
    blocks = costs.blocks
    horizons = {"drain_windows": p.drain_windows, "prefetch_windows": p.prefetch_windows,
                "nvme_lead_windows": p.nvme_lead_windows, "k_max": p.k_max}
    provenance = {
        "model": cfg.model.name or model.name,
        "model_config_sha256": model.config_sha256,
        "hardware": hw.name,
        "hardware_spec": hw.to_dict(),
        "seq_len": cfg.data.seq_len,
        "micro_batch": t.micro_batch,
        "grad_accum": t.grad_accum,
        "dtype": t.compute_dtype,
        "master_dtype": t.master_dtype,
        "created_by": f"lazytrain {__version__}",
        "config": cfg.to_dict(),
        "horizons": horizons,
        "costs_source": costs.source,
        "memory": mem,
    }
    turn_factor = head_turn_factor(t.method)
    return PlanningProblem(
        name=f"{provenance['model']} @ {hw.name}",
        fwd_ms=tuple(c.fwd_ms for c in blocks),
        fwd_grad_ms=tuple(c.fwd_grad_ms for c in blocks),
        reforward_ms=tuple(c.reforward_ms for c in blocks),
        **save_level_fields(blocks, enabled=p.save_levels),
        bwd_ms=tuple(c.bwd_ms for c in blocks),
        weight_bytes=tuple(c.weight_bytes for c in blocks),
        grad_bytes=tuple(c.grad_bytes for c in blocks),
        internal_bytes=tuple(c.internal_bytes for c in blocks),
        boundary_bytes=costs.boundary_bytes,
        params_per_block=tuple(b.params for b in model.blocks),
        ends_params=model.ends_params,
        embed_ms=costs.embed_ms, head_ms=costs.head_ms, head_turn_factor=turn_factor,
        const_ms=costs.step_const_ms,
        **({} if costs.q8_update_ms_per_gparam is None  # measured, else the problem's default
           else {"q8_update_ms_per_gparam": costs.q8_update_ms_per_gparam}),
        window_overhead_ms=costs.window_overhead_ms,
        ends_grad_bytes=costs.ends_grad_bytes,
        h2d_bytes_per_s=hw.h2d_bytes_per_s, d2h_bytes_per_s=hw.d2h_bytes_per_s,
        duplex_bytes_per_s=hw.duplex_bytes_per_s,
        nvme_read_bytes_per_s=hw.nvme_read_bytes_per_s,
        nvme_write_bytes_per_s=hw.nvme_write_bytes_per_s,
        **host_rates(hw, master_dtype=t.master_dtype, compute_dtype=t.compute_dtype),
        copies_overlap_compute=hw.copies_overlap_compute,
        hbm_bytes=mem["hbm_budget_bytes"], fixed_hbm_bytes=mem["fixed_hbm_bytes"],
        # GRPO with a KL term holds a reference copy of the weights in DRAM beside the plan
        dram_bytes=hw.dram_bytes - mem.get("reference_bytes", 0),
        nvme_bytes=hw.nvme_bytes,
        nvme_staging_bytes=mem["staging_bytes"], nvme_bounce_bytes=mem["nvme_bounce_bytes"],
        host_scratch_bytes=mem["optimizer_scratch_bytes"],
        master_bytes_ratio=DTYPE_BYTES[t.master_dtype] / DTYPE_BYTES[t.compute_dtype],
        weight_path_choice=True, cast_gradients=True,
        host_bytes_per_param=HOST_BYTES_PER_PARAM[t.master_dtype],
        host_bytes_per_param_q8=HOST_BYTES_PER_PARAM_Q8[t.master_dtype],
        drain_windows=p.drain_windows, prefetch_windows=p.prefetch_windows,
        nvme_lead_windows=p.nvme_lead_windows, k_max=p.k_max, allow_keep=p.allow_keep,
        allow_q8=p.allow_q8, grad_accum=t.grad_accum, tokens_per_micro_batch=costs.tokens,
        model_flops_per_micro_batch=model.model_flops_per_token * costs.tokens,
        hardware_flops_per_micro_batch_base=sum(c.fwd_flops + c.bwd_flops for c in blocks)
        + costs.head_flops * turn_factor,  # DPO: its second head forward runs too
        block_fwd_flops=tuple(c.fwd_flops for c in blocks),
        provenance=provenance,
    )


def head_turn_factor(method: str) -> float:
    """The problem's `head_turn_factor` for `train.method`: the head compute in `turn` per
    micro-batch in units of `head_ms` (one forward and one backward of the head and loss).

    sft and grpo are chunk-local (a sum of per-token terms): each chunk of the head runs its
    forward and backward once, 1. dpo is nonlinear in per-sequence sums, so the head runs a
    forward without gradient for the log-probs [B, S] first, then each chunk's forward again
    with its backward (`runtime/objectives.py`): 1 + HEAD_FORWARD_SHARE (the forward's share
    of `head_ms`, backward ~ 2 x forward: `planner/inference_plans.py`), 4/3.

    `head_ms` itself, measured or analytic, stays the one-pass figure, whatever the method:
    the profiler times the head with the SFT cross entropy (`profile/bench_blocks.py`
    `BlockBench.head`), so a calibration serves every method, and a refit of measured turn
    windows divides this factor out again (`planner/refit.py`).

    Raises:
        ValueError: an unknown method (names train.method and the accepted ones).
    """
    if method in ("sft", "grpo"):
        return 1.0
    if method == "dpo":
        return 1.0 + HEAD_FORWARD_SHARE
    raise ValueError(f"train.method must be one of sft, dpo, grpo; got {method!r}")


def save_level_fields(blocks, *, enabled: bool) -> dict:
    """The problem's `saved_bytes` (S1, S2 per block) and `reforward_l1_ms` from the blocks'
    costs (`spec.costs.BlockCosts`: analytic, or measured by a profile); both empty (levels
    unavailable, every block L0) when `planner.save_levels` is false or a block's family has
    no save-level sets (S2 = 0)."""
    if not enabled or any(c.saved_bytes[1] <= 0 for c in blocks):
        return {"saved_bytes": (), "reforward_l1_ms": ()}
    return {"saved_bytes": tuple(tuple(c.saved_bytes) for c in blocks),
            "reforward_l1_ms": tuple(c.reforward_l1_ms for c in blocks)}


def host_rates(hw: HardwareSpec, *, master_dtype: str, compute_dtype: str) -> dict:
    """The problem's host conversion and accumulation rates for the run's dtypes, bytes/s.

    The hardware quotes them for fp32 masters and bf16 compute (3 B of DRAM traffic per
    converted byte, 5 B per accumulated gradient byte: `spec.hardware`); host work is memory
    bound, so the rate scales with the traffic per byte of the run: conversion reads the master
    and writes the compute dtype, (m + c) / c bytes per converted byte; accumulation reads the
    drained compute-dtype gradient and reads and writes the master-dtype accumulator,
    (c + 2 m) / c bytes per gradient byte. bf16 masters and compute (the seed scenario): 2 and
    3, so 1.5x and 5/3x the quoted rates. A rate of 0 (not modelled) stays 0.

    Returns:
        {"host_convert_bytes_per_s": ..., "host_accumulate_bytes_per_s": ...}.
    """
    m, c = DTYPE_BYTES[master_dtype], DTYPE_BYTES[compute_dtype]
    return {"host_convert_bytes_per_s":
            hw.host_convert_bytes_per_s * CONVERT_TRAFFIC_PER_BYTE / ((m + c) / c),
            "host_accumulate_bytes_per_s":
            hw.host_accumulate_bytes_per_s * ACCUMULATE_TRAFFIC_PER_BYTE / ((c + 2 * m) / c)}


def memory_budget(model: ModelSpec, costs: ModelCosts, cfg: RunConfig) -> dict:
    """The HBM and DRAM split of the module docstring, in bytes (ints).

    Returns:
        dict with hbm_budget_bytes, fixed_hbm_bytes and its parts (weight_buffers_bytes,
        grad_buffers_bytes, ends_bytes, the larger of block_workspace_bytes and
        head_workspace_bytes, block_inputs_bytes),
        states_bytes, staging_bytes and its parts (weight_pool_bytes, grad_landing_bytes,
        nvme_bounce_bytes), with a GRPO KL reference copy its reference_bytes (the key is
        absent without one), dram_free_for_checkpoints_bytes (hardware DRAM less the copy,
        the states and staging; may be negative: states alone do not fit).
    """
    hw = costs.hardware
    max_p = max(c.weight_bytes for c in costs.blocks)
    max_g = max(c.grad_bytes for c in costs.blocks)
    a = max(costs.boundary_bytes)
    parts = {
        "weight_buffers_bytes": DEVICE_WEIGHT_SLOTS * max_p,
        "grad_buffers_bytes": DEVICE_GRAD_BUFFERS * max_g,
        # the ends' gradient accumulates in fp32 on the device (4 B/param, whatever the
        # compute dtype: chunked head gradients add up without bf16 rounding)
        "ends_bytes": costs.ends_weight_bytes + ENDS_GRAD_BYTES_PER_PARAM * model.ends_params,
        "block_workspace_bytes": costs.block_workspace_bytes,
        "head_workspace_bytes": costs.head_workspace_bytes,
        "block_inputs_bytes": costs.block_inputs_bytes,
        # one micro-batch per step, masters in another dtype: each drained gradient is cast
        # to the master dtype on the device first (runtime/streams.py GradDrain land_all)
        "grad_cast_bytes": _grad_cast_bytes(max_g, cfg),
    }
    largest_group = max([b.params for b in model.blocks] + [model.ends_params])
    staging = {
        "weight_pool_bytes": WEIGHT_STAGING_BUFFERS * max_p,
        "grad_landing_bytes": GRAD_DRAIN_BUFFERS * max_g,
        "nvme_bounce_bytes": NVME_BOUNCE_BUFFERS * align_up(a),
        # bf16 masters: AdamW steps an fp32 [2, largest group] copy (runtime/optim.py)
        "optimizer_scratch_bytes": (OPTIMIZER_SCRATCH_BYTES_PER_PARAM * largest_group
                                    if cfg.train.master_dtype == "bf16" else 0),
    }
    states = int(HOST_BYTES_PER_PARAM[cfg.train.master_dtype] * model.total_params)
    staging_bytes = sum(staging.values())
    reference = reference_bytes(model.total_params, method=cfg.train.method,
                                kl_coef=cfg.grpo.kl_coef, compute_dtype=cfg.train.compute_dtype)
    return {
        "hbm_budget_bytes": int(hw.hbm_bytes * (1 - cfg.hardware.hbm_reserve_fraction)),
        # the block and head workspaces are never live together (module docstring)
        "fixed_hbm_bytes": sum(parts.values()) - min(parts["block_workspace_bytes"],
                                                     parts["head_workspace_bytes"]),
        **parts,
        "states_bytes": states,
        "staging_bytes": staging_bytes,
        **staging,
        **({"reference_bytes": reference} if reference else {}),  # a plan JSON without: none
        "dram_free_for_checkpoints_bytes": hw.dram_bytes - reference - states - staging_bytes,
    }


def _grad_cast_bytes(max_g: int, cfg: RunConfig) -> int:
    """GRAD_DRAIN_BUFFERS device buffers of the largest block's gradient in the master dtype,
    bytes, when one micro-batch per step casts gradients on the device (masters in another
    dtype than the compute dtype, grad_accum 1); else 0."""
    m, c = DTYPE_BYTES[cfg.train.master_dtype], DTYPE_BYTES[cfg.train.compute_dtype]
    if cfg.train.grad_accum != 1 or m == c:
        return 0
    return GRAD_DRAIN_BUFFERS * max_g * m // c


def hardware_from_config(cfg: RunConfig) -> HardwareSpec:
    """The `hardware:` section resolved: preset or file, with the GB-unit overrides applied.

    Raises:
        ValueError: a figure outside its plausible range (`spec.hardware.PLAUSIBLE_RANGES`),
            one line naming the key (or the file's field), the value and the likely unit
            mistake; `hardware.allow_implausible: true` skips this check.
    """
    h = cfg.hardware
    overrides = {k: getattr(h, k) for k in (
        "hbm_gb", "dram_gb", "nvme_gb", "h2d_gb_per_s", "d2h_gb_per_s", "duplex_gb_per_s",
        "nvme_read_gb_per_s", "nvme_write_gb_per_s", "peak_tflops", "matmul_efficiency")}
    spec = get_hardware(h.preset, overrides)
    if not getattr(h, "allow_implausible", False):
        labels = {OVERRIDE_FIELDS[k][0]: (f"hardware.{k}", OVERRIDE_FIELDS[k][1])
                  for k, v in overrides.items() if v is not None}
        origin = f"hardware.preset {h.preset}" if h.preset in PRESETS else f"{h.preset}:"
        for f in dataclasses.fields(spec):
            labels.setdefault(f.name, (f"{origin} {f.name}", 1.0))
        bad = spec.implausible_figures(labels=labels)
        if bad:
            raise ValueError(bad[0])
    return spec


def problem_from_config(cfg: RunConfig) -> PlanningProblem:
    """`build_problem` on the model and hardware the config names.

    Raises:
        FileNotFoundError: the model config, hardware file or profile does not exist.
        ValueError: unsupported model type, unknown preset, mismatching profile.
    """
    model = ModelSpec.from_hf_config(cfg.model.config_path, name=cfg.model.name)
    return build_problem(model, hardware_from_config(cfg), cfg)


def rank_problem_from_config(cfg: RunConfig) -> PlanningProblem:
    """The problem one rank plans: `problem_from_config`, and with `dist.nproc_per_node` > 1
    the node's DRAM, NVMe and PCIe divided among its ranks (`lazytrain.planner.topology`).

    Raises:
        as `problem_from_config`; ValueError: more ranks than `hardware.gpus_per_node`.
    """
    return rank_problem_of(cfg, problem_from_config(cfg))


def topology_from_config(cfg: RunConfig, hardware: HardwareSpec) -> Topology:
    """The topology of `cfg` (dist section, hardware topology overrides) on `hardware`."""
    h = cfg.hardware
    pick = lambda override, default: default if override is None else override  # noqa: E731
    return Topology(nproc_per_node=cfg.dist.nproc_per_node, nnodes=cfg.dist.nnodes,
                    gpus_per_node=pick(h.gpus_per_node, hardware.gpus_per_node),
                    gpus_per_pcie_switch=pick(h.gpus_per_pcie_switch,
                                              hardware.gpus_per_pcie_switch),
                    nvme_devices_per_node=pick(h.nvme_devices_per_node,
                                               hardware.nvme_devices_per_node),
                    allreduce_bytes_per_s=cfg.dist.allreduce_gb_per_s * 1e9,
                    shared_masters=cfg.dist.shared_masters)


def topology_of(cfg: RunConfig) -> Topology | None:
    """The topology of a data-parallel `cfg` (`topology_from_config` on its hardware), or None
    for one process (one rank on one node: nothing is shared).

    Raises:
        ValueError: more ranks than the node's GPUs, or an implausible hardware figure.
    """
    if cfg.dist.nproc_per_node == 1 and cfg.dist.nnodes == 1:
        return None
    return topology_from_config(cfg, hardware_from_config(cfg))


def rank_problem_of(cfg: RunConfig, problem: PlanningProblem) -> PlanningProblem:
    """The problem one rank of `cfg`'s job plans: `rank_problem(problem, topology_of(cfg))`,
    or `problem` itself for one process.

    Args:
        cfg: the run config (dist section, hardware topology overrides).
        problem: the node-level problem of `cfg`.

    Raises:
        ValueError: as `topology_of`.
    """
    topo = topology_of(cfg)
    return problem if topo is None else rank_problem(problem, topo)


def _costs(model: ModelSpec, hw: HardwareSpec, cfg: RunConfig) -> ModelCosts:
    kwargs = dict(seq_len=cfg.data.seq_len, micro_batch=cfg.train.micro_batch,
                  compute_dtype=cfg.train.compute_dtype,
                  head_chunk_tokens=cfg.runtime.head_chunk_tokens)
    if cfg.hardware.profile_path:
        return profile_costs(model, cfg.hardware.profile_path, hw=hw, **kwargs)
    return analytic_costs(model, hw, **kwargs)
