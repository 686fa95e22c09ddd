"""Preflight: before the first step, check that the plan fits this machine as it is right now.

Three checks, each comparing bytes the run will need with bytes available:

- host memory: `MemAvailable` of /proc/meminfo >= the plan's DRAM bytes (host states at
  16 B/param, dram-tier checkpoints, NVMe staging) + the GRPO KL reference copy (with
  `grpo.kl_coef` > 0) + (on CPU, where "HBM" is host memory too) the plan's peak HBM bytes;
- pinned memory (CUDA only): the page-locked host bytes (dram-tier checkpoints, staging
  pools) fit in `MemAvailable` and in the cgroup's `memory.max` less its `memory.current`.
  `cudaHostAlloc` is not governed by RLIMIT_MEMLOCK (`ulimit -l`): the driver pins the pages
  itself, and what can fail is the memory behind them (a container's cgroup limit first);
- disk: free bytes in `nvme_dir` >= the plan's NVMe bytes, and free bytes in the run
  directory >= two checkpoints (the new one is complete before the old one is removed).

Runs before any weight is loaded, so the numbers are the machine's, not ours. A failed check
raises `PreflightError` whose message is one line with the numbers; the CLI exits 1 with it.

`preflight_reference_budget` compares the plan's DRAM plus the GRPO KL reference copy with the
configured DRAM (`hardware.dram_gb`): the planner leaves the copy out of the DRAM it plans in,
but a plan given to the run, or one a rule-based policy returns over its budget, may not.

`preflight_host_floor` runs earlier still, before planning: a calibration on a cache miss
builds the model on this machine, and one too small for the model's host states (which every
plan keeps in DRAM) would be killed there by the OOM killer, without a line. Knows nothing
about torch.
"""

from __future__ import annotations

import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from lazytrain.errors import JobFailure
from lazytrain.units import GB


class PreflightError(JobFailure, RuntimeError):
    """A resource the plan needs is not available (message: one line with the numbers)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Check:
    """One preflight comparison."""

    name: str
    """"host memory", "pinned memory", "nvme space", "checkpoint space" or "DRAM budget"."""
    need_bytes: int
    have_bytes: int | None
    """None: unknown on this system (the check passes with a note)."""
    where: str = ""
    """What was measured (path, limit name)."""

    @property
    def ok(self) -> bool:
        return self.have_bytes is None or self.need_bytes <= self.have_bytes

    def describe(self) -> str:
        have = "unknown" if self.have_bytes is None else amount(self.have_bytes)
        return (f"{self.name}: need {amount(self.need_bytes)}, have {have}"
                + (f" ({self.where})" if self.where else ""))


BYTES_BELOW = 10_000_000
"""Amounts under 10 MB are said in bytes: 0.01 GB, the last digit `.2f` GB shows, is 10 MB, so
a nearly full disk would read "need 0.00 GB, have 0.00 GB"."""


def amount(nbytes: int) -> str:
    """`nbytes` in words: "12.34 GB", or "1048576 bytes" under `BYTES_BELOW`."""
    return f"{nbytes:.0f} bytes" if abs(nbytes) < BYTES_BELOW else f"{nbytes / GB:.2f} GB"


def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """`MemAvailable` in bytes, or None where /proc/meminfo does not exist (non-Linux)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except OSError:
        return None
    return None


