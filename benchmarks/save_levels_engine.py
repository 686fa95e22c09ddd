"""Save levels in the CPU engine: step time and bytes moved, side by side in one run.

Run:  python benchmarks/save_levels_engine.py [--layers 6] [--hidden 512] [--seq 256]
          [--batch 1] [--rounds 5] [--threads 1]

A Llama-shaped model (intermediate 8/3 H), every boundary kept in HBM and no block kept, so
without levels every block is re-forwarded in its own backward window b{j}. One engine runs
interleaved rounds of one step under each of three plans (`Engine.set_plan` between steps):

- `full`: no `save_levels` (a plan written before the field): every re-forward in full;
- `L0`: every block L0: the truncated re-forward (no MLP down projection);
- `L2 dram`: every block L2 (no re-forward), its saved internals moved D2H whole in f{j+1} and
  H2D whole in b{j+1}; the last block, which has no legal d2h/h2d pair, keeps them in HBM;
- `L2 hbm`: every block L2, internals kept on the device (what the level saves without the
  copies).

Also times block 0 alone (thread CPU time, best of `--reps`): the forward without grad and
with `forward_saving` (f{j} at L0 / L2), the truncated re-forward + backward and the backward
from the saved graph (b{j} at L0 / L2). Prints one table: per plan the best step (wall, and CPU time of the engine's thread, which runs
every kernel and, on this backend, every copy: less sensitive to other processes on a shared
machine, and without the optimizer worker's AdamW, which the plans do not change), the
best summed forward (f*) and backward (b*) windows (the engine's meter: where the levels
move work), the saved internals' D2H + H2D bytes and all bytes the
device API copied per step (the ledger's channels), and the ratios L0 / full, L2 dram / L0
and L2 hbm / L0. On the CPU backend every copy is a synchronous memcpy on the engine's thread, so
the L2 row pays its D2H/H2D in full where a GPU overlaps them with compute. Ratios only
matter; absolute times depend on the load. Not part of CI.

A run on the 2-core shared development machine (load average ~4-6, torch CPU build, defaults,
9 rounds): engine-thread CPU per step full 521, L0 497, L2 dram 462, L2 hbm 446 ms; ratios
L0 / full 0.952, L2 dram / L0 0.930, L2 hbm / L0 0.898 (wall 0.963, 0.917, 0.902); backward
windows L2 dram / L0 0.816; saved internals moved 103.2 MB per step (5 blocks x 10.3 MB each
way) on top of 260.1 MB of weights; block 0 alone: forward 18.2 ms without grad, 21.5 ms
saving L2; backward 55.7 ms truncated re-forward + backward, 36.1 ms from the saved graph
(f + b ratio 0.779). At load ~8 the wall ratios swung by +-0.3 between runs, the CPU ratios by
~0.05.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lazytrain.models import adapter_from_model
from lazytrain.models.saved_tensors import backward_saved, forward_saving
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import InternalTransfer, SolveRecord
from lazytrain.planner.windows import backward_window, forward_window
from lazytrain.runtime.block_autograd import grad_leaves
from lazytrain.runtime.build import make_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import batch, make_config, make_problem  # noqa: E402

MODES = ("full", "L0", "L2 dram", "L2 hbm")


def saved_bytes(adapter, args) -> tuple[int, int]:
    """(S1, S2) of block 0 measured by `forward_saving` on a batch of the benchmark's shape."""
    group = adapter.params.blocks[0]
    x = torch.randn(args.batch, args.seq, args.hidden)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    kwargs = adapter.block_kwargs(ids, x)[0]
    out = []
    for level in ("L1", "L2"):
        _, saved = forward_saving(adapter, 0, x, grad_leaves(group, group.master), group.master,
                                  kwargs, level=level)
        out.append(saved.nbytes)
    return out[0], out[1]


def block_times(adapter, args) -> dict[str, float]:
    """Block 0 alone, best of `args.reps` interleaved repetitions, CPU seconds of this thread
    (compute runs on it with one torch thread; other processes' load barely shows): its
    forward without grad (f{j} at L0) and with `forward_saving` at L2 (f{j} at L2), the
    truncated re-forward + backward (b{j} at L0) and the backward from the saved graph (b{j}
    at L2)."""
    group = adapter.params.blocks[0]
    x = torch.randn(args.batch, args.seq, args.hidden)
    grad = torch.randn_like(x)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    kwargs = adapter.block_kwargs(ids, x)[0]
    flat = group.master
    best = dict.fromkeys(("forward L0", "forward L2", "backward L0", "backward L2"), 1e9)

    def timed(name, fn):
        t0 = time.thread_time()
        out = fn()
        best[name] = min(best[name], time.thread_time() - t0)
        return out

    def backward_l0():
        xg, leaves = x.clone().requires_grad_(), grad_leaves(group, flat)
        with torch.enable_grad():
            out = adapter.forward_block(0, xg, leaves, kwargs, truncated=True)
        return torch.autograd.grad([out], (xg, *leaves.values()), [grad])

    for _ in range(args.reps):
        with torch.no_grad():
            timed("forward L0", lambda: adapter.forward_block(0, x, group.views(flat), kwargs))
        _, saved = timed("forward L2", lambda: forward_saving(
            adapter, 0, x, grad_leaves(group, flat), flat, kwargs, level="L2"))
        timed("backward L0", backward_l0)
        timed("backward L2", lambda: backward_saved(adapter, 0, saved, x,
                                                    grad_leaves(group, flat), flat, kwargs,
                                                    grad))
    return best


