"""Hardware presets and spec files: figures against hardware.json, overrides, round trips."""

from __future__ import annotations

import json

import pytest

from lazytrain.spec.hardware import (PRESETS, HardwareSpec, get_hardware, load_hardware,
                                     save_hardware)

PRESET_NAMES = ["h100-sxm", "h100-pcie", "h800-sxm", "h800-pcie", "h200", "a100-80gb",
                "rtx-3090", "rtx-4090", "h800-paper", "cpu"]
HW_JSON_KEY = {"h100-sxm": "H100-SXM5-80GB", "h100-pcie": "H100-PCIe-80GB",
               "h800-sxm": "H800-SXM5-80GB", "h800-pcie": "H800-PCIe-80GB",
               "h200": "H200-SXM-141GB", "a100-80gb": "A100-SXM4-80GB",
               "rtx-3090": "RTX-3090", "rtx-4090": "RTX-4090"}


def test_preset_names_are_exactly_the_agreed_ten():
    assert list(PRESETS) == PRESET_NAMES


@pytest.mark.parametrize("preset", list(HW_JSON_KEY))
def test_gpu_preset_figures_come_from_hardware_json_low_end(preset, shared_dir):
    gpu = json.loads((shared_dir / "hardware.json").read_text())["gpus"][HW_JSON_KEY[preset]]
    spec = PRESETS[preset]
    assert spec.hbm_bytes == (gpu.get("hbm_gb") or gpu.get("vram_gb")) * 1e9
    tflops = gpu.get("bf16_dense_tflops") or gpu["bf16_dense_tflops_fp32_accum"]
    assert spec.peak_flops == pytest.approx(tflops * 1e12)
    assert spec.h2d_bytes_per_s == gpu["h2d_practical_gbs"][0] * 1e9
    assert spec.d2h_bytes_per_s == gpu["d2h_practical_gbs"][0] * 1e9


@pytest.mark.parametrize("preset", list(HW_JSON_KEY))
def test_gpu_presets_take_the_paper_host(preset):
    spec, paper = PRESETS[preset], PRESETS["h800-paper"]
    assert (spec.dram_bytes, spec.nvme_bytes) == (360e9, 14e12)
    assert spec.nvme_read_bytes_per_s == paper.nvme_read_bytes_per_s == 2.83e9
    assert spec.nvme_write_bytes_per_s == paper.nvme_write_bytes_per_s == 3.35e9


def test_h800_paper_is_the_papers_machine():
    s = PRESETS["h800-paper"]
    assert (s.hbm_bytes, s.h2d_bytes_per_s, s.d2h_bytes_per_s, s.duplex_bytes_per_s) == (
        80e9, 12e9, 12e9, 24e9)
    assert s.peak_flops == 989e12 and s.copies_overlap_compute


def test_cpu_preset_contends_instead_of_overlapping():
    assert PRESETS["cpu"].copies_overlap_compute is False


def test_overrides_in_config_units_change_the_spec_and_its_name():
    spec = get_hardware("h800-paper", {"dram_gb": 500, "h2d_gb_per_s": 20, "nvme_gb": None})
    assert spec.dram_bytes == 500e9 and spec.h2d_bytes_per_s == 20e9
    assert spec.name == "h800-paper+dram_gb=500,h2d_gb_per_s=20"
    assert spec.nvme_bytes == PRESETS["h800-paper"].nvme_bytes


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="presets: h100-sxm"):
        get_hardware("h900")


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match="'hbm_gib'"):
        get_hardware("cpu", {"hbm_gib": 1})


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_spec_file_round_trips_and_loads_as_preset_path(tmp_path, suffix):
    path = save_hardware(PRESETS["rtx-4090"], tmp_path / f"box{suffix}")
    assert load_hardware(path) == PRESETS["rtx-4090"]
    assert get_hardware(str(path), {"hbm_gb": 20}).hbm_bytes == 20e9


def test_invalid_figures_are_rejected_with_the_field_named():
    d = PRESETS["cpu"].to_dict() | {"matmul_efficiency": 1.5}
    with pytest.raises(ValueError, match="matmul_efficiency must be in"):
        HardwareSpec.from_dict(d)
    with pytest.raises(ValueError, match="unknown hardware field"):
        HardwareSpec.from_dict(PRESETS["cpu"].to_dict() | {"tflops": 1})


