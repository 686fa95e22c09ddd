"""Building the streaming engine from a run config: the device backend, the activation store
and the `Engine`, in one place for one process and for every rank of a data-parallel job.

The data-parallel parts (the gradient reducer and the sharded optimizer) are built by the rank
context (`lazytrain.dist.parallel.engine_parts`) and passed in; one process passes none. Knows
nothing about the training loop, checkpoints or process groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from lazytrain.config import RunConfig
from lazytrain.planner.plan import Plan


def resolve_device(choice: str) -> str:
    """The device API backend of `runtime.device` (auto: cuda when torch sees one, else cpu).

    Raises:
        ValueError: cuda requested without a CUDA device.
    """
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("runtime.device: cuda requested but torch sees no CUDA device; "
                         "use runtime.device=cpu")
    return choice


def device_type(kind: str) -> str:
    """torch device type of a backend: "cuda" for cuda, "cpu" for the three CPU backends."""
    return "cuda" if kind == "cuda" else "cpu"


def engine_from_config(cfg: RunConfig, adapter, plan: Plan, *, device_kind: str,
                       nvme_dir: Path, seed: int, model_config_sha256: str,
                       device_index: int | None = None,
                       fault_hook: Callable[[Any], None] | None = None,
                       optimizer=None, grad_sync=None):
    """An instrumented, budget-checked `Engine` over a new device and activation store.

    Args:
        cfg: the run config (`train.*` optimizer settings, `runtime.*` I/O and chunking).
        adapter, plan: as `Engine` (the plan must be this adapter's).
        device_kind: a resolved `runtime.device` backend (`resolve_device`).
        nvme_dir: the NVMe tier's directory for this process (created by the store).
        seed: the engine's RNG seed (data parallel: per rank, `lazytrain.dist.rank.rank_seed`).
        model_config_sha256: the model's plan-provenance hash, checked against the plan.
        device_index: the CUDA device (data parallel: the local rank); None: the current one.
        fault_hook: an NVMe fault injector for the store (`runtime.nvme.FaultInjector`; tests).
        optimizer, grad_sync: the data-parallel parts (`Engine`); None: one process.

    Returns:
        The engine; the caller closes it and then `engine.dev` (the device is made here).

    Raises:
        ValueError: a bad backend or dtype, or a plan of another model.
    """
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.backends import make_device
    from lazytrain.runtime.engine import Engine

    tc, rc = cfg.train, cfg.runtime
    store = ActivationStore(
        device=make_device(device_kind, index=device_index, seed=seed), nvme_dir=nvme_dir,
        io_threads=rc.io_threads, fault_hook=fault_hook,
        hbm_limits={w.name: w.hbm_checkpoint_bytes for w in plan.windows})
    # before the Engine wraps store.io with its instrument (0: wait without a limit)
    store.io.timeout_s = rc.nvme_timeout_s or None
    return Engine(adapter, plan, device=store.dev,
                  compute_dtype=tc.compute_dtype, lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2),
                  eps=tc.adam_eps, weight_decay=tc.weight_decay,
                  clip_grad_norm=tc.clip_grad_norm or None, grad_accum=tc.grad_accum, seed=seed,
                  model_config_sha256=model_config_sha256, store=store,
                  optimizer=optimizer, grad_sync=grad_sync, instrument=True,
                  head_chunk_tokens=rc.head_chunk_tokens, budgets=True)
