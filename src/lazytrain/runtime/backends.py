"""The device backends by name: `make_device` builds the backend a `runtime.device` value names,
`as_device` turns a name or a torch device into one.

The registry sits above the backends (`runtime.device`'s CPU one, `runtime.cuda_device`,
`runtime.hb_checker`, `runtime.threaded_device`): it imports them, none imports it.
"""

from __future__ import annotations

import torch

from lazytrain.runtime.cuda_device import CudaDevice
from lazytrain.runtime.device import Device
from lazytrain.runtime.hb_checker import CheckedDevice
from lazytrain.runtime.threaded_device import ThreadedDevice

DEVICE_KINDS = ("cpu", "cuda", "cpu-checked", "cpu-threaded")
"""`runtime.device` values that name a backend (`auto` resolves to cuda or cpu)."""


def make_device(kind: str, *, index: int | None = None, seed: int = 0) -> Device:
    """The backend named `kind` (`runtime.device`; "auto": cuda when torch sees one, else cpu).

    Args:
        kind: "auto", "cpu", "cuda", "cpu-checked" or "cpu-threaded".
        index: CUDA device index (data parallel: the local rank).
        seed: seeds the delays of cpu-threaded.

    Raises:
        ValueError: unknown kind, or cuda without a CUDA device.
    """
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return Device(seed=seed)
    if kind == "cuda":
        return CudaDevice(index=index, seed=seed)
    if kind == "cpu-checked":
        return CheckedDevice(seed=seed)
    if kind == "cpu-threaded":
        return ThreadedDevice(seed=seed)
    raise ValueError(f"runtime.device: unknown value {kind!r}; use one of auto, "
                     f"{', '.join(DEVICE_KINDS)}")


def as_device(device) -> Device:
    """A `Device` from a `Device`, a backend name, or a torch.device / "cpu" / "cuda[:i]"."""
    if isinstance(device, Device):
        return device
    if isinstance(device, torch.device) or (isinstance(device, str) and device.startswith("cuda:")):
        td = torch.device(device)
        return make_device(td.type, index=td.index)
    return make_device(str(device))
