"""The profiler: its output is a profile `spec.costs` accepts, and an injected NVMe read delay
shows up in the measured read rate (a bound the sleep guarantees, not a timing of the machine)."""

from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import BATCH, SEQ, model_pair, tiny_config
from lazytrain.profile.bench_blocks import BlockBench, block_kind_times
from lazytrain.profile.bench_rates import host_rates, nvme_rates, optimizer_exposed_ms
from lazytrain.runtime.nvme import FaultInjector
from lazytrain.profile.profiler import measure_profile
from lazytrain.spec.costs import profile_costs
from lazytrain.spec.hardware import get_hardware
from lazytrain.spec.model import ModelSpec


@pytest.fixture(scope="module")
def adapter():
    return model_pair(tiny_config("llama", layers=2))[1]


def test_block_times_are_measured_per_kind_with_the_engine_functions(adapter):
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    times = block_kind_times(bench, ["dense", "dense"], repeats=1, warmup=0)
    assert list(times) == ["dense"] and times["dense"]["block"] == 0
    assert all(times["dense"][k] > 0 for k in ("fwd_ms", "fwd_grad_ms", "reforward_ms", "bwd_ms"))
    assert "workspace_bytes" not in times["dense"]  # CPU: no allocator peak to read


def test_the_timed_reforward_is_the_truncated_one_with_the_full_one_s_gradients(adapter):
    """reforward_ms times the engine's re-forward: the down projection is not run (the output
    value differs from the full forward's by it) while every gradient equals the full one's."""
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    flat = bench.weights(0)
    full, cut = bench.forward_grad(0, flat), bench.forward_grad(0, flat, truncated=True)
    assert not torch.allclose(full[2], cut[2])
    torch.testing.assert_close(bench.backward(*cut, j=0), bench.backward(*full, j=0))


def test_an_injected_read_delay_bounds_the_measured_nvme_read_rate(tmp_path):
    faults = FaultInjector()
    faults.delay_reads(20.0)
    nbytes = 1 << 20  # one 4 MiB-or-less chunk: one delayed read per transfer
    rates = nvme_rates(tmp_path, nbytes, repeats=2, fault_hook=faults)
    assert rates["nvme_read"] <= nbytes / 0.020  # each read sleeps >= 20 ms
    assert not list(tmp_path.glob("ckpt_*"))     # the store removed its files


def test_optimizer_replay_restores_the_weights(adapter):
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    before = [g.master.clone() for g in adapter.params.groups]
    out = optimizer_exposed_ms(bench, repeats=1)
    assert out["exposed_ms"] >= 0 and out["ends_load_ms"] > 0
    assert all(torch.equal(a, g.master) for a, g in zip(before, adapter.params.groups))


@pytest.mark.slow
def test_the_measured_profile_is_accepted_by_profile_costs(adapter, tmp_path):
    spec = ModelSpec.from_hf_config(adapter.config.to_dict())
    prof = measure_profile(adapter, [b.kind for b in spec.blocks], micro_batch=BATCH,
                           seq_len=SEQ, compute_dtype="fp32", device="cpu",
                           nvme_dir=tmp_path / "nvme", repeats=1, warmup=0,
                           model_config_sha256=spec.config_sha256)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    costs = profile_costs(spec, path, hw=get_hardware("cpu"), seq_len=SEQ, micro_batch=BATCH,
                          compute_dtype="fp32")
    kind = spec.blocks[0].kind
    assert costs.blocks[0].fwd_ms == prof["block_kinds"][kind]["fwd_ms"]
    measured = prof["block_kinds"][kind]
    assert costs.blocks[0].saved_bytes == (measured["saved_l1_bytes"],
                                           measured["saved_l2_bytes"])
    assert costs.hardware.nvme_read_bytes_per_s == pytest.approx(
        prof["bandwidths"]["nvme_read_gb_per_s"] * 1e9)
    assert costs.step_const_ms == prof["step_const_ms"] > 0
    assert set(prof["cpu_contention"]) >= {"compute_slowdown_with_optimizer",
                                           "nvme_effective_gb_per_s"}


def test_the_quick_profile_has_every_key_of_the_full_one(adapter, tmp_path):
    spec = ModelSpec.from_hf_config(adapter.config.to_dict())
    kw = dict(micro_batch=BATCH, seq_len=SEQ, compute_dtype="fp32", device="cpu",
              model_config_sha256=spec.config_sha256)
    kinds = [b.kind for b in spec.blocks]
    full = measure_profile(adapter, kinds, nvme_dir=tmp_path / "a", repeats=1, warmup=0, **kw)
    quick = measure_profile(adapter, kinds, nvme_dir=tmp_path / "b", quick=True, **kw)

    def keys(d, prefix=""):
        return {prefix + k for k in d} | {x for k, v in d.items() if isinstance(v, dict)
                                          for x in keys(v, f"{prefix}{k}.")}
    assert keys(quick) >= keys(full)  # quick adds only the record of its steady timing
    assert all(k.startswith("measurements.steady") for k in keys(quick) - keys(full))
    assert set(quick["measurements"]["steady"]) == {"block kind dense",
                                                    "save levels of block kind dense", "ends"}


def test_the_head_bench_runs_on_boundary_l_and_computes_the_hf_loss():
    ref, adapter = model_pair(tiny_config("llama", layers=2, tied=True))
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    with torch.no_grad():  # plain HF: embedding -> both layers -> norm -> head -> mean CE
        want = ref(input_ids=bench.ids, labels=bench.labels, use_cache=False).loss
    assert bench.head() == pytest.approx(float(want), rel=1e-5)


def test_host_rates_are_measured_for_the_run_dtypes(adapter):
    bench = BlockBench(adapter, micro_batch=BATCH, seq_len=SEQ, dtype="fp32",
                       device=torch.device("cpu"))
    host = host_rates(bench, repeats=1, warmup=0)
    assert host["master_dtype"] == "fp32"
    assert all(host[k] > 0 for k in ("convert_gb_per_s", "accumulate_gb_per_s",
                                     "accumulate_first_gb_per_s", "staging_copy_gb_per_s",
                                     "optimizer_ms_per_mparam"))
