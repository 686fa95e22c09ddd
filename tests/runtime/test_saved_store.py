"""The saved-internals store (`runtime/saved_store.py`) on its own, under every CPU backend.

Stand-in internals: three uint8 storages of uneven sizes (7, 4096 and 513 bytes), filled with
known bytes by compute ops. The reference is a copy of those bytes taken before anything moved
(`torch.clone` on the host), never the store's output: after d2h fractions split across the
storages' edges in two windows and h2d fractions in two later windows, the storages the store
hands back must hold exactly those bytes, under `cpu-threaded`'s late copies and poisoned
buffers and `cpu-checked`'s ordering checker too.
"""

from __future__ import annotations

import pytest
import torch

from lazytrain.runtime.backends import make_device
from lazytrain.runtime.errors import TransferOrderError
from lazytrain.runtime.saved_store import SavedStore

SIZES = (7, 4096, 513)
BACKENDS = ["cpu", "cpu-checked", "cpu-threaded"]


class _Internals:
    """The slice of `SavedInternals` the store uses: `storages`, `replace_storages` and
    `release` (here it only records the call)."""

    def __init__(self, storages):
        self.storages = list(storages)

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.storages if s is not None)

    def replace_storages(self, storages) -> None:
        assert len(storages) == len(self.storages)
        self.storages = list(storages)

    def release(self) -> None:
        self.released = True


def _internals(dev, seed: int) -> tuple[_Internals, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    values = [torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8) for n in SIZES]
    with dev.compute_scope():
        storages = [v + 0 for v in values]  # compute outputs, as a forward's saved tensors
    return _Internals(storages), [v.clone() for v in values]


def _window(store, name, transfers, *, mb=0):
    store.begin_window(name)
    for block, kind, fraction in transfers:
        store.transfer(block, kind, fraction, micro_batch=mb)
    store.end_window()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dram_internals_come_back_byte_for_byte(backend):
    dev = make_device(backend, seed=3)
    store = SavedStore(dev)
    try:
        saved, expected = _internals(dev, 0)
        other, other_expected = _internals(dev, 1)
        device = list(saved.storages)
        store.put(0, saved, "dram")
        store.put(1, other, "hbm")
        total = sum(SIZES)
        _window(store, "f1", [(0, "d2h", 0.3)])
        assert store.bytes_held() == {"hbm": 2 * total, "dram": total}
        _window(store, "f2", [(0, "d2h", 0.7)])
        # the device copies were dropped at the barrier: the graph reads the host copy now
        assert all(s.data_ptr() != d.data_ptr() for s, d in zip(saved.storages, device))
        assert store.bytes_held() == {"hbm": total, "dram": total}
        _window(store, "b2", [(0, "h2d", 0.5)])
        _window(store, "b1", [(0, "h2d", 0.5)])
        assert store.moved(0, "f1") == {"d2h": round(0.3 * total), "h2d": 0}
        assert store.moved(0, "b1")["h2d"] == total - round(0.5 * total)
        with dev.compute_scope():
            got = [s.clone() for s in store.take(0).storages]
            got_other = [s.clone() for s in store.take(1).storages]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(torch.equal(a, b) for a, b in zip(got_other, other_expected))
        store.release(0)
        store.release(1)
        assert store.held() == [] and store.bytes_held() == {"hbm": 0, "dram": 0}
    finally:
        store.close()
        dev.close()
    assert not getattr(dev, "violations", None)


def test_an_h2d_before_its_d2h_is_refused_and_take_before_prefetch_too():
    dev = make_device("cpu")
    store = SavedStore(dev)
    saved, _ = _internals(dev, 0)
    store.put(2, saved, "dram")
    _window(store, "f3", [(2, "d2h", 0.5)])
    store.begin_window("f4")
    with pytest.raises(TransferOrderError, match="before d2h"):
        store.transfer(2, "h2d", 1.0)
    store.end_window()
    _window(store, "f5", [(2, "d2h", 0.5)])
    with pytest.raises(TransferOrderError, match="not on the device"):
        store.take(2)
    with pytest.raises(TransferOrderError, match="dram tier"):
        store.begin_window("f6")
        store.put(3, _internals(dev, 1)[0], "hbm")
        store.transfer(3, "d2h", 1.0)
    store.abandon()
    assert store.held() == []


def test_the_ledger_books_them_to_their_own_owners():
    dev = make_device("cpu")
    store = SavedStore(dev)
    saved, _ = _internals(dev, 0)
    store.put(4, saved, "dram")
    assert dev.ledger.held_by_owner("hbm").get("saved internals of block 4") == sum(SIZES)
    _window(store, "f5", [(4, "d2h", 1.0)])
    pinned = dev.ledger.held_by_owner("pinned")
    padded = 16 + 4096 + 513  # each storage 16-byte aligned in the host copy (7 -> 16)
    assert pinned == {f"saved internals host buffer of {padded} bytes": padded}
    assert "saved internals of block 4" not in dev.ledger.held_by_owner("hbm")
    _window(store, "b5", [(4, "h2d", 1.0)])
    assert dev.ledger.held_by_owner("hbm").get("saved internals of block 4") == sum(SIZES)
    store.release(4)
    del saved  # the engine's last holder: its backward is done
    assert "saved internals of block 4" not in dev.ledger.held_by_owner("hbm")
    store.close()