def memlock_limit_bytes() -> int | None:
    """Soft RLIMIT_MEMLOCK in bytes; None when unlimited (reported, not checked: it does not
    govern cudaHostAlloc)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def cgroup_free_bytes(cgroup_dir: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes the cgroup (v2) may still allocate: `memory.max` - `memory.current`; None when
    there is no limit ("max") or no cgroup v2 files."""
    try:
        limit = Path(cgroup_dir, "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path(cgroup_dir, "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def pinnable_bytes(meminfo: str | Path = "/proc/meminfo",
                   cgroup_dir: str | Path = "/sys/fs/cgroup") -> int | None:
    """Host bytes that page-locked allocations can still take: the smaller of MemAvailable and
    the cgroup's free bytes (None when neither is known)."""
    known = [b for b in (mem_available_bytes(meminfo), cgroup_free_bytes(cgroup_dir))
             if b is not None]
    return min(known) if known else None


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem of `path` (its nearest existing ancestor)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def run_checks(*, device: str, host_bytes: int, hbm_bytes: int, pinned_bytes: int,
               nvme_bytes: int, nvme_dir: str | Path, checkpoint_bytes: int,
               checkpoints_kept: int = 1, checkpoints_written: int | None = None,
               run_dir: str | Path, meminfo: str | Path = "/proc/meminfo",
               cgroup_dir: str | Path = "/sys/fs/cgroup", freed_bytes: int = 0,
               reference_bytes: int = 0) -> list[Check]:
    """All preflight comparisons (none raises).

    Args:
        device: "cpu" or "cuda".
        host_bytes: host DRAM the run needs (the plan's DRAM bytes), bytes.
        hbm_bytes: the plan's peak device bytes (counted as host memory on CPU), bytes.
        pinned_bytes: page-locked host bytes the CUDA path allocates, bytes.
        nvme_bytes: the plan's NVMe checkpoint bytes, bytes.
        nvme_dir: where the NVMe tier writes.
        checkpoint_bytes: size of one training checkpoint, bytes.
        checkpoints_kept: `train.keep_checkpoints`; a save writes one more before the oldest
            goes, so the run directory needs room for that many plus one.
        checkpoints_written: the most checkpoints this run can save (one per step it trains),
            or None when unknown; no more than that many are ever new on the disk at once, so
            the room asked is min(checkpoints_kept + 1, checkpoints_written) checkpoints (the
            ones already there are counted by the disk's free space).
        run_dir: where checkpoints are written.
        meminfo: the meminfo file (tests pass a fake one).
        cgroup_dir: the cgroup v2 directory holding memory.max / memory.current (tests: fake).
        freed_bytes: bytes in `run_dir` that `--overwrite` deletes before the first save (the
            previous run's files, `rundir.run_state_bytes`), counted as free there.
        reference_bytes: the GRPO KL reference copy (`planner.grpo_phase.reference_bytes`;
            pageable host memory beside the plan's), bytes; 0 without one.
    """
    host_need = host_bytes + reference_bytes + (hbm_bytes if device == "cpu" else 0)
    checks = [Check(name="host memory", need_bytes=host_need,
                    have_bytes=mem_available_bytes(meminfo), where="MemAvailable")]
    if device == "cuda":
        checks.append(Check(name="pinned memory", need_bytes=pinned_bytes,
                            have_bytes=pinnable_bytes(meminfo, cgroup_dir),
                            where="MemAvailable and cgroup memory.max"))
    if nvme_bytes > 0:
        checks.append(Check(name="nvme space", need_bytes=nvme_bytes,
                            have_bytes=free_bytes(nvme_dir), where=str(nvme_dir)))
    at_once = checkpoints_kept + 1
    if checkpoints_written is not None:
        at_once = min(at_once, max(1, checkpoints_written))
    checks.append(Check(name="checkpoint space", need_bytes=at_once * checkpoint_bytes,
                        have_bytes=free_bytes(run_dir) + freed_bytes,
                        where=str(run_dir) + (f", with the {freed_bytes} bytes of the previous "
                                              f"run --overwrite deletes" if freed_bytes else "")))
    return checks


def preflight(*, compute_dtype: str = "fp32", **kwargs) -> list[Check]:
    """`run_checks(**kwargs)`, raising on the first failure; `compute_dtype`
    (`train.compute_dtype`) picks the fixes offered for a GRPO KL reference copy.

    Raises:
        PreflightError: one line, e.g. "preflight: host memory: need 9.10 GB, have 3.20 GB
            (MemAvailable); lower train.micro_batch or data.seq_len, or free memory"; with
            `reference_bytes` the host-memory line names the copy and `grpo.kl_coef`.
    """
    checks = run_checks(**kwargs)
    hints = {"host memory": "lower train.micro_batch or data.seq_len, plan more boundaries to "
                            "nvme, or free memory",
             "pinned memory": "raise the container's memory limit, free memory, or plan fewer "
                              "dram boundaries",
             "nvme space": "free space there or set runtime.nvme_dir to a larger disk",
             "checkpoint space": "free space or choose another --run-dir"}
    if kwargs.get("checkpoints_kept", 1) > 1:
        hints["checkpoint space"] += ", or lower train.keep_checkpoints"
    if kwargs.get("reference_bytes", 0) > 0:
        hints["host memory"] = (f"the GRPO KL reference copy of the weights holds "
                                f"{amount(kwargs['reference_bytes'])} of it: "
                                f"{reference_fix(compute_dtype, budget=False)}, "
                                f"{hints['host memory']}")
    for check in checks:
        if not check.ok:
            raise PreflightError(f"preflight: {check.describe()}; {hints[check.name]}")
    return checks


def reference_fix(compute_dtype: str, *, budget: bool) -> str:
    """The fixes for a GRPO KL reference copy that does not fit: "set grpo.kl_coef: 0", with
    `budget` (the configured DRAM) "raise hardware.dram_gb", and for fp32 compute "use
    train.compute_dtype: bf16" (a copy of 2 B/param instead of 4)."""
    options = ["set grpo.kl_coef: 0 (no reference copy)"]
    if budget:
        options.append("raise hardware.dram_gb")
    if compute_dtype == "fp32":
        options.append("use train.compute_dtype: bf16 (a copy of 2 B/param instead of 4)")
    return ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]


