"""Measure the cost model on this machine: block times per kind, transfer rates, contention.

Owns the measurements behind `lazytrain profile` (issue 4, item 1). Everything is timed through
the engine's own code paths: blocks run through `ModelAdapter.forward_block` on a flat weight
buffer exactly as `Engine.run_forward` / `backward_block` call them, the head through
`head_loss_sum` in the engine's chunks, copies with `Tensor.copy_` as `runtime.streams` does
them (pinned host buffers and side streams on CUDA), NVMe through `CheckpointStore` transfers
up to the window barrier, the optimizer through `BlockOptimizer`.

Timing: warm-up runs, then the median of `repeats`; CUDA events on a GPU, `time.perf_counter`
(monotonic) on a CPU.

Contention (CPU only; on a GPU copies run on copy engines beside compute): the evaluator's CPU
model serialises channels with compute (window = compute + sum of bytes / rate). The rates
written for the CPU are therefore *effective* rates under contention:
- h2d / d2h copies run synchronously on the compute thread: their rate is the copy rate;
- NVMe I/O runs on worker threads while the window computes; its effective rate is
  bytes / (time(compute with the I/O in flight) - time(compute alone)), i.e. what the I/O adds
  to a window;
- the optimizer worker updates block j while the forward of the next step waits for it
  (`Engine.prefetch_weights`); what it adds to a step is measured by replaying that pattern
  (updates queued, forward chain gated per block) minus the forward alone, and written as the
  profile's `step_const_ms` (with the per-step load of the resident ends).
The `cpu_contention` entry records the raw factors (compute slowdown while the optimizer runs,
rates alone and with the optimizer) for the report.

Host work (`host_rates`): the conversion and accumulation rates on the runtime's own host
workers, the NVMe staging memcpy and the optimizer update, the profile's `host` section.

Engine overheads (`runtime.overhead`): the engine's fixed cost of a window and of a step, from
`Engine.step` on small twins of the model; the per-step part and the gradient-norm pass join
`step_const_ms`.

It writes a profile dict in the schema of `lazytrain.spec.costs`.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

import torch

from lazytrain.models.adapter import IGNORE_INDEX, ModelAdapter, shift_labels
from lazytrain.runtime.block_autograd import flat_grad, grad_leaves
from lazytrain.runtime.device import as_device
from lazytrain.runtime.ends import head_loss_chunks
from lazytrain.runtime.engine import COMPUTE_DTYPES, HEAD_CHUNK_TOKENS
from lazytrain.runtime.optim import BlockOptimizer
from lazytrain.runtime.params import HostParams, ParamGroup

GB = 1e9
"""Bytes per GB (profile bandwidths are GB/s, as in hardware.json)."""
MAX_HIDDEN_SPEEDUP = 100.0
"""Cap on an effective rate relative to the rate alone, when I/O hides entirely behind compute
(the exposed time is then within timer noise)."""
QUICK_REPEATS = 3
"""Timed runs per measurement in the quick (calibration) mode of `measure_profile`: the fewest
whose median still drops one disturbed run (a shared machine)."""
QUICK_WARMUP = 1
"""Warm-up runs per measurement in the quick mode (one: first-touch and allocator effects)."""
TWIN_STEPS_PER_REPEAT = 10
"""Engine steps of each overhead twin per `repeats` (a twin step takes ~20 ms; o is the
difference of two residuals of a few ms each, within timer noise at 3 samples: at 9 the fit
gave o = 0 in one of five quick profiles on the 2-core machine)."""


def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on a CPU)."""
    if device.type == "cuda":
        as_device(device).synchronize()


