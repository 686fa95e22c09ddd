"""`HardwareSpec`: capacities, link bandwidths and compute rate of one training machine.

Owns the presets (one per GPU model, SXM and PCIe separately, the
LazyTrain paper's `h800-paper`, and `cpu` for this machine), loading/saving a spec as JSON or
YAML, and applying the run config's `hardware:` overrides. Knows nothing of models or plans.

Units: bytes, bytes/s, FLOP/s (decimal GB = 1e9 bytes, as the vendor datasheets). Figures come
from the vendor datasheets and the measured host-link ranges users posted (nvbandwidth
results); every preset says which figure it took and why.

Host side of the GPU presets: unless the config overrides it, every GPU preset assumes the
LazyTrain paper's host (arXiv 2608.11919, setup section): a 360 GB host-DRAM budget and
2 x 7 TB NVMe measured at 2.83 GB/s read / 3.35 GB/s write through the trainer's path (the two
drives together). A preset describes the GPU; the host is a planning assumption to override
with `hardware.dram_gb`, `nvme_gb`, `nvme_read_gb_per_s`, `nvme_write_gb_per_s`. The host's
weight conversion and gradient accumulation rates are a typical single-socket DDR5 server's
(`SERVER_STREAM_BYTES_PER_S`; the paper states none).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from lazytrain.atomic import write_text_atomic
from lazytrain.units import GB

TFLOPS = 1e12

CONVERT_TRAFFIC_PER_BYTE = 3.0
"""DRAM bytes moved per compute-dtype byte a conversion writes, in the reference case of the
host rates below: fp32 master to bf16 staging reads 4 B and writes 2 B per parameter, 6 B per
2 output bytes. `planner/build.py` rescales the rates to the run's dtypes."""
ACCUMULATE_TRAFFIC_PER_BYTE = 5.0
"""DRAM bytes moved per drained gradient byte an accumulation adds, in the reference case:
a bf16 gradient (2 B read) added into an fp32 accumulator (4 B read + 4 B written), 10 B per
2 gradient bytes."""

SERVER_STREAM_BYTES_PER_S = 0.75 * 4800e6 * 8 * 8
"""STREAM copy and add bandwidth of a single-socket DDR5 server, bytes/s (STREAM counts a
byte read and a byte written each once): 8 channels of DDR5-4800 (a 4th-generation Xeon, the
host CPU of H100/H800 HGX servers) give 4800e6 T/s x 8 channels x 8 B = 307.2 GB/s of wire
rate (the formula of ai-hpc.org/en/guide/02-cluster/stream-benchmark); STREAM sustains about
three quarters of it (TI's published STREAM tables, SPRAD45A: copy 77%, add 78% of wire rate):
0.75 x 307.2 = 230.4 GB/s for both copy and add. An assumption of a typical host, not the
paper's (it states no host memory figure): `lazytrain profile` measures the real one."""

PAPER_HOST = dict(dram_bytes=int(360 * GB), nvme_bytes=int(14_000 * GB),
                  nvme_read_bytes_per_s=2.83 * GB, nvme_write_bytes_per_s=3.35 * GB,
                  host_convert_bytes_per_s=SERVER_STREAM_BYTES_PER_S / CONVERT_TRAFFIC_PER_BYTE,
                  host_accumulate_bytes_per_s=SERVER_STREAM_BYTES_PER_S
                  / ACCUMULATE_TRAFFIC_PER_BYTE)
"""The LazyTrain paper's host (arXiv 2608.11919): 360 GB CPU budget, 2 x 7 TB NVMe at
2.83 GB/s read and 3.35 GB/s write (measured, both drives). Host conversion and accumulation
rates: `SERVER_STREAM_BYTES_PER_S` / the traffic per byte: 230.4 / 3 = 76.8 GB/s of bf16
weights converted from fp32 masters, 230.4 / 5 = 46.08 GB/s of bf16 gradients added into fp32
accumulators."""

