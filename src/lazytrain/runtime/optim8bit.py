"""8-bit AdamW for one flat fp32 host buffer, and the conversion of its states to/from fp32.

Owns the "hybrid 8-bit path" of the optimizer (docs/design.md, "Where each concern lives"):
for the blocks a Plan lists in `q8_blocks`, the two Adam moments are stored block-wise
quantized in 8 bits (1 B each instead of 4 B) while the master weights and gradients stay
fp32. The update itself is `bitsandbytes.optim.AdamW8bit` (block-wise dynamic quantization,
256 values per quantization block, one fp32 absmax per block; signed dynamic map for m,
unsigned for v), whose CPU kernel (bitsandbytes >= 0.50) dequantizes a parameter's moments,
runs the fp32 AdamW update (decoupled weight decay, bias correction as torch's AdamW) and
re-quantizes them.

Why bitsandbytes and not torchao: `torchao.optim.AdamW8bit` (0.18) runs on CPU only through
torch.compile (about 70 s for the first step on this machine; eager needs dynamo disabled)
and silently keeps fp32 moments for any tensor whose size is not a multiple of its block size,
which the flat per-block buffers rarely are. bitsandbytes runs eagerly on CPU tensors of any
size and stores real uint8 moments.

Transient memory: the CPU kernel dequantizes a whole parameter's two moments into fp32, so
the flat buffer is handed to bitsandbytes as views of at most `CHUNK_NUMEL` elements (one
bitsandbytes parameter each): the transient is 8 B x CHUNK_NUMEL (256 MB), not 8 B per
parameter of a whole block.

Knows nothing about plans or tiers.

Source: Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.
"""

from __future__ import annotations

import torch

QBLOCK = 256
"""Values per quantization block of bitsandbytes' CPU kernel (one fp32 absmax each)."""
CHUNK_NUMEL = 1 << 25
"""Elements per bitsandbytes parameter view (a multiple of QBLOCK): bounds the kernel's fp32
transient to 8 B x 2^25 = 268 MB."""
Q8_BYTES_PER_PARAM = 2 + 2 * 4 / QBLOCK
"""Moment bytes per parameter with 8-bit states: 1 B each for m and v, plus one fp32 absmax per
256 values for each (0.03 B); fp32 moments take 8 B."""


def have_bitsandbytes() -> bool:
    """True when `bitsandbytes` (the `q8` extra) imports."""
    try:
        _bnb()
    except ImportError:
        return False
    return True


def _bnb():
    """The bitsandbytes module, or an ImportError naming the fix."""
    try:
        import bitsandbytes  # lazy: optional dependency (the [q8] extra)
    except ImportError as exc:
        raise ImportError("8-bit optimizer states (plan q8_blocks) need bitsandbytes>=0.50: "
                          "pip install -e '.[q8]'") from exc
    return bitsandbytes


def chunk_views(flat: torch.Tensor) -> list[torch.Tensor]:
    """`flat` [numel] as consecutive views of at most CHUNK_NUMEL elements (last one shorter)."""
    return [flat[a:a + CHUNK_NUMEL] for a in range(0, flat.numel(), CHUNK_NUMEL)]


def adamw8bit(master: torch.Tensor, grad: torch.Tensor, *, lr: float, betas=(0.9, 0.999),
              eps: float = 1e-8, weight_decay: float = 0.01):
    """An 8-bit AdamW over one flat fp32 buffer; `step()` updates `master` in place from `grad`.

    Args:
        master: [numel] fp32 master weights (host); updated in place through views.
        grad: [numel] fp32 gradient accumulator with the same layout (read by `step`).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (torch semantics: decoupled weight
            decay `p *= 1 - lr * wd`, bias-corrected moments).

    Returns:
        `bitsandbytes.optim.AdamW8bit` whose parameters are `chunk_views(master)`, each with
        `.grad` the matching view of `grad`; every chunk's moments are 8-bit (min_8bit_size=1).

    Raises:
        ImportError: bitsandbytes is not installed (names the extra).
    """
    bnb = _bnb()
    views = chunk_views(master)
    for v, g in zip(views, chunk_views(grad)):
        v.grad = g  # the accumulator *is* the .grad the optimizer reads
    return bnb.optim.AdamW8bit(views, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               min_8bit_size=1)


def moments_from_q8(opt) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(m, v, step) of an `adamw8bit` optimizer as flat fp32 tensors (dequantized).

    Returns zeros and step 0 when the optimizer has not stepped yet.
    """
    F = _bnb().functional
    ms, vs, step = [], [], 0
    for p in opt.param_groups[0]["params"]:
        st = opt.state.get(p) or {}
        if "state1" not in st:
            ms.append(torch.zeros_like(p))
            vs.append(torch.zeros_like(p))
            continue
        step = int(st["step"])
        for out, k in ((ms, "1"), (vs, "2")):
            out.append(F.dequantize_blockwise(st["state" + k], absmax=st["absmax" + k],
                                              code=st["qmap" + k], blocksize=QBLOCK))
    return torch.cat(ms), torch.cat(vs), step


def load_q8_moments(opt, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
    """Quantize flat fp32 moments (m, v) into an `adamw8bit` optimizer's state at `step`.

    Args:
        opt: from `adamw8bit`.
        m, v: [numel] fp32 first and second moments (e.g. from torch's AdamW state).
        step: optimizer steps already taken (bias correction continues from it); 0 leaves the
            optimizer fresh.
    """
    if step == 0:
        return
    F = _bnb().functional
    signed, unsigned = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    for p, mc, vc in zip(opt.param_groups[0]["params"], chunk_views(m), chunk_views(v)):
        st = opt.state[p]
        st["step"] = step
        for k, x, code in (("1", mc, signed), ("2", vc, unsigned)):
            q, qs = F.quantize_blockwise(x.contiguous(), code=code, blocksize=QBLOCK)
            st["state" + k], st["absmax" + k], st["qmap" + k] = q, qs.absmax, code


def moment_bytes(opt) -> int:
    """Bytes of the optimizer's state tensors (uint8 moments + absmax + maps), for tests."""
    total = 0
    for st in opt.state.values():
        total += sum(t.numel() * t.element_size() for t in st.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total
