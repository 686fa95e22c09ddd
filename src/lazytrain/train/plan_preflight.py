"""A run's preflight from its config and plan: the figures `train/preflight.py` compares with
this machine, read from the run config, the model's parameter count and the plan.

Two calls, both before a file is written or a weight loaded (`train.Trainer`):

- `host_floor`, before planning: the model's host states fit `MemAvailable`
  (`preflight.preflight_host_floor`); a data.seq_len past the model's positions is refused here
  too.
- `run_preflight`, once the plan is known: with `train.method: grpo` and `grpo.kl_coef` > 0 the
  plan's DRAM plus the KL reference copy (P x b bytes, b = 2 for bf16 and 4 for fp32 compute:
  `planner.grpo_phase.reference_bytes`) fit the configured DRAM (`hardware.dram_gb`:
  `preflight.preflight_reference_budget`); then host memory (the plan's DRAM plus that copy),
  pinned memory, NVMe and checkpoint space (`preflight.preflight`).

Reads the plan's memory model (`planner.memory_model`); knows nothing about the engine.
"""

from __future__ import annotations

from pathlib import Path

from lazytrain.config import RunConfig
from lazytrain.contract import HOST_BYTES_PER_PARAM
from lazytrain.models.host_params import MASTER_DTYPES
from lazytrain.planner.build import hardware_from_config
from lazytrain.planner.grpo_phase import reference_bytes
from lazytrain.planner.memory_model import memory_model_of
from lazytrain.planner.plan import Plan
from lazytrain.spec.model import ModelSpec, read_hf_config
from lazytrain.train import checks
from lazytrain.train.checkpoint import checkpoint_bytes_per_param
from lazytrain.train.preflight import preflight, preflight_host_floor, preflight_reference_budget


def host_floor(cfg: RunConfig, *, resumed_from: Path | None) -> None:
    """`preflight.preflight_host_floor` on the model's parameter count (the resumed
    checkpoint's config.json, else `model.config_path`): a machine that cannot hold the host
    states is refused before planning, whose calibration builds the whole model. A model whose
    config cannot be read here is left to planning to name. A data.seq_len past the model's
    positions is refused here too (`checks.check_seq_len`).

    Args:
        cfg: the run config.
        resumed_from: the directory of the checkpoint a resume continues from, or None.

    Raises:
        PreflightError: the host states exceed MemAvailable.
        ValueError: data.seq_len exceeds max_position_embeddings.
    """
    source = resumed_from / "config.json" if resumed_from is not None else cfg.model.config_path
    try:
        params = ModelSpec.from_hf_config(source).total_params
    except (OSError, ValueError, KeyError):
        return
    checks.check_seq_len(cfg.data.seq_len, read_hf_config(source))
    preflight_host_floor(
        states_bytes=int(HOST_BYTES_PER_PARAM[cfg.train.master_dtype] * params))


def run_reference_bytes(cfg: RunConfig, num_params: int) -> int:
    """Host DRAM of the run's GRPO KL reference copy, bytes (`num_params` x 2 or 4 by
    `train.compute_dtype`); 0 unless `train.method` is grpo with `grpo.kl_coef` > 0."""
    return reference_bytes(num_params, method=cfg.train.method, kl_coef=cfg.grpo.kl_coef,
                           compute_dtype=cfg.train.compute_dtype)


def run_preflight(cfg: RunConfig, plan: Plan, *, device: str, nvme_dir: Path, run_dir: Path,
                  num_params: int, freed_bytes: int = 0, saves: int | None = None) -> None:
    """The preflight of the module docstring on the plan's figures.

    Args:
        cfg: the run config.
        plan: the plan the run trains with (its predicted DRAM, HBM, NVMe bytes and memory
            model; a plan without predictions counts fp32 host states only).
        device: "cpu" or "cuda".
        nvme_dir: the job's NVMe directory.
        run_dir: the run directory (checkpoints).
        num_params: the model's parameters (checkpoint size, reference copy).
        freed_bytes: what `--overwrite` deletes in the run directory before the first save,
            bytes (counted as free there).
        saves: the most checkpoints the run can write (None: unknown).

    Raises:
        PreflightError: the plan's DRAM and the KL reference copy exceed hardware.dram_gb
            (naming grpo.kl_coef), or a machine check fails (`preflight.preflight`).
        ValueError: the hardware section is implausible (`planner.build.hardware_from_config`).
    """
    pred = plan.predicted
    fp32_states = int(HOST_BYTES_PER_PARAM["fp32"] * num_params)
    dram = int(pred.dram_bytes) if pred else fp32_states
    reference = run_reference_bytes(cfg, num_params)
    if reference:  # GRPO runs in one process: the whole machine's DRAM is this rank's
        preflight_reference_budget(plan_dram_bytes=dram, reference_bytes=reference,
                                   dram_bytes=int(hardware_from_config(cfg).dram_bytes),
                                   compute_dtype=cfg.train.compute_dtype)
    # dram-tier checkpoints + staging pools: the plan's DRAM less the host states (which depend
    # on train.master_dtype: 16 or 12 B/param) and the optimizer's pageable scratch
    pinned = memory_model_of(plan.provenance).pinned_bytes_of(dram)
    if pinned is None:  # no memory model: fp32 masters' states (the larger), no scratch
        pinned = dram - fp32_states
    preflight(device=device, host_bytes=dram, reference_bytes=reference,
              compute_dtype=cfg.train.compute_dtype,
              hbm_bytes=int(pred.peak_hbm_bytes) if pred else 0, pinned_bytes=max(0, pinned),
              nvme_bytes=int(pred.nvme_bytes) if pred else 0, nvme_dir=nvme_dir,
              checkpoint_bytes=num_params * checkpoint_bytes_per_param(
                  export_bytes=MASTER_DTYPES[cfg.model.dtype].itemsize,
                  master_bytes=MASTER_DTYPES[cfg.train.master_dtype].itemsize),
              checkpoints_kept=cfg.train.keep_checkpoints, checkpoints_written=saves,
              run_dir=run_dir, freed_bytes=freed_bytes)