def time_ms(fn: Callable[[], object], *, device: torch.device, repeats: int = 5,
            warmup: int = 2) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs, ms.

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
    return statistics.median(times)


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

    def forward_grad(self, j: int, flat: torch.Tensor):
        """Block j with autograd, as `Engine.run_forward` of a kept block and the re-forward of
        `Engine.backward_block`: one leaf per parameter viewing `flat`
        (`block_autograd.grad_leaves`). Returns (x, leaves, out)."""
        x = self.h.detach().requires_grad_()
        leaves = grad_leaves(self.params.blocks[j], flat)
        with self.api.compute_scope(), torch.enable_grad():
            return x, leaves, self.adapter.forward_block(j, x, leaves, self.kwargs[j])

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


def block_kind_times(bench: BlockBench, kinds: Sequence[str], *, repeats: int = 5,
                     warmup: int = 2) -> dict[str, dict]:
    """Per block kind (first block of each kind): fwd_ms, fwd_grad_ms, bwd_ms and, on CUDA,
    workspace_bytes (peak allocated during forward-with-autograd + backward above the start).

    Args:
        bench: inputs and weights.
        kinds: kind of each block j (len L).
    """
    out: dict[str, dict] = {}
    dev = bench.device
    for kind in dict.fromkeys(kinds):
        j = list(kinds).index(kind)
        flat = bench.weights(j)
        fwd = time_ms(lambda: bench.forward(j, flat), device=dev, repeats=repeats, warmup=warmup)
        fwd_grad = time_ms(lambda: bench.forward_grad(j, flat), device=dev, repeats=repeats,
                           warmup=warmup)
        graphs = []

        def one_backward():
            bench.backward(*graphs.pop(), j=j)

        bwd_times = []
        for _ in range(warmup + max(1, repeats)):
            graphs.append(bench.forward_grad(j, flat))
            bwd_times.append(time_ms(one_backward, device=dev, repeats=1, warmup=0))
        entry = {"fwd_ms": fwd, "fwd_grad_ms": fwd_grad,
                 "bwd_ms": statistics.median(bwd_times[warmup:]), "block": j}
        if dev.type == "cuda":
            sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            bench.backward(*bench.forward_grad(j, flat), j=j)
            sync(dev)
            entry["workspace_bytes"] = int(torch.cuda.max_memory_allocated(dev) - base)
        out[kind] = entry
    return out


# ---------------------------------------------------------------------------------------------
# Transfers




