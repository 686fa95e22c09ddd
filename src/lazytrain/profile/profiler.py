"""Measure the cost model on this machine: block times per kind, transfer rates, contention.

Owns `measure_profile`, the measurements behind `lazytrain profile`, assembled into a profile
dict in the schema of `lazytrain.spec.costs`. Everything is timed through the engine's own code
paths: blocks and the head through `profile/bench_blocks.py` (`BlockBench`: the engine's block
and head calls on a flat weight buffer), copies, NVMe, the optimizer and the host work through
`profile/bench_rates.py` (`Tensor.copy_` as `runtime.streams` does them, `ActivationStore`
transfers up to the window barrier, `BlockOptimizer`, the runtime's host workers).

Timing: warm-up runs, then the median of `repeats`; CUDA events on a GPU, `time.perf_counter`
(monotonic) on a CPU. The quick mode (the calibration `lazytrain train` measures, often on a
machine shared with other jobs) takes the block and end times as the least repeat, measured
again when the repeats spread widely or other processes loaded the CPUs meanwhile
(`runtime/steady.py`).

Contention (CPU only; on a GPU copies run on copy engines beside compute): the evaluator's CPU
model serialises channels with compute (window = compute + sum of bytes / rate). The rates
written for the CPU are therefore *effective* rates under contention:
- h2d / d2h copies run synchronously on the compute thread: their rate is the copy rate;
- NVMe I/O runs on worker threads while the window computes; its effective rate is
  bytes / (time(compute with the I/O in flight) - time(compute alone)), i.e. what the I/O adds
  to a window;
- the optimizer worker updates block j while the forward of the next step waits for it
  (`Engine.prefetch_weights`); what it adds to a step is measured by replaying that pattern
  (updates queued, forward chain gated per block) minus the forward alone, and written as the
  profile's `step_const_ms` (with the per-step load of the resident ends).
The `cpu_contention` entry records the raw factors (compute slowdown while the optimizer runs,
rates alone and with the optimizer) for the report.

Save levels (`profile/save_levels.py`): per block kind the bytes the runtime's L1 / L2 forward
keeps and the L1 re-forward's time (L1 backward less L2 backward).

Host work (`host_rates`): the conversion and accumulation rates on the runtime's own host
workers, the NVMe staging memcpy and the optimizer update, the profile's `host` section.

Engine overheads (`profile.overhead`): the engine's fixed cost of a window and of a step, from
`Engine.step` on small twins of the model; the per-step part and the gradient-norm pass join
`step_const_ms`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from lazytrain.models.adapter import ModelAdapter
from lazytrain.profile.bench_blocks import BlockBench, block_kind_times, time_ms, time_samples
from lazytrain.profile.bench_rates import (
    copy_rates, grad_norm_ms, host_rates, nvme_rates, optimizer_exposed_ms,
    optimizer_ms_per_param, optimizer_running,
)
from lazytrain.profile.overhead import window_overhead_ms
from lazytrain.profile.save_levels import save_level_entries
from lazytrain.runtime.steady import SteadyTiming, Timing, median_timing
from lazytrain.units import GB

QUICK_REPEATS = 3
"""Timed runs per measurement in the quick (calibration) mode of `measure_profile`: the fewest
whose median still drops one disturbed run (a shared machine); the block and end times take
the least of them (`runtime.steady`)."""
QUICK_WARMUP = 1
"""Warm-up runs per measurement in the quick mode (one: first-touch and allocator effects)."""
TWIN_STEPS_PER_REPEAT = 10
"""Engine steps of each overhead twin per `repeats` (a twin step takes ~20 ms; o is the
difference of two residuals of a few ms each, within timer noise at 3 samples: at 9 the fit
gave o = 0 in one of five quick profiles on the 2-core machine)."""


def measure_profile(adapter: ModelAdapter, kinds: Sequence[str], *, micro_batch: int,
                    seq_len: int, compute_dtype: str, device: str | torch.device,
                    nvme_dir: Path | str, io_threads: int = 2, repeats: int = 5,
                    warmup: int = 2, model_config_sha256: str | None = None,
                    log: Callable[[str], None] = lambda msg: None, quick: bool = False,
                    timing: Timing | None = None, model_numel: int | None = None) -> dict:
    """Everything `lazytrain profile` measures, as a profile dict (`lazytrain.spec.costs`).

    Args:
        adapter: the model, as the engine would run it, or a cut of it holding one block of
            each kind (`models.cut`; the run's model need not fit in memory).
        kinds: `BlockSpec.kind` of each of the adapter's blocks (len L).
        micro_batch, seq_len, compute_dtype: the run's batch shape and dtype.
        device: "cpu" or "cuda".
        nvme_dir: directory of the NVMe tier (files removed afterwards).
        io_threads: NVMe worker threads (as the run's `runtime.io_threads`).
        repeats, warmup: timed and untimed runs per measurement.
        model_config_sha256: recorded so a profile is not applied to another model.
        log: progress lines.
        quick: calibration mode: the same measurements with `QUICK_REPEATS` timed runs and
            `QUICK_WARMUP` warm-up runs each (overrides `repeats` / `warmup`): a median of 3
            instead of 5, which drops one disturbed run but not two (the full mode drops
            two); NVMe and optimizer figures use max(2, repeats // 2) = 2 runs either way.
            The block and end times then take the least repeat and are measured again when
            disturbed (`runtime.steady.SteadyTiming`; its record goes to
            `measurements.steady`).
        timing: the block and end times' rule (default: `SteadyTiming` when quick, else the
            median, `runtime.steady.median_timing`); tests pass a `SteadyTiming` with an
            injected load clock.
        model_numel: parameters of the whole model when `adapter` is a cut of it (None: the
            adapter is the whole model). The two step terms that grow with the model, the
            exposed optimizer (every group's update precedes the forward) and the gradient
            norm, are scaled by model_numel / the adapter's parameters, so `step_const_ms`
            stays a whole-model figure; the factor is recorded as
            `measurements.whole_model_scale`.

    Returns:
        the profile: version, model_config_sha256, seq_len, micro_batch, compute_dtype, device,
        block_kinds, ends (embed_ms, head_ms: one SFT head pass, `BlockBench.head`; the
        planner prices DPO's second pass on it), bandwidths (GB/s; effective under contention
        on a CPU), step_const_ms (exposed optimizer + ends load + gradient norm + the
        twins' per-step overhead, ms, of the whole model), host (`host_rates`), window_overhead_ms
        (`window_overhead_ms`; absent when the family has no twin), measurements (raw rates
        alone and with the optimizer running, the twins' figures and, quick, the `steady`
        record per measurement) and, on a CPU, cpu_contention.
    """
    if quick:
        repeats, warmup = QUICK_REPEATS, QUICK_WARMUP
    dev = torch.device(device)
    bench = BlockBench(adapter, micro_batch=micro_batch, seq_len=seq_len, dtype=compute_dtype,
                       device=dev)
    log(f"profile: blocks ({len(set(kinds))} kinds)")
    if timing is None:
        timing = SteadyTiming(log=log) if quick else median_timing
    block = block_kind_times(bench, kinds, repeats=repeats, warmup=warmup, timing=timing)
    log("profile: save levels (saved bytes, L1 re-forward)")
    for kind, entry in save_level_entries(bench, kinds, repeats=repeats, warmup=warmup,
                                          timing=timing, log=log).items():
        block[kind].update(entry)
    ends = timing(lambda: {
        "embed_ms": time_samples(bench.embed, device=dev, repeats=repeats, warmup=warmup),
        "head_ms": time_samples(bench.head, device=dev, repeats=repeats, warmup=warmup)}, "ends")
    weight_bytes = adapter.params.max_block_numel() * bench.ends.element_size()
    boundary_bytes = bench.h.numel() * bench.h.element_size()
    nvme_bytes = max(boundary_bytes, 1 << 20)
    log("profile: copies and NVMe")
    alone = {**copy_rates(weight_bytes, device=dev, repeats=repeats),
             **nvme_rates(nvme_dir, nvme_bytes, io_threads=io_threads, repeats=max(2, repeats // 2))}
    numel = adapter.params.max_block_numel()
    with optimizer_running(numel):
        busy = {**copy_rates(weight_bytes, device=dev, repeats=repeats),
                **nvme_rates(nvme_dir, nvme_bytes, io_threads=io_threads,
                             repeats=max(2, repeats // 2))}
    log("profile: optimizer")
    opt = optimizer_exposed_ms(bench, repeats=max(2, repeats // 2))
    measurements = {"alone_gb_per_s": {k: v / GB for k, v in alone.items()},
                    "with_optimizer_gb_per_s": {k: v / GB for k, v in busy.items()},
                    "copy_bytes": weight_bytes, "nvme_bytes": nvme_bytes,
                    "optimizer_ms_per_mparam": optimizer_ms_per_param(numel) * 1e6, **opt}
    if isinstance(timing, SteadyTiming):
        measurements["steady"] = dict(timing.records)
    rates = dict(alone)
    profile = {"version": 1, "model_config_sha256": model_config_sha256,
               "seq_len": seq_len, "micro_batch": micro_batch, "compute_dtype": compute_dtype,
               "device": dev.type, "block_kinds": {}, "ends": ends}
    if dev.type == "cpu":
        j0 = block[kinds[0]]["block"]
        flat = bench.weights(j0)
        compute = (lambda: bench.forward(j0, flat))
        log("profile: CPU contention")
        eff = nvme_rates(nvme_dir, nvme_bytes, io_threads=io_threads,
                         repeats=max(2, repeats // 2), overlap_with=compute)
        rates.update(eff)
        fwd_alone = block[kinds[0]]["fwd_ms"]
        with optimizer_running(numel):
            fwd_busy = time_ms(compute, device=dev, repeats=repeats, warmup=1)
        profile["cpu_contention"] = {
            "compute_slowdown_with_optimizer": fwd_busy / fwd_alone if fwd_alone > 0 else 1.0,
            "nvme_effective_gb_per_s": {k: v / GB for k, v in eff.items()},
            "model": "window = compute + sum(bytes / effective rate); step += step_const_ms"}
    for kind, entry in block.items():
        profile["block_kinds"][kind] = {k: v for k, v in entry.items() if k != "block"}
    profile["bandwidths"] = {"h2d_gb_per_s": rates["h2d"] / GB, "d2h_gb_per_s": rates["d2h"] / GB,
                             "duplex_gb_per_s": rates["duplex"] / GB,
                             "nvme_read_gb_per_s": rates["nvme_read"] / GB,
                             "nvme_write_gb_per_s": rates["nvme_write"] / GB}
    # exposed optimizer + ends load; + the gradient norm and the twins' per-step overhead;
    # a cut model's optimizer and norm terms scaled to the whole model's parameters
    scale = 1.0 if model_numel is None else model_numel / adapter.params.total_numel()
    if model_numel is not None:
        measurements["whole_model_scale"] = {"model_numel": model_numel, "factor": scale,
                                             "measured_numel": adapter.params.total_numel()}
    profile["step_const_ms"] = opt["exposed_ms"] * scale + opt["ends_load_ms"]
    log("profile: host work")
    profile["host"] = host_rates(bench, repeats=repeats, warmup=warmup)
    norm_ms = grad_norm_ms(adapter.params, repeats=repeats, warmup=warmup)
    measurements["grad_norm_ms"] = norm_ms
    profile["step_const_ms"] += norm_ms * scale
    log("profile: engine overheads (two twins)")
    try:
        overhead = window_overhead_ms(adapter, compute_dtype=compute_dtype, device=dev,
                                      nvme_dir=nvme_dir, io_threads=io_threads,
                                      steps=TWIN_STEPS_PER_REPEAT * repeats, warmup=warmup)
    except ValueError as exc:  # a family without a twin: the terms stay unmodelled (0)
        log(f"profile: {exc}; window_overhead_ms not measured")
        measurements["engine_overhead"] = {"error": str(exc)}
    else:
        profile["window_overhead_ms"] = overhead["window_overhead_ms"]
        profile["step_const_ms"] += overhead["step_overhead_ms"]
        measurements["engine_overhead"] = overhead
    profile["measurements"] = measurements
    return profile
