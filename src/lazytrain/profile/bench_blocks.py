"""Timing harness of the profiler: the median timer and one block's forward/backward bench.

Owns `time_samples` (warm-up runs, then each of `repeats` timed; CUDA events on a GPU,
`time.perf_counter` on a CPU) and `time_ms` (their median), `BlockBench` (one micro-batch's
inputs and each block's device weights, run through the engine's own code paths:
`ModelAdapter.forward_block` on a flat weight buffer as `Engine.run_forward` /
`backward_block` call it, the head through the engine's chunk loop) and `block_kind_times`
(the profile's per-kind block times, through a timing rule of `runtime/steady.py`: the
median, or the calibration's least repeat, measured again when disturbed).
`profile/bench_rates.py` measures rates on top of it; `profile/profiler.measure_profile`
assembles the profile.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from lazytrain.contract import HEAD_CHUNK_TOKENS
from lazytrain.models.adapter import IGNORE_INDEX, ModelAdapter, shift_labels
from lazytrain.models.host_params import HostParams
from lazytrain.runtime.block_autograd import flat_grad, grad_leaves
from lazytrain.runtime.backends import as_device
from lazytrain.runtime.ends import head_loss_chunks
from lazytrain.runtime.engine_config import COMPUTE_DTYPES
from lazytrain.runtime.steady import Timing, median_timing


def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on a CPU)."""
    if device.type == "cuda":
        as_device(device).synchronize()


