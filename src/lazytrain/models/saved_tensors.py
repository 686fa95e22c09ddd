"""Save levels L1 and L2: one block's forward keeps (part of) what autograd saves, so that the
block's backward `b{j}` re-forwards less (L1) or nothing (L2) (docs/execution_model.md, "Save
levels").

Owns the saved-tensor hooks of such a forward (`forward_saving`), the bytes they keep
(`SavedInternals.storages`, `nbytes`) and the backward that reads them (`backward_saved`). The
forward runs the block with autograd under `torch.autograd.graph.saved_tensors_hooks`; the pack
hook places every tensor autograd saves:

    on the block's flat weights `flat`         -> a weight reference (byte offset in `flat`,
                                                  dtype, size, stride); unpacked on the weights
                                                  loaded for the backward, `flat_b`
    on the block input `x` (boundary j)        -> an input reference, unpacked on the boundary
                                                  as stored for the backward
    on a tensor of the block's `kwargs`        -> a kwargs reference (rotary tables, masks: the
                                                  engine holds them for the whole step)
    anything else                              -> kept: one uint8 view of its whole storage per
                                                  distinct storage (`storages`, the bytes to
                                                  move) plus the view's geometry

L2 keeps everything and its graph root is the block output. L1 keeps what is saved up to and
including the token mixer (the layer's `self_attn` or `linear_attn`: the input norm and the
attention or linear attention) and the mixer's output tensor; once the mixer has returned, the
pack hook returns a drop marker (those tensors are never unpacked and the rest of the graph is
freed when the forward returns). Its backward re-forwards the block from `x`, truncated
(models/truncate.py), with the mixer replaced by a stand-in that returns the saved output as a
fresh leaf, then back-propagates that leaf's gradient through the kept mixer graph.

The graph holds no tensor of the caller: the block runs on aliases of `x` and of the weights
made by one autograd function (`_Entry`) whose backward hands their gradients to a sink, and
each root (block output, mixer output, router logits) is a zero-stride stand-in (`_Root`) over
the real tensor. So the boundary and the weight slot can be offloaded or reused after the
forward; only `storages` (and the few bytes of the stand-ins) stay.

Dropout: L2 re-runs nothing. L1's stand-in sets the RNG to its state right after the forward's
mixer returned, inside a forked RNG, so the part of the block after the mixer draws the
forward's masks and the caller's RNG is left as it was; no `replay_rng` is needed (nothing
before the mixer draws random numbers in the listed families).

Knows nothing about plans, tiers, windows or the engine: the engine decides where `storages`
live between the forward and the backward (`replace_storages`).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

LEVELS = ("L1", "L2")
"""Save levels this module runs (L0, nothing beyond the boundary, is the engine's re-forward)."""

TOKEN_MIXERS = ("self_attn", "linear_attn")
"""Attribute names of a decoder layer's token mixer: softmax attention (every listed family)
or Qwen3-Next's / Qwen3.5's Gated DeltaNet linear attention."""


def token_mixer(layer: nn.Module, *, family: str) -> nn.Module:
    """The token mixer of one decoder layer (`TOKEN_MIXERS`), the module whose output ends L1.

    Raises:
        ValueError: the layer has none or more than one; names the family.
    """
    found = [m for name in TOKEN_MIXERS if isinstance(m := getattr(layer, name, None), nn.Module)]
    if len(found) != 1:
        raise ValueError(f"{family}: decoder layer {type(layer).__name__} has "
                         f"{len(found)} token mixers among {TOKEN_MIXERS} (need exactly one); "
                         f"save level L1 is unavailable for this family, use L2 or L0")
    return found[0]


@dataclass(frozen=True, slots=True)
class _View:
    """Geometry of a saved tensor over some storage: byte offset from the start of its base
    (a reference) or of its kept storage, and what `torch.Tensor.set_` needs."""

    offset_bytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    conj: bool
    neg: bool


@dataclass(frozen=True, slots=True)
class _Ref:
    source: int  # 0: flat weights, 1: block input, 2...: the kwargs tensors in walk order
    view: _View


@dataclass(frozen=True, slots=True)
class _Kept:
    storage: int  # index into SavedInternals.storages
    view: _View


class _Dropped:
    """What the pack hook returns at L1 after the token mixer: never unpacked."""


_DROPPED = _Dropped()


class _Sink:
    """Receives the gradients `_Entry.backward` is given (None before it runs)."""

    grads: tuple[torch.Tensor | None, ...] | None = None


class _Entry(torch.autograd.Function):
    """(anchor, sink, *tensors) -> aliases of `tensors` that require grad; backward stores the
    aliases' gradients in `sink` (None for an alias no kept node used) and gives the empty
    anchor none. The graph reaches the caller's tensors through this node only, which saves
    nothing, so it holds neither the boundary nor the weights."""

    @staticmethod
    def forward(ctx, anchor, sink, *tensors):
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.sink.grads = grads
        return (None, None, *(None for _ in grads))


class _Root(torch.autograd.Function):
    """t -> a tensor of t's shape over one element of storage (zero stride; its value is never
    read) whose gradient is passed to t unchanged: a graph root that does not hold t's
    storage."""

    @staticmethod
    def forward(ctx, t):
        return t.new_empty(()).expand(t.shape)

    @staticmethod
    def backward(ctx, g):
        return g


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors of a kwargs tree (dicts, tuples, lists), depth first in insertion order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte) that `t` reads in its storage."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _view_of(t: torch.Tensor, offset_bytes: int) -> _View:
    return _View(offset_bytes, t.dtype, tuple(t.shape), tuple(t.stride()), t.is_conj(),
                 t.is_neg())


