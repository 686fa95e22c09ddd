"""The engine's `grad_sync` hook: global token count and loss, per-group gradient reduction as
soon as the group's gradient is final, and the global gradient norm.

Loss normalisation: the engine divides every micro-batch loss by the label tokens of the
*global* batch (`all_sum` of the ranks' counts), so the sum over ranks of the local gradients is
the gradient of the global batch, the same as one process running all of it (with grad_accum,
or a bigger micro-batch, same plan per micro-batch).

Per block: when block j's last-micro-batch gradient is in the host accumulator (the drain's
`on_done`), `grads_final` issues `dist.reduce(grad, dst=owner, async_op=True)` on the `grads`
gloo group and returns; the engine goes on with block j-1's backward while the reduction runs
(overlap). The owner's update of j waits for the handle (`wait`, on the optimizer worker)
before stepping. Issue order is the backward order b{L-1}..b0, then the ends, on every rank.
After a reduce only the owner's accumulator is meaningful (gloo may use the others as scratch).

Clipping: `global_grad_norm` waits for every pending reduction, sums the squares of the groups
this rank owns, and all-reduces that sum: the norm of the global gradient, as one process
computes it (up to fp32 summation order).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from lazytrain.models.host_params import HostParams, ParamGroup
from lazytrain.runtime.device import Device


class GradReducer:
    """Cross-rank reduction of host gradients for one engine.

    Args:
        params: the host store whose accumulators are reduced.
        owners: group name -> owner rank (`sharding.group_owners`).
        rank: this rank.
        group: the gloo process group for reductions (None: one process; every call is local).
    """

    def __init__(self, params: HostParams, *, owners: dict[str, int], rank: int,
                 group=None) -> None:
        self.params, self.owners, self.rank, self.group = params, owners, rank, group
        self.pending: dict[str, object] = {}
        self._lock = threading.Lock()  # pending is shared by the main and the worker thread
        self.device = Device()  # the engine binds its own (`bind_device`)

    def bind_device(self, device) -> None:
        """Declare the asynchronous reductions to `device` (the engine's device API), so the
        `cpu-checked` backend orders gloo's thread against the optimizer and the drains."""
        self.device = device

    def all_sum(self, value: float) -> float:
        """Sum of `value` over ranks (float64; blocking)."""
        if self.group is None:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def grads_final(self, group: ParamGroup) -> None:
        """Start reducing `group.grad` (summed) into its owner's accumulator; returns at once."""
        if self.group is None:
            return
        work = dist.reduce(group.grad, dst=self.owners[group.name], op=dist.ReduceOp.SUM,
                           group=self.group, async_op=True)
        # declared after the call (whose dispatch the checker logs on this thread): gloo's
        # thread reads and writes the accumulator from now until `wait`
        token = self.device.begin_async(reads=[group.grad], writes=[group.grad],
                                        what=f"gloo reduce of {group.name} gradient")
        with self._lock:
            self.pending[group.name] = (work, token)

    def wait(self, group: ParamGroup) -> None:
        """Block until `group`'s pending reduction (if any) is complete (sync point)."""
        with self._lock:
            pending = self.pending.pop(group.name, None)
        if pending is not None:
            work, token = pending
            work.wait()
            self.device.end_async(token)  # the waiter is ordered after gloo's thread

    def wait_all(self) -> None:
        for g in self.params.groups:
            self.wait(g)

    def global_grad_norm(self) -> float:
        """L2 norm of the global gradient (module docstring), after every reduction."""
        self.wait_all()
        sq = sum(float(torch.linalg.vector_norm(g.grad, dtype=torch.float32).double() ** 2)
                 for g in self.params.groups if self.owners[g.name] == self.rank)
        return math.sqrt(self.all_sum(sq))
