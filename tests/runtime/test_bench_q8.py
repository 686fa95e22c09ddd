"""The profiler's 8-bit AdamW benchmark: the update a plan's `q8_blocks` run, timed beside the
fp32 one (`profile/bench_rates.py`), or None where bitsandbytes is missing."""

from __future__ import annotations

import math

import pytest

from lazytrain.profile import bench_rates
from lazytrain.runtime import optim8bit


def test_the_8_bit_update_is_timed_when_bitsandbytes_is_installed():
    if not optim8bit.have_bitsandbytes():
        pytest.skip("bitsandbytes (the q8 extra) is not installed")
    ms = bench_rates.optimizer_q8_ms_per_param(1 << 14, repeats=1)
    assert ms is not None and math.isfinite(ms) and ms > 0


def test_no_bitsandbytes_no_figure(monkeypatch):
    monkeypatch.setattr(optim8bit, "have_bitsandbytes", lambda: False)
    assert bench_rates.optimizer_q8_ms_per_param(1 << 14) is None
