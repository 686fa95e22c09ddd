"""Per-block CPU AdamW on the flat host master buffers, run by one worker thread; LR schedule.

Owns the optimizer states (one `torch.optim.AdamW(fused=True)` per parameter group of
`models.host_params.HostParams`: AdamW is elementwise, so one flat tensor per block gives exactly
the per-parameter update), the order of updates (FIFO on one worker thread), the gradient
clipping scale, and the warmup + cosine learning-rate schedule.

`torch.optim.AdamW(fused=True)` runs on CPU tensors in torch 2.13 (checked at import by the
tests), so fused is used on every device.

Master precision (`train.master_dtype`):
- fp32: AdamW steps the group's fp32 master in place from its fp32 gradient (16 B/param:
  4 master + 4 grad + 8 moments).
- bf16 (MegaTrain's 12 B/param layout: 2 master + 2 grad + 8 moments): the moments stay fp32.
  An update upcasts the group's bf16 master and gradient into a shared fp32 scratch, steps
  AdamW there, and rounds the result back into the bf16 master (round to nearest even, `copy_`).
  The scratch is one [2, n] fp32 buffer (n = the largest group's elements; 8 B x n of host
  memory, independent of the model size) shared by every group: updates run one at a time on
  the worker thread. Each group's AdamW steps its own view of that storage, so each group's
  moments are its own. An update smaller than half a bf16 step of the weight (2^-9 to 2^-8 of
  its magnitude) is lost in the rounding, as in MegaTrain's layout; stochastic rounding and
  Kahan-style compensation are not done.

Parameters without a gradient: `torch.optim.AdamW` skips a parameter whose `.grad` is None, so
neither its weight (no weight decay) nor its moments change. Here a group is one flat tensor, so
the engine reports which of a group's parameters got a gradient in the step
(`note_gradients`); a parameter that got none on this rank and whose accumulated gradient is
exactly zero (the data-parallel reduction brought no other rank's either) has its weight and
its fp32 moments put back after the group's step: the same result as torch for a parameter
that never gets a gradient (an unused layer, expert or bias). The group's step count still
advances, so the bias correction of a parameter skipped in some steps and used in others
follows the group's count, not its own (torch counts per parameter). 8-bit groups restore
only the weight.

Groups whose block index is in the plan's `q8_blocks` use the 8-bit AdamW of
`runtime/optim8bit.py` instead (same update, moments block-wise quantized); `set_q8_blocks`
switches a group between the two between steps, carrying its moments over. 8-bit moments work
with both master dtypes: with bf16 masters the 8-bit AdamW steps the same fp32 scratch (6
B/param: 2 master + 2 grad + 2 moments, `lazytrain.contract.HOST_BYTES_PER_PARAM_Q8["bf16"]`).
"""

from __future__ import annotations

import math
from concurrent.futures import Future

import torch

from lazytrain.models.host_params import HostParams, ParamGroup
from lazytrain.runtime import optim8bit
from lazytrain.runtime.device import Device


Q8_KEY = "lazytrain_q8"
"""Key added to each group's saved optimizer state: True when its moments are 8-bit."""


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


def refit_note(*, step: int, old_total: int, new_total: int, base_lr: float,
               warmup_steps: int, schedule: str, min_lr_ratio: float) -> str | None:
    """The line saying that a resume with another `train.steps` re-fits the schedule to the
    new total (`lr_at`), with the LR of the next step under both totals; None when that LR is
    unchanged (same total, constant schedule, still in warmup).

    Args:
        step: steps completed at the checkpoint (the next step's 0-based index).
        old_total, new_total: `train.steps` of the checkpoint's run and of the resumed one.
        base_lr, warmup_steps, schedule, min_lr_ratio: as `lr_at`.
    """
    lrs = [lr_at(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total,
                 schedule=schedule, min_lr_ratio=min_lr_ratio) for total in (old_total, new_total)]
    if lrs[0] == lrs[1]:
        return None
    keep = (f"resume with train.steps={old_total} to keep the original schedule"
            if step < old_total else  # that total would train nothing more
            f"the original schedule ended at step {old_total} at lr {lrs[0]:.4g}; to go on "
            f"at that rate, set train.schedule=constant and train.lr={lrs[0]:.4g}")
    return (f"train.steps: {new_total}, the checkpoint's run had {old_total}: the {schedule} LR "
            f"schedule is re-fitted to {new_total} steps, so step {step + 1} trains at lr "
            f"{lrs[1]:.4g} instead of {lrs[0]:.4g} ({keep})")


