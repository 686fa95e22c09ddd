"""Host parameter store: master weights and gradient accumulators, one flat region per group.

Owns the host copy of every trainable weight. A *group* is one transformer block, or the
"ends" (embedding, final norm, untied LM head). Each group has one contiguous master buffer
and one contiguous gradient buffer, both in the master dtype (`train.master_dtype`: fp32, or
bf16 for MegaTrain's 12 B/param layout, whose fp32 Adam moments live in `runtime/optim.py`);
the parameters are views into them, so the optimizer runs over one flat tensor per block and a
block's gradient arrives as one flat copy.
Parameters that received no gradient in a step hold zeros in their slice of the flat gradient
(the flat layout makes "shifted" gradients impossible: offsets are fixed at construction).

Lives in `models` because the adapters build it from a model's parameters (`adapter.py`,
`hf_loader.py`); the runtime (optimizer, weight streams), `dist` (gradient reduction, shared
masters) and the profiler read it. The H2D staging buffers it feeds live with the weight
streams (`runtime/streams.py`).

Knows nothing about plans, tiers, devices or model families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""train.master_dtype -> dtype of the host masters and gradient accumulators. fp32: 4 + 4 B per
parameter; bf16: 2 + 2 B (MegaTrain's layout; the optimizer keeps fp32 moments either way)."""


def check_master_dtype(master_dtype: str) -> torch.dtype:
    """Map `train.master_dtype` to a torch dtype.

    Raises:
        ValueError: not a key of `MASTER_DTYPES`.
    """
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"train.master_dtype: unknown value {master_dtype!r}; "
                         f"use one of {sorted(MASTER_DTYPES)}")
    return MASTER_DTYPES[master_dtype]


@dataclass(kw_only=True, frozen=True, slots=True)
class Slot:
    """Where one parameter lives inside its group's flat buffer."""

    name: str
    """Local name inside the group (e.g. "self_attn.q_proj.weight")."""
    shape: tuple[int, ...]
    offset: int
    """Element offset in the flat buffer."""
    numel: int