def plans(adapter, args) -> dict:
    """mode -> Plan (see the module docstring)."""
    L = adapter.num_blocks
    s1, s2 = saved_bytes(adapter, args)
    problem = dataclasses.replace(make_problem(adapter, args), saved_bytes=((s1, s2),) * L,
                                  reforward_ms=(1.0,) * L, reforward_l1_ms=(0.6,) * L)
    tiers = ("hbm",) * (L + 1)
    out = {}
    for mode, levels, saved_tiers in (
            ("full", (), ()), ("L0", ("L0",) * L, ("none",) * L),
            ("L2 dram", ("L2",) * L, ("dram",) * (L - 1) + ("hbm",)),
            ("L2 hbm", ("L2",) * L, ("hbm",) * L)):
        d = decisions_from_tiers(problem, tiers, save_levels=levels,
                                 saved_tiers=tuple("hbm" if t == "dram" else t
                                                   for t in saved_tiers))
        moves = tuple(m for j in range(L - 1) if "dram" in saved_tiers for m in (
            InternalTransfer(block=j, kind="d2h", window=forward_window(j + 1), fraction=1.0),
            InternalTransfer(block=j, kind="h2d", window=backward_window(j + 1), fraction=1.0)))
        d = dataclasses.replace(d, saved_tiers=saved_tiers, internal_transfers=moves)
        out[mode] = build_plan(problem, d, solver=SolveRecord(backend="manual"))
    return out


def moved_bytes(engine) -> tuple[int, int]:
    """(saved internals D2H + H2D, every byte the device API copied) in the last step."""
    saved = sum(sum(engine.saved.moved(0, w.name).values()) for w in engine.plan.windows)
    ledger = engine.dev.ledger.moved_by_window()
    return saved, sum(m["h2d"] + m["d2h"] for m in ledger.values())


def run(args, tmp: Path) -> dict:
    """mode -> list of (step wall s, step CPU s of the engine's thread, saved bytes, all bytes,
    summed f* windows ms, summed b* windows ms)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(args), dtype=torch.float32)
    adapter = adapter_from_model(model)
    by_mode = plans(adapter, args)
    engine = make_engine(adapter, by_mode["full"], device="cpu", nvme_dir=tmp / "nvme", lr=1e-4)
    times: dict = {m: [] for m in MODES}
    try:
        times["block"] = block_times(adapter, args)
        for mode in MODES:  # warm-up: allocator, threads, host pool
            engine.set_plan(by_mode[mode])
            engine.step([batch(args, 0)])
            engine.optimizer.wait_all()
        for r in range(args.rounds):
            for mode in MODES:
                engine.set_plan(by_mode[mode])
                engine.optimizer.wait_all()  # the last step's updates: not this step's time
                cpu0 = time.thread_time()
                stats = engine.step([batch(args, r + 1)])
                cpu = time.thread_time() - cpu0
                engine.optimizer.wait_all()
                fwd, bwd = (sum(ms for w, ms in stats.window_ms.items() if w[0] == k
                                and w[1:].isdigit()) for k in "fb")
                times[mode].append((stats.step_s, cpu,
                                    *moved_bytes(engine), fwd, bwd))
    finally:
        engine.close()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15, help="block-level repetitions")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        times = run(args, Path(tmp))
    block = times.pop("block")
    best = {m: (min(r[0] for r in v), min(r[1] for r in v), v[-1][2], v[-1][3],
                min(r[4] for r in v), min(r[5] for r in v)) for m, v in times.items()}
    print(f"{args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.rounds} interleaved rounds (best of), {args.threads} threads, cpu backend")
    print("| plan | step wall ms | engine thread CPU ms | f* windows ms | b* windows ms | "
          "saved D2H+H2D MB | all copied MB |")
    print("|---|---|---|---|---|---|---|")
    for mode, (wall, cpu, saved, copied, fwd, bwd) in best.items():
        print(f"| {mode} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {fwd:.1f} | {bwd:.1f} | "
              f"{saved / 1e6:.2f} | {copied / 1e6:.2f} |")
    for a, b in (("L0", "full"), ("L2 dram", "L0"), ("L2 hbm", "L0")):
        print(f"ratio {a} / {b}: step {best[a][0] / best[b][0]:.3f} wall, "
              f"{best[a][1] / best[b][1]:.3f} CPU; b* windows {best[a][5] / best[b][5]:.3f}")
    level_ratio = ((block["forward L2"] + block["backward L2"])
                   / (block["forward L0"] + block["backward L0"]))
    print(f"block 0 alone (best of {args.reps}, thread CPU ms): "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in block.items())
          + f"; f+b at L2 / at L0: {level_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
