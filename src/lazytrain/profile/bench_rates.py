"""Rate measurements of the profiler: copies, NVMe, the optimizer and the host workers.

Owns `copy_rates` (H2D, D2H, duplex, as `runtime.streams` copies), `nvme_rates` (through
`ActivationStore` transfers up to the window barrier; with a compute function in flight, the
effective rate under CPU contention), the optimizer's cost (`optimizer_running`,
`optimizer_ms_per_param`, `optimizer_q8_ms_per_param`, `optimizer_exposed_ms`: the engine's
gated forward pattern), the host work rates (`host_rates`) and the gradient-norm pass
(`grad_norm_ms`). Timed through `profile/bench_blocks.py`; `profile/profiler.measure_profile`
assembles the profile.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from lazytrain.models.host_params import HostParams, ParamGroup
from lazytrain.profile.bench_blocks import BlockBench, sync, time_ms
from lazytrain.runtime import optim8bit
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import as_device
from lazytrain.runtime.nvme import aligned_empty
from lazytrain.runtime.optim import BlockOptimizer, global_grad_norm
from lazytrain.units import GB

Q8_BENCH_NUMEL = 1 << 22
"""Parameters of the 8-bit AdamW benchmark group, at most (4.2e6: 16.8 MB of fp32 masters,
beyond the caches; its kernel takes about 0.1 s per 1e6 parameters on a 2-core machine, so a
whole block of a large model would add minutes to a profile for the same rate)."""
MAX_HIDDEN_SPEEDUP = 100.0
"""Cap on an effective rate relative to the rate alone, when I/O hides entirely behind compute
(the exposed time is then within timer noise)."""


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
    """NVMe write and read bytes/s through `ActivationStore` (from the transfer call to the window
    barrier).

    With `overlap_with` (a compute function, CPU contention), each transfer is issued, the
    function runs, then the barrier waits; the rate is bytes / (that time - the function's time
    alone), capped at `MAX_HIDDEN_SPEEDUP` x the plain rate.

    Returns:
        {"nvme_write": bytes/s, "nvme_read": bytes/s}.
    """
    cpu = torch.device("cpu")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    comp_ms = time_ms(overlap_with, device=cpu, repeats=repeats, warmup=1) if overlap_with else 0.0
    runs = {"nvme_write": [], "nvme_read": []}
    with ActivationStore(device=cpu, nvme_dir=Path(nvme_dir), io_threads=io_threads,
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


def optimizer_q8_ms_per_param(numel: int, *, repeats: int = 3) -> float | None:
    """8-bit AdamW step time of a `numel`-parameter fp32 group, ms per parameter: the update
    `BlockOptimizer` runs for a plan's `q8_blocks` (`optim8bit.adamw8bit`, bitsandbytes' CPU
    kernel); None when bitsandbytes is not installed (8-bit states are then unavailable)."""
    if not optim8bit.have_bitsandbytes():
        return None
    group = ParamGroup("bench", "", {"w": (numel,)})
    group.grad.normal_()
    adam = optim8bit.adamw8bit(group.master, group.grad, lr=1e-4)
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
    - optimizer: the fused AdamW step of a block-sized fp32 group (`BlockOptimizer`'s update)
      and, with bitsandbytes installed, the 8-bit AdamW step of at most `Q8_BENCH_NUMEL`
      parameters (the update of a `q8_blocks` block; the planner charges the difference,
      `spec.costs.q8_update_ms_per_gparam`).

    Returns:
        {"master_dtype", "convert_gb_per_s" (compute-dtype GB written / s),
        "accumulate_gb_per_s", "accumulate_first_gb_per_s" (gradient GB / s),
        "staging_copy_gb_per_s", "optimizer_ms_per_mparam" and, with bitsandbytes,
        "optimizer_q8_ms_per_mparam"}.
    """
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
    q8 = optimizer_q8_ms_per_param(min(n, Q8_BENCH_NUMEL), repeats=repeats)
    if q8 is not None:
        out["optimizer_q8_ms_per_mparam"] = q8 * 1e6
    return out


def grad_norm_ms(params: HostParams, *, repeats: int = 5, warmup: int = 1) -> float:
    """`global_grad_norm` over the run's host gradients (the engine's per-step clipping pass
    before any update is queued), ms."""
    return time_ms(lambda: global_grad_norm(params), device=torch.device("cpu"),
                   repeats=repeats, warmup=warmup)