ADAMW_TRAFFIC_BYTES_PER_PARAM = 28
"""DRAM bytes a fused fp32 AdamW update moves per parameter: it reads the master, the gradient
and both moments (4 x 4 B) and writes the master and both moments (3 x 4 B)."""
Q8_UPDATE_SLOWDOWN = 10.0
"""The CPU 8-bit AdamW update (bitsandbytes' kernel: dequantize the moments, update,
re-quantize, per 256 values) / the fused fp32 one: the config's `planner.allow_q8` figure for
this machine kind (a 2-core machine under load measured 3.2 and 89 ms per 1e6 parameters, 27x;
`lazytrain profile` measures both)."""
Q8_UPDATE_EXTRA_MS_PER_GPARAM = ((Q8_UPDATE_SLOWDOWN - 1) * ADAMW_TRAFFIC_BYTES_PER_PARAM
                                 / SERVER_STREAM_BYTES_PER_S * 1e12)
"""The 8-bit update's extra time over the fp32 one on the reference server host, ms per 1e9
parameters: the fp32 update is memory bound, 28 B / 230.4 GB/s = 0.1215 ms per 1e6 parameters,
and the 8-bit one `Q8_UPDATE_SLOWDOWN` times that: 9 x 121.5 = 1093.75 ms per 1e9 parameters.
The default of `PlanningProblem.q8_update_ms_per_gparam`; a measured profile replaces it."""

H800_PAPER_MATMUL_EFFICIENCY = 0.2814
"""Matmul efficiency of the h800-paper preset, from one closed-form calibration; never tuned.

Target: the LazyTrain paper's MegaTrain baseline, 176.9 model TFLOPS (arXiv 2608.11919).
Rule: MegaTrain, K = 4 (boundaries 0, 4, ..., 64 in HBM, the rest recomputed, every block
re-forwarded with autograd in backward, no activation transfers).
Scenario: Qwen3.5-27B (configs/qwen3.6-27b-h800.yaml; 64 blocks, 48 linear + 16 full
attention; N = 26.896e9 parameters incl. embeddings, `lazytrain.spec.model`), seq 1024 x
micro-batch 72 = 73,728 tokens, bf16 compute, grad_accum 1; h800-paper links (12/12 GB/s,
duplex 24 GB/s) and 989e12 FLOP/s peak; analytic costs of `lazytrain.spec.costs`.
Arithmetic (`lazytrain.spec.costs.calibrate_matmul_efficiency`): the scenario is compute-bound
in every window under the rule (link time <= compute time; tests/spec/test_costs.py), so
step_ms = C1 / eff + X + W with C1 = hardware FLOPs / 989e12 (blocks: fwd + 3/4 recompute +
1.05 x re-forward + bwd; head 6 T V H), X the pre/post link terms (P[0] H2D, G[0] + ends
D2H, embedding gather) and W the recompute load waits (16 segments x 2 weight loads of
0.77 GB at 12 GB/s = 2.04 s; docs/execution_model.md "In-window order"); the target step is
6 N T / 176.9e12 = 67.26 s; closed form eff = 0.28141, rounded to 0.2814. (Before the model
charged W the same closed form gave 0.2728.) The other GPU presets reuse it (same kernels,
same shapes).
"""


SPEC_RANGES: dict[str, tuple[float, float]] = {
    "bandwidth": (1e-3 * GB, 1e6 * GB),
    "peak_flops": (1e-3 * TFLOPS, 1e6 * TFLOPS),
    "matmul_efficiency": (1e-3, 1.0),
    "capacity_bytes": (0.0, 1e6 * GB),
}
"""Plausible ranges of a spec's figures (also what the config's `hardware:` overrides allow,
in GB, GB/s and TFLOP/s): bandwidths 1 MB/s..1 PB/s, peak 1 GFLOP/s..1 EFLOP/s, efficiency
1e-3..1, capacities up to 1 PB. Far outside any real machine; outside them the figures are
typos or overflow (`.inf`, `1e400`), and the planner's LP (ms costs, 1e9..1e12-byte sizes)
loses its numeric precision (1e-300 GB/s: HiGHS ends with status error)."""


