"""Implicit host-device syncs, counted per phase of a step (the `cpu-checked` backend's audit).

A CUDA host thread blocks until the device has run everything queued so far whenever it reads a
device tensor's value: `item()`, `float(t)`, `int(t)`, `bool(t)` (an `if t.any():`), `tolist()`,
`numpy()`, `.cpu()` or `.to("cpu")`. One such read per micro-batch empties the GPU's queue every
micro-batch (the kernels queued ahead are what hides the host's own work). `SyncAudit` is a torch
function mode, entered on the engine's thread only, that records each of these calls on a
"device" tensor under the phase the engine named ("micro_batch", "step_end"). On the CPU
backends every tensor is a CPU tensor, so the backend says which ones stand for device memory
(`is_device`: the checker's non-host buffers).

Knows nothing about plans, windows or the engine.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

SYNC_METHODS = frozenset({
    torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
    torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu})
"""Tensor methods that read a device tensor's value on the host (a device sync on CUDA)."""


def _to_host(args: tuple, kwargs: dict) -> bool:
    """`Tensor.to(...)` of a tensor off the CPU whose target device is the CPU (a D2H the host
    waits for). On the CPU backends the engine's device is the CPU itself, so a `.to("cpu")`
    there moves nothing and cannot be told from a D2H: not flagged (`.cpu()` is)."""
    if args[0].device.type == "cpu":
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any((isinstance(a, str) and a.startswith("cpu"))
               or (isinstance(a, torch.device) and a.type == "cpu") for a in targets)


class SyncAudit(TorchFunctionMode):
    """Records implicit syncs on device tensors into `record[phase]` (a list of op names).

    Args:
        is_device: whether a tensor stands for device memory (CPU backends: not a declared host
            buffer).
        phase: the phase the calls are counted under ("micro_batch", "step_end").
        record: phase -> list of "op of tensor shape dtype" strings, appended to.
    """

    def __init__(self, is_device: Callable[[torch.Tensor], bool], *, phase: str,
                 record: dict[str, list[str]]) -> None:
        super().__init__()
        self.is_device, self.phase, self.record = is_device, phase, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and (
                func in SYNC_METHODS or (func is torch.Tensor.to and _to_host(args, kwargs))):
            t = args[0]
            if self.is_device(t):
                self.record.setdefault(self.phase, []).append(
                    f"{getattr(func, '__name__', func)} of {tuple(t.shape)} {t.dtype}")
        return func(*args, **kwargs)