def _materialize(storage: torch.UntypedStorage, start_bytes: int, v: _View) -> torch.Tensor:
    """The tensor `v` describes, over `storage` from byte `start_bytes` on (no copy)."""
    itemsize = torch.empty((), dtype=v.dtype).element_size()
    if start_bytes % itemsize:
        raise ValueError(f"saved tensor of {v.dtype} starts at byte {start_bytes}, not a "
                         f"multiple of {itemsize}: replacement storages must keep the "
                         f"originals' alignment")
    out = torch.empty(0, dtype=v.dtype, device=storage.device)
    out.set_(storage, start_bytes // itemsize, v.size, v.stride)
    out = out.conj() if v.conj else out
    return torch._neg_view(out) if v.neg else out


@dataclass(frozen=True, slots=True)
class _BaseShape:
    """What a reference base must match at backward time (dtype, shape, stride)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(name: str, t: torch.Tensor) -> _BaseShape:
        return _BaseShape(name, t.dtype, tuple(t.shape), tuple(t.stride()))

    def check(self, t: torch.Tensor) -> None:
        if (t.dtype, tuple(t.shape), tuple(t.stride())) != (self.dtype, self.shape, self.stride):
            raise ValueError(f"backward_saved: {self.name} is {t.dtype} {tuple(t.shape)} "
                             f"stride {tuple(t.stride())}, the forward's was {self.dtype} "
                             f"{self.shape} stride {self.stride}; pass the tensor with the "
                             f"forward's layout")


class SavedInternals:
    """What one block's L1/L2 forward keeps for its backward.

    Attributes:
        level: "L1" or "L2".
        storages: the kept storages, one uint8 1-D tensor per distinct storage (its whole
            bytes): what the engine moves to DRAM and back (`replace_storages`).
        nbytes: sum of the storages' bytes (S1 or S2 of the block; excludes the block input,
            weights and kwargs, which are references).
        dropped: tensors the L1 forward saved after its token mixer and dropped (0 at L2).
        host_held: tensors saved on another device than the block input (e.g. a CPU scalar in
            a CUDA block), held as they are: neither moved nor counted.
    """

    def __init__(self, level: str) -> None:
        self.level = level
        self.storages: list[torch.Tensor] = []
        self.nbytes = 0
        self.dropped = 0
        self.host_held: list[torch.Tensor] = []
        self._bases: list[torch.Tensor] | None = None  # bound only while unpacking
        self._spans: list[tuple] = []  # per base (address, device, first byte, end byte)
        self._index: dict[tuple[int, int], int] = {}  # (address, bytes) -> storages index
        self._dropping = False  # L1: the token mixer has returned
        self._base_shapes: list[_BaseShape] = []
        self._anchor: torch.Tensor | None = None
        self._sink = _Sink()
        self._root: torch.Tensor | None = None  # L2: block output; L1: mixer output
        self._mixer_out: _Kept | _Ref | None = None  # L1: the mixer output's value
        self._mixer_arity: int | None = None  # L1: tuple length the mixer returned, or None
        self._rng_after: tuple | None = None  # L1: (CPU, CUDA or None) RNG after the mixer
        self._logit_roots: list[torch.Tensor] | None = None  # L2: router logits' roots
        self._logit_values: list[_Kept | _Ref] | None = None

    def replace_storages(self, storages: list[torch.Tensor]) -> None:
        """Use `storages` (copies of `self.storages`, e.g. from DRAM and back) from now on.

        Args:
            storages: one uint8 1-D tensor per kept storage, in order, each with the original's
                bytes; may be a view into a larger buffer (a pinned pool) starting at an offset
                that keeps 16-byte alignment.

        Raises:
            ValueError: another count, dtype, shape, or a misaligned start; names the index.
        """
        if len(storages) != len(self.storages):
            raise ValueError(f"replace_storages: got {len(storages)} storages, the forward "
                             f"kept {len(self.storages)}")
        for i, (new, old) in enumerate(zip(storages, self.storages)):
            if new.dtype != torch.uint8 or new.dim() != 1 or new.numel() != old.numel():
                raise ValueError(f"replace_storages: storages[{i}] is {new.dtype} "
                                 f"{tuple(new.shape)}; it must be uint8 ({old.numel()},)")
            if new.storage_offset() % 16:
                raise ValueError(f"replace_storages: storages[{i}] starts at byte "
                                 f"{new.storage_offset()} of its buffer; use a 16-byte aligned "
                                 f"offset")
        self.storages = list(storages)

    # --- hooks -------------------------------------------------------------------------------

    def _place(self, t: torch.Tensor) -> _Ref | _Kept | torch.Tensor:
        """A reference when `t` lies inside a base (weights, input, kwargs), else `t`'s storage
        kept once (dedup by storage address; a kept storage stays alive, so its address is
        not reused during the forward)."""
        if t.layout != torch.strided or type(t) not in (torch.Tensor, nn.Parameter):
            raise TypeError(f"saved tensor of type {type(t).__name__}, layout {t.layout}: "
                            f"save levels keep plain strided tensors only; use L0")
        storage, (lo, hi) = t.untyped_storage(), _byte_span(t)
        address = storage.data_ptr()
        for i, (b_address, b_device, b_lo, b_hi) in enumerate(self._spans):
            if address == b_address and t.device == b_device and b_lo <= lo and hi <= b_hi:
                return _Ref(i, _view_of(t, lo - b_lo))
        if t.device != self._spans[1][1]:
            self.host_held.append(t)
            return t
        key = (address, storage.nbytes())
        index = self._index.get(key) if storage.nbytes() else None
        if index is None:
            index = len(self.storages)
            self._index[key] = index
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        return _Kept(index, _view_of(t, lo))

    def _pack(self, t: torch.Tensor):
        if self._dropping:
            self.dropped += 1
            return _DROPPED
        return self._place(t)

    def _unpack(self, packed) -> torch.Tensor:
        if packed is _DROPPED:
            raise RuntimeError("a tensor dropped at save level L1 (saved after the token "
                               "mixer) was unpacked: the L1 backward must re-forward that part")
        if isinstance(packed, torch.Tensor):
            return packed
        if self._bases is None:
            raise RuntimeError("saved internals unpacked outside backward_saved")
        if isinstance(packed, _Ref):
            base = self._bases[packed.source]
            start = base.storage_offset() * base.element_size()
            return _materialize(base.untyped_storage(), start + packed.view.offset_bytes,
                                packed.view)
        kept = self.storages[packed.storage]
        start = kept.storage_offset() + packed.view.offset_bytes
        return _materialize(kept.untyped_storage(), start, packed.view)

    def _bind(self, flat: torch.Tensor, x: torch.Tensor, kwargs: dict) -> None:
        """Set the bases the references resolve against (checked against the forward's)."""
        bases = [flat, x, *_tensors(kwargs)]
        if len(bases) != len(self._base_shapes):
            raise ValueError(f"backward_saved: kwargs hold {len(bases) - 2} tensors, the "
                             f"forward's held {len(self._base_shapes) - 2}; pass the block's "
                             f"kwargs of the same micro-batch")
        for shape, base in zip(self._base_shapes, bases):
            shape.check(base)
        device = x.device
        for i, s in enumerate(self.storages):
            if s.device != device:
                raise ValueError(f"backward_saved: storages[{i}] is on {s.device}, the block "
                                 f"input on {device}; copy it back (replace_storages) first")
        self._bases = bases

    def release(self) -> None:
        """Drop the kept graph and storages (`backward_saved` does it at its end; a failed step
        whose backward never ran must do it too: the graph's hooks refer back to this object,
        so without it the storages, which may be views of a pooled host buffer, stay alive
        until Python's cycle collector runs)."""
        self._release()

    def _release(self) -> None:
        self._bases = self._anchor = self._root = None
        self._logit_roots = self._logit_values = self._mixer_out = None
        self.storages, self.host_held, self._sink = [], [], _Sink()


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def forward_saving(adapter, j: int, x: torch.Tensor, leaves: dict[str, torch.Tensor],
                   flat: torch.Tensor, kwargs: dict, *, level: str,
                   router_logits: list | None = None
                   ) -> tuple[torch.Tensor, SavedInternals]:
    """Block j's forward with autograd (enabled here: the caller may run under no_grad),
    keeping the internals of save level `level`.

    Args:
        adapter: the `ModelAdapter` (its `forward_block` runs the block).
        j: block index.
        x: [B, S, H] the block input (boundary j), on the compute device.
        leaves: local parameter name -> view of `flat` (`runtime.block_autograd.grad_leaves`);
            only their values and names are used (the graph holds none of them).
        flat: [numel] the block's flat weights on the device.
        kwargs: the block's forward kwargs (`adapter.block_kwargs`), held by the caller until
            the backward.
        level: "L1" or "L2".
        router_logits: when a list, the forward's router logits [B*S, E] each (detached) are
            appended, for `RouterAux.observe`; at L2 their graph is kept for the aux term.

    Returns:
        (the block output [B, S, H], detached; the `SavedInternals`).

    Raises:
        ValueError: unknown level; a leaf that is not a view of `flat`; L1 on a layer without
            one token mixer (`token_mixer`).
        RuntimeError: L1 and the token mixer did not run.
        TypeError: autograd saved a tensor that is not a plain strided one.
    """
    if level not in LEVELS:
        raise ValueError(f"save level {level!r}: forward_saving runs {LEVELS}; L0 keeps "
                         f"nothing (the engine's re-forward)")
    mixer = token_mixer(adapter.blocks[j], family=adapter.config.model_type) \
        if level == "L1" else None
    flat_span = _byte_span(flat)
    for name, leaf in leaves.items():
        lo, hi = _byte_span(leaf)
        if (leaf.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
                or lo < flat_span[0] or hi > flat_span[1]):
            raise ValueError(f"leaves[{name!r}] is not a view of flat; pass "
                             f"grad_leaves(group, flat)")
    saved = SavedInternals(level)
    bases = [flat, x, *_tensors(kwargs)]
    saved._spans = [(b.untyped_storage().data_ptr(), b.device, *_byte_span(b)) for b in bases]
    saved._base_shapes = [_BaseShape.of("flat", flat), _BaseShape.of("x", x),
                          *(_BaseShape.of(f"kwargs tensor {i}", t)
                            for i, t in enumerate(bases[2:]))]
    logits = [] if router_logits is not None else None
    saved._anchor = torch.empty(0, device=x.device, requires_grad=True)  # no kernel

    def mixer_returned(_module, _args, output):
        t = output[0] if isinstance(output, tuple) else output
        saved._mixer_arity = len(output) if isinstance(output, tuple) else None
        saved._mixer_out = saved._place(t)
        saved._root = _Root.apply(t)
        saved._rng_after = _rng_state(x.device)
        saved._dropping = True

    hook = mixer.register_forward_hook(mixer_returned) if mixer is not None else None
    try:
        with torch.enable_grad(), saved_tensors_hooks(saved._pack, saved._unpack):
            x_in, *ws = _Entry.apply(saved._anchor, saved._sink, x.detach(),
                                     *(w.detach() for w in leaves.values()))
            out = adapter.forward_block(j, x_in, dict(zip(leaves, ws)), kwargs,
                                        router_logits=logits)
            if level == "L2":
                saved._root = _Root.apply(out)
            if level == "L2" and logits is not None:  # the aux gradient enters through them
                saved._logit_roots = [_Root.apply(lg) for lg in logits]
                saved._logit_values = [saved._place(lg) for lg in logits]
    finally:
        if hook is not None:
            hook.remove()
        saved._spans, saved._index, saved._dropping = [], {}, False
    if level == "L1" and saved._root is None:
        raise RuntimeError(f"block {j}: its token mixer {type(mixer).__name__} did not run in "
                           f"the forward; save level L1 cannot split this layer")
    if router_logits is not None:
        router_logits.extend(lg.detach() for lg in logits)
    saved.nbytes = sum(s.numel() for s in saved.storages)
    return out.detach(), saved


@contextmanager
def _mixer_stand_in(mixer: nn.Module, out: torch.Tensor, arity: int | None, rng_after: tuple):
    """Inside the body the mixer returns `out` (in a tuple of `arity` with None for the rest,
    e.g. the attention weights, which the layers discard) and sets the RNG to the forward's
    state after the mixer; restored after."""

    def forward(self, *args, **kwargs):
        torch.set_rng_state(rng_after[0])
        if rng_after[1] is not None:
            torch.cuda.set_rng_state(rng_after[1], out.device)
        return out if arity is None else (out, *(None for _ in range(arity - 1)))

    mixer.forward = types.MethodType(forward, mixer)
    try:
        yield
    finally:
        del mixer.forward


def backward_saved(adapter, j: int, saved: SavedInternals, x: torch.Tensor,
                   leaves_b: dict[str, torch.Tensor], flat_b: torch.Tensor, kwargs: dict,
                   grad_out: torch.Tensor, *, aux=None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Block j's backward from its saved internals; `saved` is released afterwards.

    L2: back-propagates `grad_out` (plus the router aux term) through the kept graph. L1:
    re-forwards the block from `x`, truncated, with the token mixer replaced by a stand-in
    returning the saved mixer output as a leaf; back-propagates `grad_out` (plus the aux term
    of the re-forward's router logits) through it, then the stand-in leaf's gradient through
    the kept mixer graph, and sums both contributions per parameter and for the input.

    Args:
        adapter, j: as for `forward_saving`.
        saved: `forward_saving`'s internals, storages on the device of `x`.
        x: [B, S, H] boundary j as stored for the backward (the forward's layout).
        leaves_b: local name -> view of `flat_b` requiring grad (`grad_leaves(group, flat_b)`):
            the re-forward's weights at L1, the names of the result at both levels.
        flat_b: [numel] the block weights loaded for the backward (the forward's values).
        kwargs: the block's kwargs of the same micro-batch (the forward's layout).
        grad_out: [B, S, H] gradient of the block output.
        aux: the micro-batch's `RouterAux` when the router aux loss is on (its counts taken in
            the forward), else None; adds `aux.block_term(logits)` to the block's loss.

    Returns:
        (gradient of x [B, S, H]; local name -> gradient in the shape of the parameter, or None
        for a parameter no path used).

    Raises:
        ValueError: `x`, `flat_b` or the kwargs tensors differ in dtype, shape or stride from
            the forward's; a storage not on x's device; aux at L2 without the forward's logits.
    """
    saved._bind(flat_b, x, kwargs)
    try:
        if saved.level == "L2":
            return _backward_l2(saved, leaves_b, grad_out, aux=aux)
        return _backward_l1(adapter, j, saved, x, leaves_b, kwargs, grad_out, aux=aux)
    finally:
        saved._release()


def _kept_graph_grads(saved: SavedInternals, roots: list, grads: list, *,
                      num_weights: int) -> tuple:
    """Gradients of the forward's input and of its `num_weights` weights (None each when
    unused) from `grads` of the kept `roots`, through the sink of `_Entry`."""
    torch.autograd.grad(roots, [saved._anchor], grads, allow_unused=True)
    return saved._sink.grads or (None,) * (1 + num_weights)


def _backward_l2(saved, leaves_b, grad_out, *, aux):
    roots, grads = [saved._root], [grad_out]
    if aux is not None:
        if saved._logit_values is None:
            raise ValueError("backward_saved: aux given, but forward_saving ran without "
                             "router_logits; pass a list to it when the aux loss is on")
        values = [saved._unpack(v).detach().requires_grad_() for v in saved._logit_values]
        term = aux.block_term(values)
        if term is not None:  # block j's exact share of d(coef * aux) (models/router_aux.py)
            roots += saved._logit_roots
            grads += torch.autograd.grad(term, values)
    grad_x, *grad_w = _kept_graph_grads(saved, roots, grads, num_weights=len(leaves_b))
    return grad_x, dict(zip(leaves_b, grad_w))


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def _backward_l1(adapter, j, saved, x, leaves_b, kwargs, grad_out, *, aux):
    mixer = token_mixer(adapter.blocks[j], family=adapter.config.model_type)
    x_leaf = x.detach().requires_grad_()
    mixed = saved._unpack(saved._mixer_out).detach().requires_grad_()
    logits = [] if aux is not None else None
    devices = [x.device] if x.device.type == "cuda" else []
    with (torch.enable_grad(), torch.random.fork_rng(devices=devices),
          _mixer_stand_in(mixer, mixed, saved._mixer_arity, saved._rng_after)):
        out = adapter.forward_block(j, x_leaf, leaves_b, kwargs, router_logits=logits,
                                    truncated=True)
    outs, grads = [out], [grad_out]
    term = None if aux is None else aux.block_term(logits)
    if term is not None:
        outs.append(term)
        grads.append(torch.ones_like(term))
    grad_x, grad_mixed, *grad_re = torch.autograd.grad(outs, (x_leaf, mixed, *leaves_b.values()),
                                                       grads, allow_unused=True)
    kept_x, *kept_w = (None,) * (1 + len(leaves_b)) if grad_mixed is None else \
        _kept_graph_grads(saved, [saved._root], [grad_mixed],
                          num_weights=len(leaves_b))
    return _sum(grad_x, kept_x), {name: _sum(a, b)
                                  for name, a, b in zip(leaves_b, grad_re, kept_w)}
