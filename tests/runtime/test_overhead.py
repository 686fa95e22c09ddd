"""The engine's overheads from small twins: the twins' shape, their 2L + 3 windows and the fit of
o and a, by hand."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import model_pair, tiny_config
from lazytrain.profile.overhead import fit_overheads, twin_adapter, window_overhead_ms


@pytest.fixture(scope="module")
def adapter():
    return model_pair(tiny_config("llama", layers=2))[1]


def test_the_window_overhead_twin_is_the_run_family_at_two_blocks_of_hidden_64(adapter):
    twin = twin_adapter(adapter)
    assert type(twin.config) is type(adapter.config)
    assert twin.num_blocks == 2 and twin.config.hidden_size == 64


def test_the_engine_overheads_come_from_two_twins_of_2_and_4_blocks(adapter, tmp_path):
    out = window_overhead_ms(adapter, compute_dtype="fp32", device=torch.device("cpu"),
                             nvme_dir=tmp_path, steps=1, warmup=0)
    # windows per step 2L + 3: pre, f0..f{L-1}, turn, b{L-1}..b0, post
    assert {L: t["windows"] for L, t in out["twins"].items()} == {"2": 7, "4": 11}
    assert out["window_overhead_ms"] >= 0 and out["step_overhead_ms"] >= 0


@pytest.mark.parametrize("r2,r4,want", [
    (17.0, 25.0, (2.0, 3.0)),   # o = (25 - 17) / (11 - 7) = 2; a = 17 - 7 x 2 = 3
    (14.0, 22.0, (2.0, 0.0)),   # o = 2; a = 14 - 7 x 2 = 0: the cap exactly
    (10.0, 18.0, (10 / 7, 0.0)),  # slope 2 would make a = 10 - 14 < 0: o capped at 10 / 7
    (12.0, 11.0, (0.0, 12.0)),  # the bigger twin was faster (noise): o = 0, a = R(2)
], ids=["both", "at-the-cap", "capped", "no-window-part"])
def test_the_overhead_fit_by_hand(r2, r4, want):
    assert fit_overheads({4: r4, 2: r2}) == pytest.approx(want)