PLAUSIBLE_RANGES: dict[str, tuple[str, float, float]] = {
    "hbm_bytes": ("HBM per GPU", 1e6, 2e12),
    "dram_bytes": ("DRAM per node", 16e6, 64e12),
    "nvme_bytes": ("NVMe per node", 0.0, 1e15),
    "bandwidth": ("bandwidth", 1e6, 10e12),
    "peak_flops": ("peak compute", 1e9, 100e15),
}
TYPICAL = {"hbm_bytes": 80e9, "dram_bytes": 1e12, "nvme_bytes": 4e12, "bandwidth": 25e9,
           "peak_flops": 1e15}
"""A typical figure of each kind (an H100-class node): of the unit mistakes that would bring a
refused figure into range, the hint names the one that lands nearest to it (log scale)."""
"""Kind -> (name, low, high) in bytes, bytes/s or FLOP/s: what a real machine can have (the
table in docs/execution_model.md, "Hardware figures"). HBM 1 MB..2 TB (the `cpu` preset and
configs/tiny-llama-cpu.yaml use 64 MB), DRAM 16 MB..64 TB, NVMe 0..1 PB, every bandwidth
1 MB/s..10 TB/s (1 MB/s = 0.001 GB/s stays accepted: the planner handles slow links),
peak 1 GFLOP/s..100 PFLOP/s. Outside, the figure is most likely typed in the wrong unit
(`hbm_gb: 80000` meant MB); `hardware.allow_implausible: true` lets it through."""

_UNIT_NAMES = {"bytes": {1.0: "bytes", 1e3: "kB", 1e6: "MB", 1e9: "GB", 1e12: "TB", 1e15: "PB"},
               "bytes/s": {1.0: "B/s", 1e3: "kB/s", 1e6: "MB/s", 1e9: "GB/s", 1e12: "TB/s",
                           1e15: "PB/s"},
               "FLOP/s": {1.0: "FLOP/s", 1e6: "MFLOP/s", 1e9: "GFLOP/s", 1e12: "TFLOP/s",
                          1e15: "PFLOP/s", 1e18: "EFLOP/s"}}


def _kind(field_name: str) -> str:
    return "bandwidth" if field_name.endswith("_bytes_per_s") else field_name


def _pretty(value: float, family: str) -> str:
    """`80 GB`, `1.5 GB/s`, `989 TFLOP/s`: the largest unit that keeps the number >= 1."""
    names = _UNIT_NAMES[family]
    unit = max((u for u in names if u <= abs(value)), default=min(names))
    return f"{value / unit:g} {names[unit]}"


def implausible_figure(field_name: str, value: float, *, typed_unit: float = 1.0,
                       label: str | None = None) -> str | None:
    """A one-line refusal when `value` (bytes, bytes/s or FLOP/s) is outside its kind's
    `PLAUSIBLE_RANGES`, else None.

    Args:
        field_name: the HardwareSpec field (`hbm_bytes`, `h2d_bytes_per_s`, `peak_flops`).
        value: the figure in base units.
        typed_unit: the unit the user typed it in (1e9 for `hbm_gb`, 1 for a file's bytes).
        label: how to name the field in the message (default `hardware <field_name>`).

    Returns:
        `hardware.hbm_gb: 80000 GB = 80 TB is not a plausible HBM per GPU (1 MB..2 TB); MB
        typed as GB? (80000 MB = 80 GB); set hardware.allow_implausible: true (or
        --allow-implausible) if it is right`, or None.
    """
    kind = _kind(field_name)
    if kind not in PLAUSIBLE_RANGES:
        return None
    what, lo, hi = PLAUSIBLE_RANGES[kind]
    if lo <= value <= hi:
        return None
    family = "FLOP/s" if kind == "peak_flops" else "bytes/s" if kind == "bandwidth" else "bytes"
    names = _UNIT_NAMES[family]
    typed = value / typed_unit
    head = (f"{label or 'hardware ' + field_name}: {typed:g} {names.get(typed_unit, '')} = "
            f"{_pretty(value, family)} is not a plausible {what} ({_pretty(lo, family)}.."
            f"{_pretty(hi, family)})")
    meant = [typed_unit / f if value > hi else typed_unit * f for f in (1e3, 1e6, 1e9, 1e12)]
    meant = [u for u in meant if u in names and lo <= typed * u <= hi and typed * u > 0]
    hint = ""
    if meant:
        u = min(meant, key=lambda u: abs(math.log(typed * u / TYPICAL[kind])))
        hint = (f"; {names[u]} typed as {names.get(typed_unit, 'this unit')}? "
                f"({typed:g} {names[u]} = {_pretty(typed * u, family)})")
    return (head + hint + "; set hardware.allow_implausible: true (or --allow-implausible) "
            "if it is right")


