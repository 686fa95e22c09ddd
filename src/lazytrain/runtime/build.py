"""Building the streaming engine: the device backend, the activation store, the optimizer, the
`EngineSettings` and the `Engine`, in one place (`make_engine`) for tests, benchmarks, one
process and every rank of a data-parallel job (`engine_from_config` maps a run config onto it).

The data-parallel parts (the gradient reducer and the sharded optimizer) are built by the rank
context (`lazytrain.dist.parallel.engine_parts`) and passed in; one process passes none. Knows
nothing about the training loop, checkpoints or process groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from lazytrain.config import RunConfig
from lazytrain.contract import HEAD_CHUNK_TOKENS
from lazytrain.models.adapter import ModelAdapter
from lazytrain.planner.plan import Plan
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import as_device, make_device
from lazytrain.runtime.device import Device
from lazytrain.runtime.engine import Engine
from lazytrain.runtime.engine_config import EngineSettings
from lazytrain.runtime.optim import BlockOptimizer


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
    tc, rc = cfg.train, cfg.runtime
    store = ActivationStore(
        device=make_device(device_kind, index=device_index, seed=seed), nvme_dir=nvme_dir,
        io_threads=rc.io_threads, fault_hook=fault_hook,
        hbm_limits={w.name: w.hbm_checkpoint_bytes for w in plan.windows})
    # before the Engine wraps store.io with its instrument (0: wait without a limit)
    store.io.timeout_s = rc.nvme_timeout_s or None
    return make_engine(adapter, plan, store=store, compute_dtype=tc.compute_dtype, lr=tc.lr,
                       betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                       weight_decay=tc.weight_decay, clip_grad_norm=tc.clip_grad_norm or None,
                       grad_accum=tc.grad_accum, seed=seed,
                       model_config_sha256=model_config_sha256, optimizer=optimizer,
                       grad_sync=grad_sync, instrument=True,
                       head_chunk_tokens=rc.head_chunk_tokens, budgets=True)


def make_engine(adapter: ModelAdapter, plan: Plan, *, device: Device | str = "cpu",
                nvme_dir: str | Path | None = None, io_threads: int | None = None,
                store: ActivationStore | None = None, compute_dtype: str = "fp32",
                lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.01, clip_grad_norm: float | None = None,
                grad_accum: int = 1, seed: int = 0, model_config_sha256: str | None = None,
                optimizer: BlockOptimizer | None = None, grad_sync=None,
                instrument: bool = False, head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
                budgets: bool = False) -> Engine:
    """An `Engine` with its device, activation store, optimizer and settings built here.

    Args:
        adapter, plan: as `Engine`.
        device: the device API (`runtime/device.py`) or a backend name: "cpu", "cuda",
            "cpu-checked", "cpu-threaded" (`runtime.backends.as_device`; a device made here from
            a name is the engine's to close). With `store` and a name: the store's device.
        nvme_dir: directory for the nvme tier's files of the store made here (default
            "lazytrain_nvme"); only without `store`.
        io_threads: NVMe worker threads of the store made here (default: the store's, 2); only
            without `store`.
        store: an existing ActivationStore (tests with fault hooks); default: a new one with
            the plan's per-window HBM limits.
        compute_dtype, lr, clip_grad_norm, grad_accum, seed, model_config_sha256, instrument,
            head_chunk_tokens, budgets: the `EngineSettings` of the same names.
        betas, eps, weight_decay: AdamW (torch semantics) of the `BlockOptimizer` made here.
        optimizer: an existing optimizer with `BlockOptimizer`'s interface (data parallel:
            `lazytrain.dist.sharding.ShardedOptimizer`); default: a new `BlockOptimizer`.
        grad_sync: the data-parallel hook (`Engine`); None: one process.

    Returns:
        The engine; its `close` closes the store and, when made here, the device.

    Raises:
        ValueError: `nvme_dir` or `io_threads` beside a given store, a store on another device
            object than `device`, a bad backend name, compute dtype or head chunk size, or a
            plan with another number of blocks.
        PlanValidationError: a plan of another model.
    """
    if store is not None and (nvme_dir is not None or io_threads is not None):
        raise ValueError("Engine: nvme_dir and io_threads configure the store made here; a "
                         "given store has its own: pass them to ActivationStore instead")
    settings = EngineSettings(compute_dtype=compute_dtype, lr=lr, clip_grad_norm=clip_grad_norm,
                              grad_accum=grad_accum, seed=seed,
                              head_chunk_tokens=head_chunk_tokens, instrument=instrument,
                              budgets=budgets, model_config_sha256=model_config_sha256)
    named = store.dev if store is not None and not isinstance(device, Device) else device
    owns_device = not isinstance(named, Device)  # made here from a name: the engine's to close
    dev = as_device(named)
    if store is not None and store.dev is not dev:
        raise ValueError("Engine: the store was built on another device object; pass "
                         "device=store.dev (one device API per engine)")
    owns_store = store is None
    if store is None:
        store = ActivationStore(
            device=dev, nvme_dir=Path(nvme_dir or "lazytrain_nvme"),
            **({} if io_threads is None else {"io_threads": io_threads}),
            hbm_limits={w.name: w.hbm_checkpoint_bytes for w in plan.windows})
    if optimizer is None:
        optimizer = BlockOptimizer(adapter.params, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay)
    try:
        return Engine(adapter, plan, store=store, optimizer=optimizer, grad_sync=grad_sync,
                      settings=settings, owns_device=owns_device)
    except BaseException:  # a refused plan: stop what was started here
        if owns_store:
            store.close()
        if owns_device:
            dev.close()
        raise
