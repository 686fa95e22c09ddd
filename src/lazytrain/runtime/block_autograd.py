"""A block under autograd: its parameters as leaves over the flat device weights, its gradient
packed back into the flat layout, and the RNG replay that gives a recompute or re-forward the
dropout masks of the forward.

Owns these three pieces of one block's forward-with-autograd and backward; the engine decides
when they run (kept blocks in forward, re-forward in backward, recompute). Knows nothing about
plans, tiers or windows.

Dropout: the RNG state (CPU and, on CUDA, the device generator) is saved before each block's
forward (`rng_state`) and replayed in a forked RNG (`replay_rng`) by the recompute and the
re-forward, so both see the same masks as the forward, and the global RNG advances exactly as
in a plain forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from lazytrain.models.host_params import ParamGroup


def grad_leaves(group: ParamGroup, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's parameters as separate autograd leaves viewing `flat` [group.numel] (no
    copy), in the group's parameter order.

    One leaf per parameter, not one flat leaf: the backward of a view of a flat leaf
    materialises a zero-filled, flat-sized gradient per parameter and sums them, which cost
    ~25% of a CPU step in benchmarks/engine_cpu.py.
    """
    views = group.views(flat.detach())
    return {name: v.requires_grad_() for name, v in views.items()}


def flat_grad(group: ParamGroup, leaves: dict[str, torch.Tensor],
              grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The per-parameter gradients `grads` (in the order of `leaves`) packed into the block's
    flat layout [group.numel], dtype and device of the leaves; a parameter without a gradient
    (an unused expert, an unused bias) gets zeros, never a neighbour's values."""
    first = next(iter(leaves.values()))
    flat = torch.zeros(group.numel, dtype=first.dtype, device=first.device)
    views = group.views(flat)
    for name, g in zip(leaves, grads):
        if g is not None:
            views[name].copy_(g)
    return flat


def rng_state(device: torch.device, *, is_cuda: bool) -> tuple:
    """(CPU RNG state, the CUDA generator's state of `device` or None off CUDA), taken before a
    block's forward."""
    cuda = torch.cuda.get_rng_state(device) if is_cuda else None
    return torch.get_rng_state(), cuda


@contextmanager
def replay_rng(state: tuple, device: torch.device, *, is_cuda: bool):
    """Run the body with the RNG as `state` (from `rng_state`) recorded it; the RNG outside is
    restored afterwards (a forked RNG)."""
    with torch.random.fork_rng(devices=[device] if is_cuda else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