def preflight_reference_budget(*, plan_dram_bytes: int, reference_bytes: int, dram_bytes: int,
                               compute_dtype: str) -> Check:
    """The DRAM budget with the GRPO KL reference copy: the plan's DRAM plus the copy fit the
    configured DRAM. With `grpo.kl_coef` > 0 the run holds a frozen copy of the initial weights
    in the compute dtype in host DRAM for the whole run, beside everything the plan counts.

    Args:
        plan_dram_bytes: the plan's predicted DRAM (host states, staging, DRAM-tier
            checkpoints), bytes.
        reference_bytes: the copy (`planner.grpo_phase.reference_bytes`), bytes.
        dram_bytes: the machine's DRAM as configured (`hardware.dram_gb`, or its preset's),
            bytes.
        compute_dtype: `train.compute_dtype` ("fp32" or "bf16"; picks the fixes).

    Raises:
        PreflightError: the sum exceeds `dram_bytes`; one line with the three numbers, naming
            `grpo.kl_coef` and the fixes (`reference_fix`).
    """
    check = Check(name="DRAM budget", need_bytes=plan_dram_bytes + reference_bytes,
                  have_bytes=dram_bytes, where="hardware.dram_gb")
    if not check.ok:
        raise PreflightError(f"preflight: {check.describe()}: the plan's "
                             f"{amount(plan_dram_bytes)} and the GRPO KL reference copy of the "
                             f"weights (grpo.kl_coef > 0) {amount(reference_bytes)}; "
                             f"{reference_fix(compute_dtype, budget=True)}")
    return check


def preflight_host_floor(*, states_bytes: int, meminfo: str | Path = "/proc/meminfo") -> Check:
    """The host-memory check on what every plan needs, before planning and calibrating: the
    model's host states (master, gradient and AdamW moments: `contract.HOST_BYTES_PER_PARAM`
    per parameter, as the planner's `states_bytes`) fit in `MemAvailable` (evaluation runs on
    them through the engine: no copy of the model). The full `preflight` follows once the
    plan is known.

    Args:
        states_bytes: the host states of this rank's model, bytes.
        meminfo: the meminfo file (tests pass a fake one).

    Raises:
        PreflightError: one line with both numbers, said to come before planning.
    """
    check = Check(name="host memory", need_bytes=states_bytes,
                  have_bytes=mem_available_bytes(meminfo), where="MemAvailable")
    if not check.ok:
        raise PreflightError(f"preflight: {check.describe()} for the model's host states "
                             f"alone, checked before planning and calibrating; "
                             f"use a machine with more memory, train.master_dtype=bf16, or a "
                             f"smaller model")
    return check