class ParamGroup:
    """One block's (or the ends') flat master and gradient buffers, both [numel] of `dtype`.

    Args:
        name: "block3" or "ends".
        prefix: HF name prefix of the group's parameters ("model.layers.3." or "").
        shapes: local parameter name -> shape, in module order.
        dtype: master dtype (torch.float32 or torch.bfloat16), also the gradient's.
        master: [numel] buffer to use as the master (a slice of a node-shared mapping);
            None: a private zeroed buffer.

    Raises:
        ValueError: `master` has another size or dtype than the layout.
    """

    def __init__(self, name: str, prefix: str, shapes: dict[str, tuple[int, ...]], *,
                 dtype: torch.dtype = torch.float32, master: torch.Tensor | None = None) -> None:
        self.name = name
        self.prefix = prefix
        slots, offset = [], 0
        for local, shape in shapes.items():
            numel = math.prod(shape)
            slots.append(Slot(name=local, shape=tuple(shape), offset=offset, numel=numel))
            offset += numel
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.numel = offset
        if master is not None and (master.numel() != offset or master.dtype != dtype):
            raise ValueError(f"{name}: master buffer has {master.numel()} {master.dtype} "
                             f"elements; the layout needs {offset} {dtype}")
        self.master = torch.zeros(offset, dtype=dtype) if master is None else master
        self.grad = torch.zeros(offset, dtype=dtype)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Local name -> view of `flat` (any buffer with this group's layout) in its shape."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}

    @property
    def master_views(self) -> dict[str, torch.Tensor]:
        return self.views(self.master)

    @property
    def grad_views(self) -> dict[str, torch.Tensor]:
        return self.views(self.grad)

    def accumulate_grad(self, flat_grad: torch.Tensor | None, *, first: bool,
                        start: int = 0) -> None:
        """Add one backward's flat gradient (host, fp32 or compute dtype) into the accumulator.

        A bf16 accumulator rounds to nearest once per contribution: `add_` computes the sum
        in fp32 (type promotion) and rounds the result, so gradient accumulation over
        micro-batches rounds once per micro-batch (MegaTrain's bf16 gradient layout).

        Args:
            flat_grad: [n] gradient of elements start..start+n of the group (the whole group by
                default), or None when no parameter of the group was used (the accumulator
                then gets zeros).
            first: True for the first contribution of the step: overwrite instead of add.
            start: element offset of `flat_grad` in the group (chunked drains).
        """
        if flat_grad is None:
            if first:
                self.grad.zero_()
            return
        target = self.grad[start:start + flat_grad.numel()]
        if first:
            target.copy_(flat_grad)
        else:
            target.add_(flat_grad)


class HostParams:
    """All groups of one model: `blocks[j]` and `ends`.

    Masters come from `masters`, when given: one flat buffer for every group (blocks in order,
    then the ends) that the caller allocates, e.g. a shared-memory mapping every rank of a node
    maps (`lazytrain.dist.shared_masters`). `fills_masters` then says whether this process
    writes the initial weights into it (the loaders skip the copy when it is False: another
    process of the node writes the same bytes once).

    Args:
        block_shapes: per block, local name -> shape.
        block_prefixes: per block, HF name prefix.
        ends_shapes: HF name -> shape of the embedding, final norm and untied head.
        master_dtype: "fp32" or "bf16" (`MASTER_DTYPES`): dtype of masters and gradients.
        masters: callable (total elements, dtype) -> [total] tensor holding every master;
            None: private per-group buffers.
        fills_masters: False when another process writes the initial masters.

    Raises:
        ValueError: `masters` returned a tensor of another size or dtype; unknown
            `master_dtype`.
    """

    def __init__(self, block_shapes: list[dict[str, tuple[int, ...]]], block_prefixes: list[str],
                 ends_shapes: dict[str, tuple[int, ...]], *, master_dtype: str = "fp32",
                 masters=None, fills_masters: bool = True) -> None:
        dtype = check_master_dtype(master_dtype)
        layouts = [(f"block{j}", p, s) for j, (s, p) in enumerate(zip(block_shapes,
                                                                       block_prefixes))]
        layouts.append(("ends", "", ends_shapes))
        flats = [None] * len(layouts)
        if masters is not None:
            sizes = [sum(math.prod(shape) for shape in s.values()) for _, _, s in layouts]
            flat = masters(sum(sizes), dtype)
            if flat.numel() != sum(sizes) or flat.dtype != dtype:
                raise ValueError(f"shared master buffer has {flat.numel()} {flat.dtype} "
                                 f"elements; the model needs {sum(sizes)} {dtype}")
            flats = list(torch.split(flat, sizes))
        groups = [ParamGroup(name, p, s, dtype=dtype, master=m)
                  for (name, p, s), m in zip(layouts, flats)]
        self.blocks, self.ends = groups[:-1], groups[-1]
        self.fills_masters = fills_masters

    @property
    def groups(self) -> list[ParamGroup]:
        return [*self.blocks, self.ends]

    def named_master(self) -> dict[str, torch.Tensor]:
        """HF name -> master view in the master dtype (every trainable parameter once; tied
        head omitted)."""
        return {g.prefix + n: t for g in self.groups for n, t in g.master_views.items()}

    def named_grads(self) -> dict[str, torch.Tensor]:
        """HF name -> accumulated gradient view in the master dtype."""
        return {g.prefix + n: t for g in self.groups for n, t in g.grad_views.items()}

    def locate(self, hf_name: str) -> tuple[ParamGroup, str]:
        """The group and local name holding HF parameter `hf_name`.

        Raises:
            KeyError: not a parameter of this store.
        """
        for g in self.blocks:
            if g.prefix and hf_name.startswith(g.prefix):
                local = hf_name[len(g.prefix):]
                if any(s.name == local for s in g.slots):
                    return g, local
        if any(s.name == hf_name for s in self.ends.slots):
            return self.ends, hf_name
        raise KeyError(f"{hf_name!r} is not a parameter of this model")

    def max_block_numel(self) -> int:
        return max(g.numel for g in self.blocks)

    def total_numel(self) -> int:
        return sum(g.numel for g in self.groups)