@pytest.mark.parametrize("field,value,rule", [
    ("h2d_bytes_per_s", float("inf"), r"h2d_bytes_per_s must be in \[1e\+06, 1e\+15\] bytes/s"),
    ("d2h_bytes_per_s", 1e-300, r"d2h_bytes_per_s must be in \[1e\+06"),
    ("peak_flops", 1e-300, r"peak_flops must be in \[1e\+09, 1e\+18\] FLOP/s"),
    ("matmul_efficiency", float("nan"), r"matmul_efficiency must be in \[0.001, 1\]"),
    ("hbm_bytes", 10**30, r"hbm_bytes must be in \(0, 1e\+15\] bytes"),
    ("nvme_bytes", -1, r"nvme_bytes must be in \[0, 1e\+15\] bytes"),
    ("gpus_per_node", 0, r"gpus_per_node must be >= 1"),
])
def test_non_finite_or_implausible_spec_figures_are_rejected_with_their_range(field, value, rule):
    with pytest.raises(ValueError, match=rule):
        HardwareSpec.from_dict(PRESETS["cpu"].to_dict() | {field: value})


def test_every_preset_lies_within_the_plausible_ranges():
    for spec in PRESETS.values():
        assert HardwareSpec.from_dict(spec.to_dict()) == spec


# ---- plausibility of each figure (units) ------------------------------------------------------

from lazytrain.spec.hardware import PLAUSIBLE_RANGES, implausible_figure  # noqa: E402


def test_every_preset_is_plausible():
    for name, spec in PRESETS.items():
        assert spec.implausible_figures() == [], name


@pytest.mark.parametrize("field,value,unit,label,meant", [
    ("hbm_bytes", 80000e9, 1e9, "hardware.hbm_gb", "MB typed as GB"),      # MB typed as GB
    ("hbm_bytes", 80000, 1.0, "spec.json: hbm_bytes", "MB typed as bytes"),  # 80 kB
    ("dram_bytes", 2e15, 1e9, "hardware.dram_gb", "MB typed as GB"),
    ("h2d_bytes_per_s", 25000e9, 1e9, "hardware.h2d_gb_per_s", "MB/s typed as GB/s"),
    ("peak_flops", 989000e12, 1e12, "hardware.peak_tflops", "GFLOP/s typed as TFLOP/s"),
    ("nvme_bytes", 4e18, 1e9, "hardware.nvme_gb", "kB typed as GB"),
], ids=["hbm_gb_in_mb", "hbm_bytes_in_mb", "dram_gb_in_mb", "h2d_in_mb_per_s", "peak",
        "nvme_gb_in_kb"])
def test_an_implausible_figure_is_refused_naming_key_value_and_unit_mistake(field, value, unit,
                                                                            label, meant):
    line = implausible_figure(field, value, typed_unit=unit, label=label)
    assert line is not None and line.startswith(f"{label}: {value / unit:g} ")
    assert "not a plausible" in line and "allow_implausible" in line
    assert (meant in line) if meant else ("typed as" not in line)


@pytest.mark.parametrize("field,value", [
    ("hbm_bytes", 0.064e9), ("hbm_bytes", 1e6), ("hbm_bytes", 2e12), ("dram_bytes", 16e6),
    ("nvme_bytes", 0), ("nvme_bytes", 1e15), ("h2d_bytes_per_s", 1e6),
    ("nvme_read_bytes_per_s", 10e12), ("peak_flops", 1e9), ("peak_flops", 100e15),
])
def test_the_edges_of_every_range_are_accepted(field, value):
    assert implausible_figure(field, value) is None
    kind = "bandwidth" if field.endswith("_per_s") else field
    lo, hi = PLAUSIBLE_RANGES[kind][1:]
    assert lo <= value <= hi


@pytest.mark.parametrize("value", ["80GB", True, None], ids=["string", "bool", "null"])
def test_a_non_numeric_hardware_field_is_named(value):
    d = PRESETS["h800-paper"].to_dict()
    d["nvme_bytes"] = value
    with pytest.raises(ValueError, match=r"hardware nvme_bytes must be a number; got"):
        HardwareSpec.from_dict(d)


def test_every_preset_models_the_host_with_the_stated_arithmetic():
    from lazytrain.spec.hardware import PRESETS

    for name, spec in PRESETS.items():
        # GPU presets: 0.75 x (4800e6 x 8 channels x 8 B) = 230.4 GB/s over 3 and 5 B of
        # traffic per byte; cpu: 10 GB/s of memcpy traffic over the same
        stream = 10e9 if name == "cpu" else 230.4e9
        assert spec.host_convert_bytes_per_s == pytest.approx(stream / 3), name
        assert spec.host_accumulate_bytes_per_s == pytest.approx(stream / 5), name


def test_a_spec_without_host_rates_loads_and_passes_the_checks():
    import dataclasses

    from lazytrain.spec.hardware import PRESETS, HardwareSpec

    d = PRESETS["h800-paper"].to_dict()
    del d["host_convert_bytes_per_s"], d["host_accumulate_bytes_per_s"]
    spec = HardwareSpec.from_dict(d)  # a file saved before the host was a resource
    assert spec.host_convert_bytes_per_s == 0.0 and spec.implausible_figures() == []
    with pytest.raises(ValueError, match="host_accumulate_bytes_per_s must be in"):
        dataclasses.replace(spec, host_accumulate_bytes_per_s=-5.0)
