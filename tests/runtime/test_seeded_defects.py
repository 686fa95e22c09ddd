"""Seeded ordering defects: each one is caught by `cpu-checked` or turned into wrong numbers by
`cpu-threaded`.

Every case removes one wait, one event hand-over or one buffer rule from the runtime by
monkeypatching one function (never by a flag in product code), runs a short training run on the
plan that exposes it and expects, per backend in its `caught_by`:
- `cpu-checked`: an `OrderingViolation` (raised in the step, or recorded off the main thread);
- `cpu-threaded`: an error, or masters that differ from the `cpu` backend's (the undamaged
  runtime equals it bit for bit under both checkers: `test_ordering_matrix.py`).

The reference is the `cpu` backend's run of the undamaged runtime, whose gradients equal plain
HF autograd (`test_engine_grads.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from engine_helpers import micro_batches, model_pair, plan_for, tiny_config
from lazytrain.runtime import streams as streams_mod
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine import Engine
from lazytrain.runtime.hb_checker import OrderingViolation
from lazytrain.runtime.optim import BlockOptimizer

R, H, D, N = "recompute", "hbm", "dram", "nvme"
WIDE_VOCAB = 800
"""The tiny model's vocabulary whose ends (embedding + head, 2 x 800 x 64) span 3 staging
buffers (a block is 37k parameters); at the default 96 they fit one."""


@dataclass(frozen=True)
class Run:
    """The training run that exposes a defect."""

    tiers: tuple = (D, D, H, D, H)
    keep: tuple = ()
    vocab: int | None = None
    steps: int = 1
    clip: float | None = None


@dataclass(frozen=True)
class Defect:
    """One seeded defect: `apply(monkeypatch, device)` damages the runtime."""

    apply: Callable
    caught_by: tuple = ("cpu-checked",)
    """Backends that must catch it: `cpu-threaded` only where its timing makes the damage
    certain (a copy delayed 0.1-0.2 s, a job 20-50 ms, a dropped boundary copy poisoned); the
    others it catches only now and then (the CPU allocator hands out memory that still holds
    the right values, or a later wait hurries the late copy first)."""
    run: Run = field(default_factory=Run)


def _skip_stream_wait(name: str):
    """A device's `wait_stream` that drops the waits of stream `name` (one line of a caller)."""
    def apply(monkeypatch, device):
        original = type(device).wait_stream

        def wait_stream(self, stream, other):
            if stream.name != name:
                original(self, stream, other)
        monkeypatch.setattr(type(device), "wait_stream", wait_stream)
    return apply


def _fresh_prefetch_without_compute_wait(monkeypatch, device):
    """The store's h2d into a freshly allocated prefetch buffer no longer waits for the compute
    queued before the allocation (a stream wait, or the allocation's event)."""
    _skip_stream_wait("ckpt_h2d")(monkeypatch, device)
    original = getattr(ActivationStore, "_allocate_prefetch", None)
    if original is not None:
        def allocate_prefetch(self, e):
            original(self, e)
            e.dev_allocated = None
        monkeypatch.setattr(ActivationStore, "_allocate_prefetch", allocate_prefetch)


def _ends_reloaded_under_last_steps_reads(monkeypatch, device):
    def load_flat(self, dst, master):  # no h2d wait for the compute that last read dst
        job = self.device.submit(self.worker, self._stage_flat, dst, master,
                                 self.device.ledger.window, channel="host")
        self.device.wait_futures([job])
        return job.result()
    monkeypatch.setattr(streams_mod.DeviceWeights, "load_flat", load_flat)


def _d2h_event_not_tracked(monkeypatch, device):
    original = ActivationStore._d2h

    def d2h(self, e, target, final):  # the window barrier never sees the d2h's event
        original(self, e, target, final)
        self._window_events.remove(e.d2h_event)
    monkeypatch.setattr(ActivationStore, "_d2h", d2h)


def _landing_buffer_reused_early(monkeypatch, device):
    def finish_oldest(self):  # blocks until the job ran, but tells the device nothing
        job, k, on_done = self.pending.popleft()
        job.result()
        self.free.append(k)
        if on_done is not None:
            on_done()
    monkeypatch.setattr(streams_mod.GradDrain, "_finish_oldest", finish_oldest)


def _h2d_event_dropped(monkeypatch, device):
    original = ActivationStore._h2d

    def h2d(self, e, target, final):  # the entry does not keep its h2d event
        original(self, e, target, final)
        e.h2d_event = None
    monkeypatch.setattr(ActivationStore, "_h2d", h2d)


def _update_before_accumulation(monkeypatch, device):
    def on_grads_final(self, group, step_lr):  # queued at the backward, not after the drain
        if step_lr is not None:
            self.optimizer.submit(group, lr=step_lr)
    monkeypatch.setattr(Engine, "_on_grads_final", on_grads_final)


def _ends_wait_first_chunk_only(monkeypatch, device):
    original = streams_mod.DeviceWeights._stage_flat_chunks

    def stage_flat_chunks(self, dst, master):  # compute waits for the first chunk's copy
        events = []
        mark = self.staging.mark_in_flight

        def mark_in_flight(k, event):
            events.append(event)
            mark(k, event)
        self.staging.mark_in_flight = mark_in_flight
        try:
            original(self, dst, master)
        finally:
            del self.staging.mark_in_flight
        assert len(events) == 3, "the wide ends must span 3 staging buffers"
        return events[0]
    monkeypatch.setattr(streams_mod.DeviceWeights, "_stage_flat_chunks", stage_flat_chunks)