HOST_RATE_FIELDS = ("host_convert_bytes_per_s", "host_accumulate_bytes_per_s")
"""Host work rates; 0 (the default) means the host is not modelled, and passes the checks."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Bandwidths:
    """The rates of the channels a window's bytes move over, bytes/s: the fields `HardwareSpec`
    and `PlanningProblem` (`lazytrain.planner.problem`) share, defined once here; both
    inherit them under the same names.

    The two host rates differ in their dtypes only: a `HardwareSpec` quotes them for fp32
    masters and bf16 compute (the reference dtypes); a `PlanningProblem` holds them rescaled to
    the run's dtypes (`planner/build.py` `host_rates`).
    """

    h2d_bytes_per_s: float
    """Host-to-device copy bandwidth (pinned, copy engine), bytes/s."""
    d2h_bytes_per_s: float
    """Device-to-host copy bandwidth, bytes/s."""
    duplex_bytes_per_s: float
    """Cap on H2D + D2H when both run at once, bytes/s."""
    nvme_read_bytes_per_s: float
    """NVMe -> DRAM through the engine's path, bytes/s."""
    nvme_write_bytes_per_s: float
    """DRAM -> NVMe, bytes/s."""
    host_convert_bytes_per_s: float = 0.0
    """Host rate of converting master weights into the compute-dtype staging buffer, in
    compute-dtype bytes written per s (every weight load: streamed blocks and recompute
    reloads). 0: host work not modelled (the window time ignores it; also hardware files saved
    before the host was a resource)."""
    host_accumulate_bytes_per_s: float = 0.0
    """Host rate of adding a drained compute-dtype gradient into the master-dtype host
    accumulator, drained gradient bytes per s. 0: not modelled."""