def copy_rates(nbytes: int, *, device: torch.device, repeats: int = 5, warmup: int = 1
               ) -> dict[str, float]:
    """H2D, D2H and duplex (both at once) bytes/s for `nbytes`-byte copies.

    CUDA: pinned host buffers, copies on two side streams of the device API (duplex: both
    streams at once). CPU: `copy_` between two host tensors, as the engine's copies do; duplex
    runs the two copies in two threads at once.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    api = as_device(device if cuda else "cpu")
    host_src, host_dst = api.pinned_empty(nbytes), api.pinned_empty(nbytes)
    host_src.fill_(1)
    dev_dst = api.empty(nbytes, torch.uint8)
    dev_src = api.empty(nbytes, torch.uint8).fill_(1)
    if cuda:
        s1, s2 = api.stream("h2d"), api.stream("d2h")
        api.synchronize()  # the buffers are filled before the side streams read them

        def h2d():
            api.host_wait(api.copy(dev_dst, host_src, stream=s1))

        def d2h():
            api.host_wait(api.copy(host_dst, dev_src, stream=s2))

        def duplex():
            a = api.copy(dev_dst, host_src, stream=s1)
            b = api.copy(host_dst, dev_src, stream=s2)
            api.host_wait(a)
            api.host_wait(b)
    else:
        def h2d():
            dev_dst.copy_(host_src)

        def d2h():
            host_dst.copy_(dev_src)

        def duplex():
            t = threading.Thread(target=d2h)
            t.start()
            h2d()
            t.join()
    # perf_counter around host-synchronised copies on both paths (events would miss the
    # side streams)
    cpu = torch.device("cpu")
    out = {}
    for name, fn, moved in (("h2d", h2d, nbytes), ("d2h", d2h, nbytes),
                            ("duplex", duplex, 2 * nbytes)):
        out[name] = moved / (time_ms(fn, device=cpu, repeats=repeats, warmup=warmup) / 1e3)
    return out


def nvme_rates(nvme_dir: Path | str, nbytes: int, *, io_threads: int = 2, repeats: int = 3,
               overlap_with: Callable[[], object] | None = None,
               fault_hook: Callable | None = None) -> dict[str, float]:
    """NVMe write and read bytes/s through `CheckpointStore` (issue to window barrier).

    With `overlap_with` (a compute function, CPU contention), each transfer is issued, the
    function runs, then the barrier waits; the rate is bytes / (that time - the function's time
    alone), capped at `MAX_HIDDEN_SPEEDUP` x the plain rate.

    Returns:
        {"nvme_write": bytes/s, "nvme_read": bytes/s}.
    """
    from lazytrain.runtime.activations import CheckpointStore

    cpu = torch.device("cpu")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    comp_ms = time_ms(overlap_with, device=cpu, repeats=repeats, warmup=1) if overlap_with else 0.0
    runs = {"nvme_write": [], "nvme_read": []}
    with CheckpointStore(device=cpu, nvme_dir=Path(nvme_dir), io_threads=io_threads,
                         fault_hook=fault_hook) as store:
        for _ in range(max(1, repeats)):
            store.begin_window("f0")
            store.put(0, data, "nvme")
            store.transfer(0, "d2h", 1.0)
            store.end_window()
            for kind, window in (("nvme_write", "f1"), ("nvme_read", "b1")):
                store.begin_window(window)
                t0 = time.perf_counter()
                store.transfer(0, kind, 1.0)
                if overlap_with is not None:
                    overlap_with()
                store.end_window()
                store.wait_writes()  # the barrier does not wait for writes (device-bound)
                runs[kind].append((time.perf_counter() - t0) * 1e3)
            store.begin_window("b0")
            store.transfer(0, "h2d", 1.0)
            store.get(0)
            store.release(0)
            store.end_window()
    out = {}
    for kind, ms in runs.items():
        alone = nbytes / (statistics.median(ms) / 1e3)
        exposed = statistics.median(ms) - comp_ms
        if overlap_with is None:
            out[kind] = alone
        else:
            out[kind] = nbytes / (exposed / 1e3) if exposed > 0 else float("inf")
            out[kind] = min(out[kind], MAX_HIDDEN_SPEEDUP * alone)
    return out


# ---------------------------------------------------------------------------------------------
# Optimizer


@contextmanager
def optimizer_running(numel: int):
    """Run AdamW steps on a private `numel`-parameter group in a thread until the block exits.

    Yields a dict whose "steps" counts completed updates.
    """
    group = ParamGroup("bench", "", {"w": (numel,)})
    group.grad.normal_()
    adam = torch.optim.AdamW([group.master], lr=1e-4, fused=True)
    group.master.grad = group.grad
    stop, count = threading.Event(), {"steps": 0}

    def loop():
        while not stop.is_set():
            adam.step()
            count["steps"] += 1

    t = threading.Thread(target=loop, name="lazytrain-profile-adamw", daemon=True)
    t.start()
    try:
        yield count
    finally:
        stop.set()
        t.join()


def optimizer_ms_per_param(numel: int, *, repeats: int = 3) -> float:
    """Fused AdamW step time of a `numel`-parameter fp32 group, ms per parameter."""
    group = ParamGroup("bench", "", {"w": (numel,)})
    group.grad.normal_()
    group.master.grad = group.grad
    adam = torch.optim.AdamW([group.master], lr=1e-4, fused=True)
    return time_ms(adam.step, device=torch.device("cpu"), repeats=repeats, warmup=1) / numel


def optimizer_exposed_ms(bench: BlockBench, *, repeats: int = 3) -> dict[str, float]:
    """What the optimizer worker and the ends' load add to a step, ms (the engine's pattern).

    Replays the start of a step: every group's update queued on a `BlockOptimizer` (as
    `Engine.queue_optimizer`), then the ends loaded and the forward chain run with block j
    waiting for its own update and loading its weights (as `Engine.prefetch_weights`). The
    result minus the same forward chain without updates is the exposed optimizer time.

    Returns:
        {"exposed_ms", "ends_load_ms", "forward_chain_ms"}.
    """
    params, dev = bench.params, bench.device
    saved = [g.master.clone() for g in params.groups]
    opt = BlockOptimizer(params, lr=0.0, weight_decay=0.0)

    def chain(with_updates: bool):
        if with_updates:
            for g in params.groups:
                opt.submit(g, lr=0.0)
            opt.wait(params.ends)
        params.ends.master.to(dev, bench.dtype)
        h = bench.h
        for j, g in enumerate(params.blocks):
            if with_updates:
                opt.wait(g)
            with torch.no_grad():
                h = bench._block(j, h, bench.weights(j))
        sync(dev)

    try:
        alone = time_ms(lambda: chain(False), device=dev, repeats=repeats, warmup=1)
        gated = time_ms(lambda: chain(True), device=dev, repeats=repeats, warmup=1)
        ends = time_ms(lambda: params.ends.master.to(dev, bench.dtype), device=dev,
                       repeats=repeats, warmup=1)
    finally:
        opt.close()
        for g, m in zip(params.groups, saved):
            g.master.copy_(m)
            g.grad.zero_()
    return {"exposed_ms": max(0.0, gated - alone), "ends_load_ms": ends,
            "forward_chain_ms": alone}


# ---------------------------------------------------------------------------------------------
# Host work


def host_rates(bench: BlockBench, *, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Host work rates, measured as the runtime's workers do it, for the profile's `host`.

    - conversion: block 0's master copied into a pinned compute-dtype staging buffer on a
      `host_workers("convert")` thread (`DeviceWeights.convert`);
    - accumulation: a pinned compute-dtype gradient added (and, for the first micro-batch,
      copied) into a master-dtype accumulator on a `host_workers("accum")` thread
      (`ParamGroup.accumulate_grad`);
    - staging copy: a boundary-sized copy into a 4 KiB-aligned bounce buffer
      (`runtime.nvme.aligned_empty`), on the calling thread;
    - optimizer: the fused AdamW step of a block-sized fp32 group (`BlockOptimizer`'s update).

    Returns:
        {"master_dtype", "convert_gb_per_s" (compute-dtype GB written / s),
        "accumulate_gb_per_s", "accumulate_first_gb_per_s" (gradient GB / s),
        "staging_copy_gb_per_s", "optimizer_ms_per_mparam"}.
    """
    from lazytrain.runtime.nvme import aligned_empty

    api, cpu = as_device("cpu"), torch.device("cpu")
    master = bench.params.blocks[0].master
    n, c_size = master.numel(), torch.empty((), dtype=bench.dtype).element_size()
    staging = api.pinned_empty(n * c_size).view(bench.dtype)
    drained = api.pinned_empty(n * c_size).view(bench.dtype).copy_(master)
    accumulator = torch.zeros_like(master)
    boundary = bench.h.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    bounce = aligned_empty(boundary.numel())
    out: dict[str, float] = {"master_dtype": "bf16" if master.dtype == torch.bfloat16
                             else "fp32"}
    with api.host_workers("convert") as conv, api.host_workers("accum") as acc:
        for key, pool, fn in (("convert_gb_per_s", conv, lambda: staging.copy_(master)),
                              ("accumulate_gb_per_s", acc, lambda: accumulator.add_(drained)),
                              ("accumulate_first_gb_per_s", acc,
                               lambda: accumulator.copy_(drained))):
            ms = time_ms(lambda: pool.submit(fn).result(), device=cpu, repeats=repeats,
                         warmup=warmup)
            out[key] = n * c_size / (ms / 1e3) / GB
    ms = time_ms(lambda: bounce.copy_(boundary), device=cpu, repeats=repeats, warmup=warmup)
    out["staging_copy_gb_per_s"] = boundary.numel() / (ms / 1e3) / GB
    out["optimizer_ms_per_mparam"] = optimizer_ms_per_param(n, repeats=repeats) * 1e6
    return out