class BlockOptimizer:
    """AdamW per group, stepped in submission order by a worker thread.

    Args:
        params: the host store; group k's `master` ([numel], fp32 or bf16) is updated in place
            from its `grad` (same shape and dtype). bf16 masters are stepped through the fp32
            scratch (module docstring); their moments are fp32.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (torch semantics).
        q8_blocks: block indices whose Adam moments are 8-bit (the plan's `q8_blocks`); the
            ends group always keeps fp32 moments.
        device: the device API: updates are submitted and waited for through it, so
            `cpu-checked` orders the worker's writes of the masters against the weight loads
            (default: the synchronous CPU backend).

    Raises:
        ImportError: `q8_blocks` is not empty and bitsandbytes is not installed.
        ValueError: a q8 block index outside 0..L-1.
    """

    def __init__(self, params: HostParams, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, q8_blocks=(), device: Device | None = None) -> None:
        self.params = params
        self.device = device or Device()
        self.hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.q8: set[str] = set()
        # bf16 masters only: [2, largest group] fp32, row 0 the weights and row 1 the gradient
        # of the group being updated (None for fp32 masters)
        self.scratch: torch.Tensor | None = None
        if any(g.master.dtype != torch.float32 for g in params.groups):
            self.scratch = torch.empty(2, max(g.numel for g in params.groups),
                                       dtype=torch.float32)
        # group name -> the fp32 [numel] tensor its optimizer steps, `.grad` bound: the master
        # itself (fp32) or the group's own view of the scratch (bf16)
        self.stepped: dict[str, torch.Tensor] = {g.name: self._stepped_tensor(g)
                                                 for g in params.groups}
        self.optims: dict[str, torch.optim.Optimizer] = {g.name: self._fp32(g)
                                                         for g in params.groups}
        self.worker = self.device.host_workers("adamw")
        self.refresh: dict[str, torch.Tensor] = {}
        """Group name -> its pinned compute-dtype copy (the pinned_copy weight path,
        `DeviceWeights.set_paths`), rewritten from the master in the job of each update."""
        self.futures: dict[str, Future] = {}
        # group name -> local names that got a gradient this step (`note_gradients`); groups
        # never reported (the ends) are stepped whole
        self.got_grad: dict[str, set[str]] = {}
        # group name -> local names to leave untouched by its queued update (set at submit)
        self.frozen: dict[str, frozenset[str]] = {}
        self.set_q8_blocks(q8_blocks)

    def bind_device(self, device: Device) -> None:
        """Submit and wait through `device` from now on (the engine binds its own), on a new
        worker of `device` (its thread count). Updates still queued are waited for through the
        old device first, so each job is waited for through the device that submitted it.

        Raises:
            Exception: a queued update failed (its error, re-raised).
        """
        self.wait_all()
        self.device = device
        old, self.worker = self.worker, device.host_workers("adamw")
        old.shutdown(wait=True)  # idle: every job it ran was waited for above

    def _stepped_tensor(self, g: ParamGroup) -> torch.Tensor:
        if g.master.dtype == torch.float32:
            g.master.grad = g.grad  # the accumulator *is* the .grad the optimizer reads
            return g.master
        # a new view object per group: torch keys optimizer state by tensor, so each group's
        # moments are its own although every view shares the scratch's storage
        p = self.scratch[0, :g.numel]
        p.grad = self.scratch[1, :g.numel]
        return p

    def _fp32(self, g: ParamGroup) -> torch.optim.Optimizer:
        return torch.optim.AdamW([self.stepped[g.name]], fused=True, **self.hyper)

    def _q8(self, g: ParamGroup):
        p = self.stepped[g.name]
        return optim8bit.adamw8bit(p, p.grad, **self.hyper)

    def set_q8_blocks(self, q8_blocks) -> None:
        """Make exactly the blocks in `q8_blocks` 8-bit (call between steps).

        A group that changes precision keeps its moments and step count: fp32 -> 8-bit
        quantizes them, 8-bit -> fp32 dequantizes them (the quantization error is the only
        change). Waits for every queued update first.

        Raises:
            ValueError: an index outside 0..L-1.
            ImportError: 8-bit wanted and bitsandbytes missing.
        """
        L = len(self.params.blocks)
        bad = [j for j in q8_blocks if not 0 <= j < L]
        if bad:
            raise ValueError(f"q8_blocks {bad} out of range for {L} blocks")
        want = {self.params.blocks[j].name for j in q8_blocks}
        if want == self.q8:
            return
        self.wait_all()
        for g in self.params.blocks:
            if (g.name in want) != (g.name in self.q8):
                self._convert(g, to_q8=g.name in want)

    def _convert(self, g: ParamGroup, *, to_q8: bool) -> None:
        old, lr = self.optims[g.name], self.optims[g.name].param_groups[0]["lr"]
        if to_q8:
            m, v, step = _fp32_moments(old, self.stepped[g.name])
            new = self._q8(g)
            optim8bit.load_q8_moments(new, m, v, step)
            self.q8.add(g.name)
        else:
            m, v, step = optim8bit.moments_from_q8(old)
            new = self._fp32(g)
            if step:
                new.state[self.stepped[g.name]] = {"step": torch.tensor(float(step)),
                                                   "exp_avg": m, "exp_avg_sq": v}
            self.q8.discard(g.name)
        for pg in new.param_groups:
            pg["lr"] = lr
        self.optims[g.name] = new

    def note_gradients(self, group: ParamGroup, grads: dict[str, torch.Tensor | None], *,
                       first: bool) -> None:
        """Record which of `group`'s parameters got a gradient in one micro-batch's backward.

        Args:
            group: the group.
            grads: local parameter name -> its gradient or None (autograd's allow_unused).
            first: the step's first micro-batch (forgets the previous step's record).
        """
        got = self.got_grad.setdefault(group.name, set())
        if first:
            got.clear()
        got.update(name for name, g in grads.items() if g is not None)

    def submit(self, group: ParamGroup, *, lr: float, grad_scale: float = 1.0) -> None:
        """Queue one group's update; it runs after every update queued before it.

        Args:
            group: the group to step (its gradient must be final).
            lr: learning rate of this update.
            grad_scale: factor applied to the gradient first (the clipping scale, <= 1).
        """
        self.frozen.pop(group.name, None)
        if group.name in self.got_grad:  # parameters without a gradient stay as they are
            missing = {sl.name for sl in group.slots} - self.got_grad[group.name]
            if missing:
                self.frozen[group.name] = frozenset(missing)
        self.futures[group.name] = self.device.submit(self.worker, self._update, group, lr,
                                                      grad_scale, channel="optimizer")

    def _update(self, group: ParamGroup, lr: float, grad_scale: float) -> None:
        """One group's AdamW step (worker thread). fp32 masters: in place, the accumulator
        itself is scaled. bf16 masters: master and gradient upcast into the scratch, the
        scaling and the step in fp32, the weights rounded back (the accumulator is unscaled)."""
        opt, p = self.optims[group.name], self.stepped[group.name]
        through_scratch = p is not group.master
        if through_scratch:  # the scratch is free: updates run one at a time on this thread
            p.copy_(group.master)
            p.grad.copy_(group.grad)
        if grad_scale != 1.0:
            p.grad.mul_(grad_scale)
        for pg in opt.param_groups:
            pg["lr"] = lr
        kept = self._untouched(group, opt, p)
        opt.step()
        for view, before in kept:
            view.copy_(before)
        if through_scratch:
            group.master.copy_(p)  # round to nearest even; no stochastic rounding
        copy = self.refresh.get(group.name)
        if copy is not None:  # the pinned_copy path's source, in the same job as the update
            copy.copy_(group.master)  # what the host conversion would load

    def _untouched(self, group: ParamGroup, opt: torch.optim.Optimizer, p: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(view, copy) of the weight and fp32 moments of each parameter the update must leave
        as it is: no gradient on this rank and an all-zero accumulated gradient (module
        docstring). Worker thread, before `opt.step()`."""
        names = self.frozen.pop(group.name, ())
        grads = group.views(p.grad)
        names = [n for n in names if not bool(grads[n].any())]
        if not names:
            return []
        tensors = [p]
        state = opt.state.get(p) or {}
        tensors += [state[k] for k in ("exp_avg", "exp_avg_sq")
                    if isinstance(state.get(k), torch.Tensor) and state[k].shape == p.shape]
        return [(view, view.clone()) for t in tensors
                for name, view in group.views(t).items() if name in names]

    def wait(self, group: ParamGroup) -> None:
        """Block until `group`'s queued update (if any) has finished; re-raises its error."""
        fut = self.futures.pop(group.name, None)
        if fut is not None:
            self.device.wait_futures([fut])  # the waiter is ordered after the update
            fut.result()

    def wait_all(self) -> None:
        for g in self.params.groups:
            self.wait(g)

    def state_dict(self) -> dict:
        """{group name: its optimizer's state_dict + `Q8_KEY`: True when its moments are 8-bit}."""
        self.wait_all()
        return {name: {**opt.state_dict(), Q8_KEY: name in self.q8}
                for name, opt in self.optims.items()}

    def load_state_dict(self, state: dict) -> None:
        """Load per-group states saved by `state_dict`, whatever precision each was saved in:
        a group saved in the other precision is loaded as saved and then converted back to
        its current precision. Groups missing from `state` are left as they are (a ZeRO-1
        shard holds only its owner's groups, `lazytrain.dist.sharding`)."""
        self.wait_all()
        groups = {g.name: g for g in self.params.groups}
        for name, sd in state.items():
            g, now_q8 = groups[name], name in self.q8
            saved_q8 = _is_q8_state(sd)
            if saved_q8 != now_q8:
                self._convert(g, to_q8=saved_q8)
            self.optims[name].load_state_dict({k: v for k, v in sd.items() if k != Q8_KEY})
            if saved_q8 != now_q8:
                self._convert(g, to_q8=now_q8)

    def close(self) -> None:
        self.wait_all()
        self.worker.shutdown(wait=True)


def _fp32_moments(opt: torch.optim.Optimizer, p: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(exp_avg, exp_avg_sq, step) of torch's AdamW on its fp32 parameter `p` [numel] (zeros
    and 0 before any step)."""
    st = opt.state.get(p) or {}
    if "exp_avg" not in st:
        return torch.zeros_like(p), torch.zeros_like(p), 0
    return st["exp_avg"], st["exp_avg_sq"], int(st["step"])


def _is_q8_state(sd: dict) -> bool:
    """True for a group state saved with 8-bit moments (`Q8_KEY`; without it: no torch AdamW
    `exp_avg` in a non-empty state)."""
    if Q8_KEY in sd:
        return bool(sd[Q8_KEY])
    states = list(sd.get("state", {}).values())
    return bool(states) and not any("exp_avg" in st for st in states)


def global_grad_norm(params: HostParams) -> float:
    """L2 norm over every accumulated gradient (tied weights counted once), as
    `torch.nn.utils.clip_grad_norm_` computes it; bf16 gradients are reduced in fp32."""
    sq = sum(float(torch.linalg.vector_norm(g.grad, dtype=torch.float32).double() ** 2)
             for g in params.groups)
    return math.sqrt(sq)


def clip_scale(total_norm: float, max_norm: float) -> float:
    """torch's clip coefficient: min(1, max_norm / (total_norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))