def time_samples(fn: Callable[[], object], *, device: torch.device, repeats: int = 5,
                 warmup: int = 2) -> list[float]:
    """Wall time of each of `repeats` runs of `fn()` after `warmup` untimed runs, ms.

    CUDA: timing events around each run on the compute stream; CPU: perf_counter (both through
    the device API).
    """
    dev = as_device(torch.device(device)) if torch.device(device).type == "cuda" else None
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(max(1, repeats)):
        if dev is not None:
            start = dev.timing_event()
            fn()
            times.append(dev.elapsed_ms(start, dev.timing_event()))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_ms(fn: Callable[[], object], *, device: torch.device, repeats: int = 5,
            warmup: int = 2) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs, ms
    (`time_samples`)."""
    return statistics.median(time_samples(fn, device=device, repeats=repeats, warmup=warmup))


def sample_batch(vocab: int, *, micro_batch: int, seq_len: int, device: torch.device,
                 seed: int = 0) -> dict:
    """Random token ids [micro_batch, seq_len] with labels = ids (every position counts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (micro_batch, seq_len), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


class BlockBench:
    """One micro-batch's inputs and each block's device weights, for timing block j.

    Args:
        adapter: the model (fp32 masters in `adapter.params`).
        micro_batch, seq_len: the batch shape of the run.
        dtype: compute dtype name ("fp32" | "bf16").
        device: where compute runs.

    Every timed call runs inside the device API's compute scope, as the trainer's engine step
    does (instrumented, budgets on: on a CPU the ledger's dispatch mode books every op's fresh
    output, a few tens of us per op that the block times must include).
    """

    def __init__(self, adapter: ModelAdapter, *, micro_batch: int, seq_len: int, dtype: str,
                 device: torch.device) -> None:
        self.adapter, self.device = adapter, torch.device(device)
        self.api = as_device(self.device)
        self.dtype = COMPUTE_DTYPES[dtype]
        self.params: HostParams = adapter.params
        batch = sample_batch(adapter.config.vocab_size, micro_batch=micro_batch,
                             seq_len=seq_len, device=self.device)
        self.ids, self.labels = batch["input_ids"], batch["labels"]
        self.ends = self.params.ends.master.to(self.device, self.dtype)
        with torch.no_grad():
            self.h = adapter.embed(self.ids, self.params.ends.views(self.ends)[adapter.embed_name])
        self.kwargs = adapter.block_kwargs(self.ids, self.h)
        self.grad_out = torch.randn_like(self.h)
        self._last: torch.Tensor | None = None
        self._ends_grad: torch.Tensor | None = None

    def weights(self, j: int) -> torch.Tensor:
        """Block j's flat device weights in the compute dtype."""
        return self.params.blocks[j].master.to(self.device, self.dtype)

    def forward(self, j: int, flat: torch.Tensor) -> torch.Tensor:
        with self.api.compute_scope(), torch.no_grad():
            return self._block(j, self.h, flat)

    def forward_grad(self, j: int, flat: torch.Tensor, *, truncated: bool = False):
        """Block j with autograd, as `Engine.run_forward` of a kept block (`truncated` False) and
        the re-forward of `Engine.backward_block` (`truncated` True: the block's tail skipped
        where the family allows it, models/truncate.py): one leaf per parameter viewing `flat`
        (`block_autograd.grad_leaves`). Returns (x, leaves, out)."""
        x = self.h.detach().requires_grad_()
        leaves = grad_leaves(self.params.blocks[j], flat)
        with self.api.compute_scope(), torch.enable_grad():
            return x, leaves, self.adapter.forward_block(j, x, leaves, self.kwargs[j],
                                                         truncated=truncated)

    def backward(self, x, leaves, out, *, j: int = 0) -> torch.Tensor:
        """The backward of `forward_grad`'s graph, its gradients packed into block j's flat
        layout (`block_autograd.flat_grad`, as the engine); returns the flat gradient."""
        with self.api.compute_scope():
            _gx, *grads = torch.autograd.grad(out, (x, *leaves.values()), self.grad_out,
                                              allow_unused=True)
            return flat_grad(self.params.blocks[j], leaves, grads)

    def last_boundary(self) -> torch.Tensor:
        """Boundary L [B, S, H]: the forward chain over every block from the embedding, run
        once (no autograd) and kept; the head's input, as in the engine's turn window."""
        if self._last is None:
            h = self.h
            for j in range(len(self.params.blocks)):
                h = self._forward_from(j, h)
            self._last = h
        return self._last

    def head(self) -> float:
        """Final norm + head + loss, forward and backward, as `Engine.head_chunks` runs them.

        The engine's own chunk loop (`runtime.ends.head_loss_chunks`: per-weight leaves, loss
        / label tokens, fp32 in-place accumulation) on boundary L (`last_boundary`), not on
        the embedding: with a tied head the embedding's own token gets a logit in the
        hundreds, most softmax entries underflow to denormals and the backward matmuls run
        ~20x slower than on the engine's input.

        One pass with the SFT cross entropy, whatever `train.method`: the profile (and the
        calibration cache) is the same for every method. DPO's head runs a second forward
        (a pass without gradient for the log-probs [B, S] before the chunks' forward and
        backward); the planner charges it as the forward share of this time
        (`planner/build.py` `head_turn_factor`, 4/3) rather than the profiler timing a DPO
        head: the objective's own arithmetic on [B, S] log-probs is small beside the head's
        [tokens, H] x [H, V] matmuls, and one figure then serves every method's plan.

        Returns:
            the mean loss of the micro-batch (one host sync, as the engine's).
        """
        h = self.last_boundary()
        with self.api.compute_scope():
            return self._head(h)

    def _head(self, h: torch.Tensor) -> float:
        ends = self.params.ends
        targets = shift_labels(self.labels)
        tokens = max(int((targets != IGNORE_INDEX).sum()), 1)
        if self._ends_grad is None:
            self._ends_grad = torch.zeros(ends.numel, dtype=torch.float32, device=self.device)
        total, _grad_h = head_loss_chunks(self.adapter, ends, weights=self.ends,
                                          grad=self._ends_grad, h=h, targets=targets,
                                          tokens=tokens, chunk_tokens=HEAD_CHUNK_TOKENS)
        return float(total)  # the mean loss (divided by the label tokens); sync point

    def embed(self) -> None:
        with self.api.compute_scope(), torch.no_grad():
            self.adapter.embed(self.ids, self.params.ends.views(self.ends)[self.adapter.embed_name])

    def _forward_from(self, j: int, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._block(j, h, self.weights(j))

    def _block(self, j: int, h, flat):
        return self.adapter.forward_block(j, h, self.params.blocks[j].views(flat), self.kwargs[j])


def kind_samples(bench: BlockBench, j: int, *, repeats: int, warmup: int
                 ) -> dict[str, list[float]]:
    """One try of block j's times: the timed repeats of fwd_ms, fwd_grad_ms, reforward_ms (the
    truncated re-forward before the block's backward; fwd_grad_ms where the family re-forwards
    in full) and bwd_ms, ms (each backward on a fresh forward-with-autograd graph, timed
    alone)."""
    dev = bench.device
    flat = bench.weights(j)
    fwd = time_samples(lambda: bench.forward(j, flat), device=dev, repeats=repeats, warmup=warmup)
    fwd_grad = time_samples(lambda: bench.forward_grad(j, flat), device=dev, repeats=repeats,
                            warmup=warmup)
    reforward = time_samples(lambda: bench.forward_grad(j, flat, truncated=True), device=dev,
                             repeats=repeats, warmup=warmup)
    graphs = []

    def one_backward():
        bench.backward(*graphs.pop(), j=j)

    bwd_times = []
    for _ in range(warmup + max(1, repeats)):
        graphs.append(bench.forward_grad(j, flat))
        bwd_times.append(time_samples(one_backward, device=dev, repeats=1, warmup=0)[0])
    return {"fwd_ms": fwd, "fwd_grad_ms": fwd_grad, "reforward_ms": reforward,
            "bwd_ms": bwd_times[warmup:]}


def block_kind_times(bench: BlockBench, kinds: Sequence[str], *, repeats: int = 5,
                     warmup: int = 2, timing: Timing = median_timing) -> dict[str, dict]:
    """Per block kind (first block of each kind): fwd_ms, fwd_grad_ms, reforward_ms, bwd_ms and,
    on CUDA, workspace_bytes (peak allocated during forward-with-autograd + backward above the
    start).

    Args:
        bench: inputs and weights.
        kinds: kind of each block j (len L).
        repeats, warmup: timed and untimed runs per series.
        timing: how a try's repeats become one time (`runtime.steady`: the median, or the
            calibration's least repeat, measured again when disturbed).
    """
    out: dict[str, dict] = {}
    dev = bench.device
    for kind in dict.fromkeys(kinds):
        j = list(kinds).index(kind)
        entry = {**timing(lambda: kind_samples(bench, j, repeats=repeats, warmup=warmup),
                          f"block kind {kind}"), "block": j}
        if dev.type == "cuda":
            flat = bench.weights(j)
            sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            bench.backward(*bench.forward_grad(j, flat), j=j)
            sync(dev)
            entry["workspace_bytes"] = int(torch.cuda.max_memory_allocated(dev) - base)
        out[kind] = entry
    return out