@dataclass(kw_only=True, frozen=True, slots=True)
class HardwareSpec(Bandwidths):
    """One machine as the planner sees it (one GPU, or this CPU). The channel rates are the
    inherited `Bandwidths` fields, the host rates for the reference dtypes."""

    name: str
    """Preset name, or the preset with its overrides (`h800-paper+dram_gb=500`)."""
    hbm_bytes: int
    """Device memory, bytes (on `cpu`: the byte budget of the emulated device tier)."""
    dram_bytes: int
    """Host DRAM the trainer may use, bytes."""
    nvme_bytes: int
    """NVMe scratch for checkpoints, bytes (0: no nvme tier)."""
    peak_flops: float
    """Peak dense matmul rate in the compute dtype the preset is for (bf16 on GPUs, fp32 on
    `cpu`), FLOP/s."""
    matmul_efficiency: float
    """Achieved fraction of `peak_flops` for a block's work, in (0, 1]."""
    copies_overlap_compute: bool = True
    """True: copy engines run beside compute (GPU); False: copies and file I/O contend with
    compute for the same cores (CPU)."""
    hbm_bandwidth_bytes_per_s: float = 3350 * GB
    """Device memory bandwidth, bytes/s (memory-bound steps: the embedding gather)."""
    gpus_per_node: int = 1
    """GPUs in the node; `dram_bytes`, `nvme_*` are the node's and are shared by its ranks
    (`lazytrain.planner.topology` divides them)."""
    gpus_per_pcie_switch: int = 1
    """GPUs behind one PCIe switch: they share the switch's x16 uplink, so H2D/D2H per GPU are
    divided by the number of busy GPUs on the switch (1: a root port per GPU)."""
    nvme_devices_per_node: int = 2
    """NVMe drives in the node (the paper's host has 2); `nvme_*_bytes_per_s` are their total."""

    def __post_init__(self) -> None:
        """Type and range checks (numbers, not booleans; `SPEC_RANGES`; counts >= 1). The
        plausibility of each figure for its kind is a separate check (`implausible_figures`).

        Raises:
            ValueError: a non-numeric, non-finite or out-of-range figure (field, range and
                value named).
        """
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "copies_overlap_compute"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"hardware {f.name} must be a number; got {value!r} "
                                 f"({type(value).__name__}) ({self.name})")
            if f.name in HOST_RATE_FIELDS and value == 0:
                continue  # 0: host work not modelled
            if f.name.endswith("_bytes_per_s"):
                lo, hi = SPEC_RANGES["bandwidth"]
                ok, rule = lo <= value <= hi, f"in [{lo:g}, {hi:g}] bytes/s"
            elif f.name == "peak_flops":
                lo, hi = SPEC_RANGES["peak_flops"]
                ok, rule = lo <= value <= hi, f"in [{lo:g}, {hi:g}] FLOP/s"
            elif f.name == "matmul_efficiency":
                lo, hi = SPEC_RANGES["matmul_efficiency"]
                ok, rule = lo <= value <= hi, f"in [{lo:g}, {hi:g}]"
            elif f.name.endswith("_bytes"):
                hi = SPEC_RANGES["capacity_bytes"][1]
                lo_ok = value >= 0 if f.name == "nvme_bytes" else value > 0
                ok = lo_ok and value <= hi
                rule = f"in [0, {hi:g}] bytes" if f.name == "nvme_bytes" else \
                    f"in (0, {hi:g}] bytes"
            else:
                ok, rule = value >= 1, ">= 1"
            if not ok:  # also catches nan, which fails every comparison
                raise ValueError(f"hardware {f.name} must be {rule}; got {value!r} ({self.name})")

    def implausible_figures(self, *, labels: dict | None = None) -> list[str]:
        """One refusal line per figure outside `PLAUSIBLE_RANGES` (empty: all plausible).

        Args:
            labels: {field: (label, typed unit)} for figures the user typed in other units
                (config overrides: `hbm_bytes` -> ("hardware.hbm_gb", 1e9)).
        """
        labels = labels or {}
        out = []
        for f in dataclasses.fields(self):
            label, unit = labels.get(f.name, (None, 1.0))
            if f.name in HOST_RATE_FIELDS and getattr(self, f.name) == 0:
                continue  # not modelled
            line = implausible_figure(f.name, getattr(self, f.name), typed_unit=unit,
                                      label=label)
            if line is not None and f.name != "name":
                out.append(line)
        return out

    @property
    def achieved_flops(self) -> float:
        """`peak_flops * matmul_efficiency`, FLOP/s."""
        return self.peak_flops * self.matmul_efficiency

    def to_dict(self) -> dict:
        """Plain dict (JSON/YAML-serialisable; bytes and bytes/s), `name` first."""
        d = dataclasses.asdict(self)
        return {"name": d.pop("name"), **d}

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        """Inverse of `to_dict`.

        Raises:
            ValueError: an unknown or missing field (named).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown hardware field(s) {unknown}; valid: {sorted(names)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"hardware spec: {exc}") from None


def _gpu(name: str, *, hbm_gb: float, bf16_tflops: float, h2d_gb: float, d2h_gb: float,
         hbm_bw_gb: float) -> HardwareSpec:
    """A GPU preset on the paper's host; duplex cap = 2 x the slower direction (Gen5 CE
    bidirectional copies run at about the one-way rate each: ~51 GB/s each way on an RTX 5090,
    the H100 host-link measurements users posted)."""
    return HardwareSpec(name=name, hbm_bytes=int(hbm_gb * GB), h2d_bytes_per_s=h2d_gb * GB,
                        d2h_bytes_per_s=d2h_gb * GB,
                        duplex_bytes_per_s=2 * min(h2d_gb, d2h_gb) * GB,
                        peak_flops=bf16_tflops * TFLOPS,
                        matmul_efficiency=H800_PAPER_MATMUL_EFFICIENCY,
                        hbm_bandwidth_bytes_per_s=hbm_bw_gb * GB, **PAPER_HOST)


# Host links: the LOW end of the practical (measured) ranges (h2d_practical_gbs[0],
# d2h_practical_gbs[0]): a plan that hides transfers at the low end also hides them at the
# high end, and the low end is what SM copies and unlucky NUMA placement give.
PRESETS: dict[str, HardwareSpec] = {
    # H100-SXM5-80GB: 80 GB HBM3 3350 GB/s; BF16 dense 989.4 TFLOPS (NVIDIA whitepaper via
    # glennklockwood.com/garden/processors/h100); H2D 35 / D2H 50 GB/s (nvbandwidth SM copies,
    # github.com/NVIDIA/nvbandwidth/issues/24). Host: the paper's (module docstring).
    "h100-sxm": _gpu("h100-sxm", hbm_gb=80, bf16_tflops=989.4, h2d_gb=35, d2h_gb=50,
                     hbm_bw_gb=3350),
    # H100-PCIe-80GB: 80 GB HBM2e 2000 GB/s; BF16 dense 756 TFLOPS (hpctech H100 datasheet
    # table, sparse/2); H2D 35 / D2H 45 GB/s (practical low ends of the measured ranges). Paper host.
    "h100-pcie": _gpu("h100-pcie", hbm_gb=80, bf16_tflops=756, h2d_gb=35, d2h_gb=45,
                      hbm_bw_gb=2000),
    # H800-SXM5-80GB: same GH100 compute and HBM as H100 SXM (aiwiki.ai/wiki/nvidia_h800);
    # H2D 35 / D2H 50 GB/s (NVIDIA/nvbandwidth GitHub issue #24: H800 behaves like H100). Paper host.
    "h800-sxm": _gpu("h800-sxm", hbm_gb=80, bf16_tflops=989.4, h2d_gb=35, d2h_gb=50,
                     hbm_bw_gb=3350),
    # H800-PCIe-80GB: assumed equal to H100 PCIe (high uncertainty: no published measurement); 756
    # TFLOPS, H2D 35 / D2H 45 GB/s. Paper host.
    "h800-pcie": _gpu("h800-pcie", hbm_gb=80, bf16_tflops=756, h2d_gb=35, d2h_gb=45,
                      hbm_bw_gb=2000),
    # H200-SXM-141GB: 141 GB HBM3e 4800 GB/s, BF16 dense 989.4 TFLOPS (itkb.uw.cz H200 vs B300
    # page); H2D 35 / D2H 50 GB/s (PCIe Gen5 like H100). Paper host.
    "h200": _gpu("h200", hbm_gb=141, bf16_tflops=989.4, h2d_gb=35, d2h_gb=50, hbm_bw_gb=4800),
    # A100-SXM4-80GB: 80 GB HBM2e 2039 GB/s, BF16 dense 312 TFLOPS (A100 datasheet via
    # glennklockwood.com); H2D 12 / D2H 13 GB/s (CUDA bandwidthTest posted for A100 SXM4, the
    # low end of 12-25). Paper host.
    "a100-80gb": _gpu("a100-80gb", hbm_gb=80, bf16_tflops=312, h2d_gb=12, d2h_gb=13,
                      hbm_bw_gb=2039),
    # RTX 3090: 24 GB GDDR6X 936 GB/s; BF16 with fp32 accumulate ~71 TFLOPS (half the
    # fp16-accumulate rate; inferred); H2D/D2H 20 GB/s (Gen4 x16 low end). Host:
    # the paper's.
    "rtx-3090": _gpu("rtx-3090", hbm_gb=24, bf16_tflops=71, h2d_gb=20, d2h_gb=20,
                     hbm_bw_gb=936),
    # RTX 4090: 24 GB GDDR6X 1008 GB/s; BF16 fp32-accumulate 165.2 TFLOPS (gigagpu.com);
    # H2D/D2H 20 GB/s (clpeak 20.9/20.1 GB/s, github.com/krrishnarraj/clpeak/issues/106). Host:
    # the paper's (host rates: PAPER_HOST).
    "rtx-4090": _gpu("rtx-4090", hbm_gb=24, bf16_tflops=165.2, h2d_gb=20, d2h_gb=20,
                     hbm_bw_gb=1008),
    # h800-paper: the LazyTrain paper's machine (arXiv 2608.11919). 80 GB HBM; PCIe measured at
    # 12 GB/s per direction by the paper, duplex cap 24 GB/s (both directions at full rate);
    # 989 TFLOPS bf16 peak; host 360 GB DRAM, 2 x 7 TB NVMe 2.83 / 3.35 GB/s; host conversion
    # 76.8 GB/s and accumulation 46.08 GB/s (PAPER_HOST: a single-socket DDR5-4800 server's
    # STREAM copy/add 230.4 GB/s over 3 and 5 bytes of traffic per byte).
    # matmul_efficiency: calibrated once, see H800_PAPER_MATMUL_EFFICIENCY.
    "h800-paper": HardwareSpec(
        name="h800-paper", hbm_bytes=int(80 * GB), h2d_bytes_per_s=12 * GB,
        d2h_bytes_per_s=12 * GB, duplex_bytes_per_s=24 * GB, peak_flops=989 * TFLOPS,
        matmul_efficiency=H800_PAPER_MATMUL_EFFICIENCY, hbm_bandwidth_bytes_per_s=3350 * GB,
        **PAPER_HOST),
    # cpu: this 2-core AVX2 machine (AMD EPYC, 23 GB RAM). The "device" tier is an 8 GB budget
    # of host memory; DRAM 16 GB of the 23 (the rest for the OS and other jobs); NVMe 50 GB of
    # scratch. Copies are memcpy on the same cores (copies_overlap_compute False): 5 GB/s, a
    # rough single-thread large-memcpy figure; NVMe 1.0 GB/s read / 0.5 GB/s write, a
    # conservative virtual-disk figure. Peak fp32 = 2 cores x 2 FMA pipes x 8 fp32 lanes x
    # 2 FLOP x 2.5 GHz = 160 GFLOP/s; efficiency 0.47 from the measurement "a plain fp32
    # step at 4 x 256 takes about 11 s" for SmolLM2-135M: 6 x 134.5e6 x 1024 FLOP / 11 s =
    # 75 GFLOP/s. Host conversion and accumulation run on the same cores: the same rough 5 GB/s
    # memcpy moves 10 GB/s of DRAM traffic (read + write), so fp32 -> bf16 conversion 10 / 3 =
    # 3.33 GB/s and bf16 -> fp32 accumulation 10 / 5 = 2 GB/s (reference dtypes; this preset's
    # fp32 runs get 5 and 3.33 GB/s after planner/build.py's rescaling). All refined by
    # `lazytrain profile` (measured profile) later.
    "cpu": HardwareSpec(
        name="cpu", hbm_bytes=int(8 * GB), dram_bytes=int(16 * GB), nvme_bytes=int(50 * GB),
        h2d_bytes_per_s=5 * GB, d2h_bytes_per_s=5 * GB, duplex_bytes_per_s=5 * GB,
        nvme_read_bytes_per_s=1.0 * GB, nvme_write_bytes_per_s=0.5 * GB,
        host_convert_bytes_per_s=2 * 5 * GB / CONVERT_TRAFFIC_PER_BYTE,
        host_accumulate_bytes_per_s=2 * 5 * GB / ACCUMULATE_TRAFFIC_PER_BYTE,
        peak_flops=160e9, matmul_efficiency=0.47, copies_overlap_compute=False,
        hbm_bandwidth_bytes_per_s=10 * GB),
}
"""Preset name -> spec (plain dict registry)."""

OVERRIDE_FIELDS: dict[str, tuple[str, float]] = {
    "hbm_gb": ("hbm_bytes", GB),
    "dram_gb": ("dram_bytes", GB),
    "nvme_gb": ("nvme_bytes", GB),
    "h2d_gb_per_s": ("h2d_bytes_per_s", GB),
    "d2h_gb_per_s": ("d2h_bytes_per_s", GB),
    "duplex_gb_per_s": ("duplex_bytes_per_s", GB),
    "nvme_read_gb_per_s": ("nvme_read_bytes_per_s", GB),
    "nvme_write_gb_per_s": ("nvme_write_bytes_per_s", GB),
    "peak_tflops": ("peak_flops", TFLOPS),
    "matmul_efficiency": ("matmul_efficiency", 1.0),
}
"""Config override key (GB, GB/s, TFLOP/s) -> (HardwareSpec field, unit in bytes or FLOP/s)."""


def get_hardware(name_or_path: str | Path, overrides: dict | None = None) -> HardwareSpec:
    """A preset or a saved spec file, with config-style overrides applied.

    Args:
        name_or_path: a key of `PRESETS`, or a JSON/YAML file written by `save_hardware`.
        overrides: `{config key: value}` with the `hardware:` section's keys and units
            (`hbm_gb`, `h2d_gb_per_s`, `peak_tflops`, ...); None values are ignored.

    Returns:
        The spec; when an override changed something, its name lists the overrides.

    Raises:
        ValueError: unknown preset (the presets listed) or unknown override key.
        FileNotFoundError: a path that does not exist.
    """
    key = str(name_or_path)
    if key in PRESETS:
        spec = PRESETS[key]
    elif Path(key).suffix.lower() in (".json", ".yaml", ".yml") or os.sep in key:
        spec = load_hardware(key)
    else:
        raise ValueError(f"hardware.preset {key!r} is not a preset or a .json/.yaml file; "
                         f"presets: {', '.join(PRESETS)}")
    return apply_overrides(spec, overrides or {})


def apply_overrides(spec: HardwareSpec, overrides: dict) -> HardwareSpec:
    """`spec` with config-unit overrides (see `OVERRIDE_FIELDS`) applied; None values skipped."""
    changes, labels = {}, []
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in OVERRIDE_FIELDS:
            raise ValueError(f"unknown hardware override {key!r}; valid: "
                             f"{', '.join(OVERRIDE_FIELDS)}")
        field_name, unit = OVERRIDE_FIELDS[key]
        v = value * unit
        changes[field_name] = int(v) if field_name.endswith("_bytes") else float(v)
        labels.append(f"{key}={value:g}")
    if not changes:
        return spec
    return dataclasses.replace(spec, name=f"{spec.name}+{','.join(labels)}", **changes)


def save_hardware(spec: HardwareSpec, path: str | Path) -> Path:
    """Write `spec` as JSON (`.json`) or YAML (otherwise), atomically (temp + rename)."""
    path = Path(path)
    d = spec.to_dict()
    text = (json.dumps(d, indent=2) + "\n" if path.suffix.lower() == ".json"
            else yaml.safe_dump(d, sort_keys=False))
    return write_text_atomic(path, text)


def load_hardware(path: str | Path) -> HardwareSpec:
    """Read a spec written by `save_hardware` (JSON or YAML).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown or missing fields.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"hardware file not found: {path}")
    text = path.read_text()
    d = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a hardware spec must be a mapping of fields")
    return HardwareSpec.from_dict(d)
