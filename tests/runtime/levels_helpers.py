"""Plans with save levels for the engine tests: a level and a saved tier per block, with the
dram tier's internal transfers split over two legal windows each where the horizons allow (so
the store's byte ranges are exercised), built through the planner's own `build_plan`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import reference_grads
from test_engine_grads import _assert_grads_match

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import InternalTransfer, SolveRecord
from lazytrain.planner.windows import internal_legal_ords, window_name
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine


def internal_moves(problem, levels, saved_tiers) -> tuple[InternalTransfer, ...]:
    """d2h in the first two legal windows (0.4, 0.6) and h2d in the last two (0.3, 0.7) of
    every dram-tier block, or whole in one window where only one is legal before the other
    kind's; every h2d window after every d2h window (docs/execution_model.md)."""
    L, moves = problem.num_blocks, []
    horizons = dict(drain_windows=problem.drain_windows, prefetch_windows=problem.prefetch_windows)
    for j, (level, tier) in enumerate(zip(levels, saved_tiers)):
        if tier != "dram":
            continue
        d2h = list(internal_legal_ords("d2h", j, L, **horizons))
        h2d = list(internal_legal_ords("h2d", j, L, **horizons))
        assert d2h and h2d and h2d[-1] > d2h[0], f"block {j} cannot take dram"
        h2d = [o for o in h2d if o > d2h[0]]
        d2h_ords = d2h[:2] if len(d2h) > 1 and h2d[-2:][0] > d2h[1] else d2h[:1]
        h2d_ords = [o for o in h2d[-2:] if o > d2h_ords[-1]]
        for kind, ords, split in (("d2h", d2h_ords, (0.4, 0.6)), ("h2d", h2d_ords, (0.3, 0.7))):
            fractions = split if len(ords) == 2 else (1.0,)
            moves += [InternalTransfer(block=j, kind=kind, window=window_name(o, L), fraction=f)
                      for o, f in zip(ords, fractions)]
    return tuple(moves)


def levels_plan(problem, tiers, levels, saved_tiers, keep=()):
    """A validated Plan of `tiers` with `levels` / `saved_tiers` per block (() for both: no
    save levels, the full re-forward)."""
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep),
                                     save_levels=tuple(levels) if levels else (),
                                     saved_tiers=tuple(t if t != "dram" else "hbm"
                                                       for t in saved_tiers))
    decisions = dataclasses.replace(decisions, saved_tiers=tuple(saved_tiers),
                                    internal_transfers=internal_moves(problem, levels,
                                                                      saved_tiers))
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


def engine_grads(adapter, plan, backend, tmp_path, batches, **engine_kw):
    """(loss, {name: gradient}) of one engine step over `batches` (grad_accum = their count)
    under `backend`, seeded as the references are; raises the checker's first violation and
    asserts that no saved internals are held afterwards."""
    dev = make_device(backend, seed=7)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme",
                         grad_accum=len(batches), **engine_kw)
    try:
        torch.manual_seed(123)
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
        assert engine.saved.held() == [] and engine.saved.bytes_held() == {"hbm": 0, "dram": 0}
    finally:
        engine.close()
    if getattr(dev, "violations", None):
        raise dev.violations[0]
    return loss, grads


def assert_engine_equals_autograd(ref, adapter, plan, backend, tmp_path, batches) -> None:
    """One engine step of `plan` over `batches` (`engine_grads`) against plain HF autograd of
    the reference model `ref` on the same batches, seeded alike: loss within 1e-6 relative,
    every gradient within `test_engine_grads._assert_grads_match`'s tolerance."""
    loss, grads = engine_grads(adapter, plan, backend, tmp_path, batches)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)