def _nvme_read_not_waited(monkeypatch, device):
    original = ActivationStore._h2d

    def h2d(self, e, target, final):  # the h2d no longer waits for the NVMe read
        futures, e.read_futures = e.read_futures, []
        try:
            original(self, e, target, final)
        finally:
            e.read_futures = futures + e.read_futures
    monkeypatch.setattr(ActivationStore, "_h2d", h2d)


def _masters_read_without_optimizer_wait(monkeypatch, device):
    monkeypatch.setattr(BlockOptimizer, "wait_all", lambda self: None)


DEFECTS = {
    "grad_d2h_not_after_backward": Defect(_skip_stream_wait("d2h")),
    "ends_reloaded_under_the_last_steps_reads": Defect(_ends_reloaded_under_last_steps_reads,
                                                       run=Run(steps=2)),
    "ckpt_d2h_event_not_at_window_barrier": Defect(_d2h_event_not_tracked,
                                                   caught_by=("cpu-checked", "cpu-threaded")),
    "landing_buffer_reused_before_accumulation": Defect(_landing_buffer_reused_early),
    "store_h2d_into_fresh_buffer_without_compute_wait": Defect(
        _fresh_prefetch_without_compute_wait),
    "h2d_event_not_kept_on_entry": Defect(_h2d_event_dropped),
    "adamw_queued_before_accumulation": Defect(_update_before_accumulation),
    "multi_chunk_ends_wait_first_chunk_only": Defect(_ends_wait_first_chunk_only,
                                                     run=Run(tiers=(H,) * 5, vocab=WIDE_VOCAB)),
    "nvme_read_not_waited_before_h2d": Defect(_nvme_read_not_waited,
                                              run=Run(tiers=(N,) * 4 + (H,))),  # all NVMe
    "masters_read_without_optimizer_wait": Defect(_masters_read_without_optimizer_wait,
                                                  caught_by=("cpu-checked", "cpu-threaded")),
}


def _batches(*, seed: int, vocab: int | None) -> list[dict]:
    """Two micro-batches; with a wider vocabulary their tokens spread over all of it (the
    embedding then reads rows of every ends chunk)."""
    batches = micro_batches(2, seed=seed)
    if vocab is not None:
        for b in batches:  # 1..95 -> 8..760; padding (0) and ignored labels (-100) stay
            b["input_ids"] = b["input_ids"] * 8
            b["labels"] = torch.where(b["labels"] >= 0, b["labels"] * 8, b["labels"])
    return batches


def _train(device, tmp_path, run: Run) -> dict[str, torch.Tensor]:
    """`run.steps` steps (grad_accum 2), then the masters as a checkpoint reads them."""
    config = tiny_config("llama")
    if run.vocab is not None:
        config.vocab_size = run.vocab
    _, adapter = model_pair(config)
    plan = plan_for(adapter, run.tiers, run.keep, grad_accum=2)
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         lr=1e-2, clip_grad_norm=run.clip)
    try:
        for s in range(run.steps):
            engine.step(_batches(seed=30 + s, vocab=run.vocab))
        masters = {k: v.clone() for k, v in engine.named_masters().items()}
    finally:
        engine.close()
    if getattr(device, "violations", None):
        raise device.violations[0]  # one recorded off the main thread (a freed storage)
    return masters


def _caught(backend: str, defect: Defect, tmp_path, monkeypatch) -> str | None:
    """What `backend` made of the damaged run: a description, or None when it passed."""
    want = _train(make_device("cpu"), tmp_path / "cpu", defect.run)
    device = make_device(backend, seed=5)
    defect.apply(monkeypatch, device)
    try:
        got = _train(device, tmp_path / backend, defect.run)
    except OrderingViolation as exc:
        return f"violation: {exc}"
    except Exception as exc:  # noqa: BLE001 - any error shows the damage
        if backend == "cpu-checked":
            raise
        return f"error: {exc!r}"
    finally:
        device.close()
    wrong = [k for k in want if not torch.equal(want[k], got[k])]
    if backend == "cpu-checked":  # its numerics are cpu's: only a violation counts
        return None
    return f"wrong masters: {wrong[:3]}" if wrong else None


@pytest.mark.parametrize("name", list(DEFECTS))
def test_each_seeded_defect_is_caught_by_a_checker_backend(name, tmp_path, monkeypatch):
    defect = DEFECTS[name]
    for backend in defect.caught_by:
        with monkeypatch.context() as patch:
            assert _caught(backend, defect, tmp_path / backend, patch), \
                f"{backend} missed the seeded defect {name}"


@pytest.mark.parametrize("backend", ["cpu-checked", "cpu-threaded"])
def test_the_undamaged_runtime_passes_every_defect_run(backend, tmp_path, monkeypatch):
    for name, run in {f"{d.run}": d.run for d in DEFECTS.values()}.items():
        assert _caught(backend, Defect(lambda *a: None, run=run), tmp_path / str(hash(name)),
                       monkeypatch) is None, name


@pytest.mark.parametrize("waited", [False, True])
def test_a_pinned_buffer_freed_under_its_copy_is_caught(waited):
    """Pinned buffers follow the free rule: on CUDA their pages are unregistered and freed while
    a D2H may still write them."""
    dev = make_device("cpu-checked")
    src = dev.empty(16, torch.float32, name="device gradient")
    d2h = dev.stream("d2h")
    dev.wait_stream(d2h, dev.compute)
    landing = dev.pinned_empty(64, name="landing buffer").view(torch.float32)
    event = dev.copy(landing, src, stream=d2h)
    if waited:
        dev.host_wait(event)
    del landing  # the last reference: its storage is freed here
    assert bool(dev.violations) is not waited
    if not waited:
        assert dev.violations[0].buffer == "landing buffer" and "d2h" in dev.violations[0].first