def grad_norm_ms(params: HostParams, *, repeats: int = 5, warmup: int = 1) -> float:
    """`global_grad_norm` over the run's host gradients (the engine's per-step clipping pass
    before any update is queued), ms."""
    from lazytrain.runtime.optim import global_grad_norm

    return time_ms(lambda: global_grad_norm(params), device=torch.device("cpu"),
                   repeats=repeats, warmup=warmup)


# ---------------------------------------------------------------------------------------------
# The profile


def measure_profile(adapter: ModelAdapter, kinds: Sequence[str], *, micro_batch: int,
                    seq_len: int, compute_dtype: str, device: str | torch.device,
                    nvme_dir: Path | str, io_threads: int = 2, repeats: int = 5,
                    warmup: int = 2, model_config_sha256: str | None = None,
                    log: Callable[[str], None] = lambda msg: None, quick: bool = False) -> dict:
    """Everything `lazytrain profile` measures, as a profile dict (`lazytrain.spec.costs`).

    Args:
        adapter: the model, as the engine would run it.
        kinds: `BlockSpec.kind` of each block (len L).
        micro_batch, seq_len, compute_dtype: the run's batch shape and dtype.
        device: "cpu" or "cuda".
        nvme_dir: directory of the NVMe tier (files removed afterwards).
        io_threads: NVMe worker threads (as the run's `runtime.io_threads`).
        repeats, warmup: timed and untimed runs per measurement.
        model_config_sha256: recorded so a profile is not applied to another model.
        log: progress lines.
        quick: calibration mode: the same measurements with `QUICK_REPEATS` timed runs and
            `QUICK_WARMUP` warm-up runs each (overrides `repeats` / `warmup`): a median of 3
            instead of 5, which drops one disturbed run but not two (the full mode drops
            two); NVMe and optimizer figures use max(2, repeats // 2) = 2 runs either way.

    Returns:
        the profile: version, model_config_sha256, seq_len, micro_batch, compute_dtype, device,
        block_kinds, ends (embed_ms, head_ms), bandwidths (GB/s; effective under contention
        on a CPU), step_const_ms (exposed optimizer + ends load + gradient norm + the
        twins' per-step overhead), host (`host_rates`), window_overhead_ms
        (`window_overhead_ms`; absent when the family has no twin), measurements (raw rates
        alone and with the optimizer running, the twins' figures) and, on a CPU,
        cpu_contention.
    """
    if quick:
        repeats, warmup = QUICK_REPEATS, QUICK_WARMUP
    dev = torch.device(device)
    bench = BlockBench(adapter, micro_batch=micro_batch, seq_len=seq_len, dtype=compute_dtype,
                       device=dev)
    log(f"profile: blocks ({len(set(kinds))} kinds)")
    block = block_kind_times(bench, kinds, repeats=repeats, warmup=warmup)
    ends = {"embed_ms": time_ms(bench.embed, device=dev, repeats=repeats, warmup=warmup),
            "head_ms": time_ms(bench.head, device=dev, repeats=repeats, warmup=warmup)}
    weight_bytes = adapter.params.max_block_numel() * bench.ends.element_size()
    boundary_bytes = bench.h.numel() * bench.h.element_size()
    nvme_bytes = max(boundary_bytes, 1 << 20)
    log("profile: copies and NVMe")
    alone = {**copy_rates(weight_bytes, device=dev, repeats=repeats),
             **nvme_rates(nvme_dir, nvme_bytes, io_threads=io_threads, repeats=max(2, repeats // 2))}
    numel = adapter.params.max_block_numel()
    with optimizer_running(numel):
        busy = {**copy_rates(weight_bytes, device=dev, repeats=repeats),
                **nvme_rates(nvme_dir, nvme_bytes, io_threads=io_threads,
                             repeats=max(2, repeats // 2))}
    log("profile: optimizer")
    opt = optimizer_exposed_ms(bench, repeats=max(2, repeats // 2))
    measurements = {"alone_gb_per_s": {k: v / GB for k, v in alone.items()},
                    "with_optimizer_gb_per_s": {k: v / GB for k, v in busy.items()},
                    "copy_bytes": weight_bytes, "nvme_bytes": nvme_bytes,
                    "optimizer_ms_per_mparam": optimizer_ms_per_param(numel) * 1e6, **opt}
    rates = dict(alone)
    profile = {"version": 1, "model_config_sha256": model_config_sha256,
               "seq_len": seq_len, "micro_batch": micro_batch, "compute_dtype": compute_dtype,
               "device": dev.type, "block_kinds": {}, "ends": ends}
    if dev.type == "cpu":
        j0 = block[kinds[0]]["block"]
        flat = bench.weights(j0)
        compute = (lambda: bench.forward(j0, flat))
        log("profile: CPU contention")
        eff = nvme_rates(nvme_dir, nvme_bytes, io_threads=io_threads,
                         repeats=max(2, repeats // 2), overlap_with=compute)
        rates.update(eff)
        fwd_alone = block[kinds[0]]["fwd_ms"]
        with optimizer_running(numel):
            fwd_busy = time_ms(compute, device=dev, repeats=repeats, warmup=1)
        profile["cpu_contention"] = {
            "compute_slowdown_with_optimizer": fwd_busy / fwd_alone if fwd_alone > 0 else 1.0,
            "nvme_effective_gb_per_s": {k: v / GB for k, v in eff.items()},
            "model": "window = compute + sum(bytes / effective rate); step += step_const_ms"}
    for kind, entry in block.items():
        profile["block_kinds"][kind] = {k: v for k, v in entry.items() if k != "block"}
    profile["bandwidths"] = {"h2d_gb_per_s": rates["h2d"] / GB, "d2h_gb_per_s": rates["d2h"] / GB,
                             "duplex_gb_per_s": rates["duplex"] / GB,
                             "nvme_read_gb_per_s": rates["nvme_read"] / GB,
                             "nvme_write_gb_per_s": rates["nvme_write"] / GB}
    # exposed optimizer + ends load; + the gradient norm and the twins' per-step overhead
    profile["step_const_ms"] = opt["exposed_ms"] + opt["ends_load_ms"]
    log("profile: host work")
    profile["host"] = host_rates(bench, repeats=repeats, warmup=warmup)
    norm_ms = grad_norm_ms(adapter.params, repeats=repeats, warmup=warmup)
    measurements["grad_norm_ms"] = norm_ms
    profile["step_const_ms"] += norm_ms
    log("profile: engine overheads (two twins)")
    from lazytrain.runtime.overhead import window_overhead_ms  # it builds on BlockBench
    try:
        overhead = window_overhead_ms(adapter, compute_dtype=compute_dtype, device=dev,
                                      nvme_dir=nvme_dir, io_threads=io_threads,
                                      steps=TWIN_STEPS_PER_REPEAT * repeats, warmup=warmup)
    except ValueError as exc:  # a family without a twin: the terms stay unmodelled (0)
        log(f"profile: {exc}; window_overhead_ms not measured")
        measurements["engine_overhead"] = {"error": str(exc)}
    else:
        profile["window_overhead_ms"] = overhead["window_overhead_ms"]
        profile["step_const_ms"] += overhead["step_overhead_ms"]
        measurements["engine_overhead"] = overhead
    profile["measurements"] = measurements
    return profile
