"""This machine's torch facts that a calibration depends on, read without importing torch.

A calibration's cache key holds the torch version, the torch thread count and, on CUDA, the
GPU's name (`profile.calibrate.KEY_FIELDS`); whether `runtime.device: auto` means CUDA decides
which machine a plan is for. `lazytrain train` and `lazytrain profile` have torch loaded, and
these functions then ask it (exact). `lazytrain plan`, `simulate` and `report` never load torch
(a second of start-up and gigabytes of libraries for a table), so there the same facts are
read from what torch itself reads:

- the version: the installed distribution's metadata (`importlib.metadata`), which is the
  `torch.__version__` string of the same install;
- the thread count: the physical cores (`/sys/devices/system/cpu/cpu*/topology`; the logical
  CPUs, `os.cpu_count()`, where there are no more), lowered to `MKL_NUM_THREADS`, else
  `OMP_NUM_THREADS`, when set: `at::intraop_default_num_threads` and
  `c10::TaskThreadPoolBase::defaultNumThreads` in PyTorch's sources, and what torch 2.13
  reports (a setting above the cores is capped to them);
- CUDA: a torch build without the `+cpu` tag, an NVIDIA driver with a GPU
  (`/proc/driver/nvidia/gpus/*/information`, its `Model:` line being the name CUDA reports)
  and `CUDA_VISIBLE_DEVICES` not hiding every device.

Where such a reading differs from torch's (an unusual thread setting, GPUs of mixed models),
`lazytrain plan` misses the cached entry and plans analytic, saying so in its costs line; it
never uses a calibration measured for another key.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""The NVIDIA driver's per-GPU directories (one per PCI device, each with an `information`
file)."""
CPU_SYS = Path("/sys/devices/system/cpu")
"""Linux's CPU topology (one `cpuN/topology` per logical CPU)."""


def _torch():
    """The torch module when this process has loaded it, else None (never imports it)."""
    return sys.modules.get("torch")


def torch_version() -> str:
    """`torch.__version__` (e.g. "2.13.0+cpu"); "none" when torch is not installed."""
    torch = _torch()
    if torch is not None:
        return str(torch.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _env_threads(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "")))
    except ValueError:
        return 0


def physical_cores() -> int | None:
    """Distinct (package, core) pairs of the present CPUs; None where sysfs lacks them."""
    pairs = set()
    for topo in CPU_SYS.glob("cpu[0-9]*/topology"):
        try:
            pairs.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(pairs) or None


def torch_threads() -> int:
    """`torch.get_num_threads()`, or the number torch would start with (module docstring)."""
    torch = _torch()
    if torch is not None:
        return int(torch.get_num_threads())
    logical = os.cpu_count() or 1
    cores = physical_cores()
    default = cores if cores is not None and 0 < cores < logical else logical
    threads = _env_threads("MKL_NUM_THREADS") or _env_threads("OMP_NUM_THREADS")
    return min(threads, default) if threads else default


def _nvidia_models() -> list[str]:
    """The `Model:` names of the driver's GPUs, in PCI order (empty without the driver)."""
    names = []
    for info in sorted(NVIDIA_GPUS.glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return names


def _cuda_hidden() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1")


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, or its reading without torch (module docstring)."""
    torch = _torch()
    if torch is not None:
        return bool(torch.cuda.is_available())
    version = torch_version()
    return (version != "none" and "+cpu" not in version and not _cuda_hidden()
            and bool(_nvidia_models()))


def cuda_device_name() -> str:
    """`torch.cuda.get_device_name()`, or the first NVIDIA GPU's model without torch ("" when
    there is none)."""
    torch = _torch()
    if torch is not None:
        return str(torch.cuda.get_device_name())
    models = _nvidia_models()
    return models[0] if models else ""
