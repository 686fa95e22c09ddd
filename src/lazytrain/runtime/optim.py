"""Per-block CPU AdamW on the flat fp32 master buffers, run by one worker thread; LR schedule.

Owns the optimizer states (one `torch.optim.AdamW(fused=True)` per parameter group of
`runtime.params.HostParams`: AdamW is elementwise, so one flat tensor per block gives exactly
the per-parameter update), the order of updates (FIFO on one worker thread), the gradient
clipping scale, and the warmup + cosine learning-rate schedule.

`torch.optim.AdamW(fused=True)` runs on CPU tensors in torch 2.13 (checked at import by the
tests), so fused is used on every device.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lazytrain.runtime.params import HostParams, ParamGroup


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine", min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine or constant.

    Warmup: lr = base_lr * (step + 1) / warmup_steps for step < warmup_steps.
    Cosine: lr = min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * p)),
    p = (step - warmup_steps) / max(1, total_steps - warmup_steps), clamped to [0, 1].

    Raises:
        ValueError: unknown schedule.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule != "cosine":
        raise ValueError(f"train.schedule: unknown value {schedule!r}; use cosine or constant")
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    min_lr = base_lr * min_lr_ratio
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


class BlockOptimizer:
    """AdamW per group, stepped in submission order by a worker thread.

    Args:
        params: the host store; group k's `master` is updated in place from its `grad`.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (torch semantics).
    """

    def __init__(self, params: HostParams, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        self.params = params
        self.optims: dict[str, torch.optim.AdamW] = {}
        for g in params.groups:
            g.master.grad = g.grad  # the accumulator *is* the .grad the optimizer reads
            self.optims[g.name] = torch.optim.AdamW([g.master], lr=lr, betas=betas, eps=eps,
                                                    weight_decay=weight_decay, fused=True)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-adamw")
        self.futures: dict[str, Future] = {}

    def submit(self, group: ParamGroup, *, lr: float, grad_scale: float = 1.0) -> None:
        """Queue one group's update; it runs after every update queued before it."""
        self.futures[group.name] = self.worker.submit(self._update, group, lr, grad_scale)

    def _update(self, group: ParamGroup, lr: float, grad_scale: float) -> None:
        opt = self.optims[group.name]
        if grad_scale != 1.0:
            group.grad.mul_(grad_scale)
        for pg in opt.param_groups:
            pg["lr"] = lr
        opt.step()

    def wait(self, group: ParamGroup) -> None:
        """Block until `group`'s queued update (if any) has finished; re-raises its error."""
        fut = self.futures.pop(group.name, None)
        if fut is not None:
            fut.result()

    def wait_all(self) -> None:
        for g in self.params.groups:
            self.wait(g)

    def state_dict(self) -> dict:
        self.wait_all()
        return {name: opt.state_dict() for name, opt in self.optims.items()}

    def load_state_dict(self, state: dict) -> None:
        self.wait_all()
        for name, opt in self.optims.items():
            opt.load_state_dict(state[name])

    def close(self) -> None:
        self.wait_all()
        self.worker.shutdown(wait=True)


def global_grad_norm(params: HostParams) -> float:
    """L2 norm over every accumulated gradient (tied weights counted once), as
    `torch.nn.utils.clip_grad_norm_` computes it."""
    sq = sum(float(torch.linalg.vector_norm(g.grad).double() ** 2) for g in params.groups)
    return math.sqrt(sq)


def clip_scale(total_norm: float, max_norm: float) -> float:
    """torch's clip coefficient: min(1, max_norm / (total_norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))
