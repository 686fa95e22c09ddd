"""The calibration's timing rule on a shared machine: the least repeat, measured again while
the repeats spread widely or other processes load the CPUs, and kept (marked disturbed) after
the last try. Repeats and the load clock are injected: nothing here is timed."""

from __future__ import annotations

import os

import pytest
import torch

from engine_helpers import BATCH, SEQ, model_pair, tiny_config
from lazytrain.profile.bench_blocks import BlockBench, block_kind_times
from lazytrain.runtime.steady import SteadyTiming, cpu_count_of, cpu_others_s, median_timing


def tries(*series):
    """A `Samples` that returns the given tries in turn, counting them."""
    calls = []

    def samples():
        calls.append(1)
        return series[len(calls) - 1]
    return samples, calls


def clock(*shares, cpus=2):
    """An `OthersClock` under which other processes use shares[k] of the CPUs during try k
    (each try one wall second: two readings per try)."""
    state = {"others": 0.0, "wall": 0.0, "reads": 0}

    def read():
        k = state["reads"] // 2
        if state["reads"] % 2:  # the reading after try k
            state["others"] += (shares[k] if k < len(shares) else 0.0) * cpus
            state["wall"] += 1.0
        state["reads"] += 1
        return state["others"], state["wall"]
    return read


def test_a_try_under_load_is_measured_again_and_the_quiet_least_repeat_kept():
    # the newcomer's record: one busy process on 2 cores slowed every repeat ~10x, evenly
    loaded = {"fwd_ms": [201.0, 205.0, 210.0], "fwd_grad_ms": [120.0, 125.0, 130.0]}
    quiet = {"fwd_ms": [21.5, 20.8, 22.0], "fwd_grad_ms": [31.0, 30.2, 30.9]}
    samples, calls = tries(loaded, quiet)
    log = []
    timing = SteadyTiming(others=clock(0.5, 0.02), cpus=2, log=log.append)
    assert timing(samples, "block kind dense") == {"fwd_ms": 20.8, "fwd_grad_ms": 30.2}
    assert median_timing(tries(loaded)[0], "x")["fwd_ms"] == 205.0  # the old rule kept this
    assert len(calls) == 2
    rec = timing.records["block kind dense"]
    assert rec["tries"] == 2 and not rec["disturbed"]
    assert rec["others_share"] == pytest.approx(0.02)
    # spread: the wider series, fwd_grad 130 / 120 = 1.083 (fwd: 210 / 201 = 1.045)
    assert log == ["calibration: block kind dense measured again (repeats spread 1.08x, other "
                   "processes used 50% of the CPUs)"]


def test_widely_spread_repeats_are_measured_again_even_without_a_load_reading():
    spread = {"head_ms": [30.0, 10.0, 31.0]}  # 3.1x > 1.5x
    tight = {"head_ms": [11.0, 12.0, 11.5]}
    samples, calls = tries(spread, tight)
    timing = SteadyTiming(others=lambda: None, cpus=2)
    assert timing(samples, "ends") == {"head_ms": 10.0}  # the least over both tries
    assert len(calls) == 2 and timing.records["ends"]["others_share"] is None


def test_a_measurement_disturbed_on_every_try_is_kept_and_marked():
    samples, calls = tries(*[{"bwd_ms": [90.0 - k, 40.0, 40.0]} for k in range(3)])
    timing = SteadyTiming(others=clock(0.0, 0.0, 0.0), cpus=2, max_tries=3)
    assert timing(samples, "block kind dense") == {"bwd_ms": 40.0}
    assert len(calls) == 3 and timing.records["block kind dense"]["disturbed"]


def test_a_quiet_first_try_is_the_only_one():
    samples, calls = tries({"fwd_ms": [20.0, 21.0, 20.5]})
    timing = SteadyTiming(others=clock(0.1), cpus=2)
    assert timing(samples, "block kind dense") == {"fwd_ms": 20.0} and len(calls) == 1


def test_other_processes_cpu_time_is_the_busy_time_less_this_process(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = 100+20+30+6+7+8 = 171 ticks
    stat.write_text("cpu  100 20 30 1000 5 6 7 8 0 0\ncpu0 50 10 15 500 2 3 3 4 0 0\n"
                    "cpu1 50 10 15 500 3 3 4 4 0 0\nintr 1 2 3\n")
    own = tmp_path / "self"
    # pid (comm with ") " in it) state, then fields 4..13, utime = 50, stime = 21 ticks
    own.write_text("4242 (py (x) y) S 1 2 3 4 5 6 7 8 9 10 50 21 0 0 20 0 3 0 99\n")
    others, wall = cpu_others_s(stat=stat, own=own, clock=lambda: 7.0)
    ticks = os.sysconf("SC_CLK_TCK")
    assert (others, wall) == (pytest.approx((171 - 71) / ticks), 7.0)
    assert cpu_count_of(stat) == 2
    assert cpu_others_s(stat=tmp_path / "missing", own=own) is None


def test_block_times_go_through_the_calibrations_timing_rule():
    adapter = model_pair(tiny_config("llama", layers=2))[1]
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    timing = SteadyTiming(others=clock(0.9, 0.0), cpus=2)  # the first try under load
    times = block_kind_times(bench, ["dense", "dense"], repeats=2, warmup=0, timing=timing)
    assert timing.records["block kind dense"]["tries"] >= 2
    assert all(times["dense"][k] > 0 for k in ("fwd_ms", "fwd_grad_ms", "bwd_ms"))
