"""Truncated vs full re-forward: CPU engine step time, side by side in one run.

Run:  python benchmarks/truncated_reforward.py [--layers 6] [--hidden 512] [--seq 256]
          [--batch 1] [--rounds 5] [--reps 15] [--threads 1]

A Llama-shaped model (intermediate 8/3 H), every boundary kept in HBM and no block kept, so
every block is re-forwarded in its own backward window b{j} (MegaTrain k=1). One engine runs
interleaved rounds of one step with the truncated re-forward (the default: no MLP down
projection in the re-forward, models/truncate.py) and one with the full re-forward
(`adapter.truncated_reforward = False`). Prints the best step (wall, and CPU time of the
process: less sensitive to other processes on a shared machine) and the best summed backward
windows (b*) of each, their ratios truncated / full, the same ratio for one block's
re-forward + backward timed alone (less noise on a shared machine), and the down projection's
share of one block forward by FLOPs (the ideal saving: one such share per re-forwarded block).
Ratios only matter; absolute times depend on the load. Not part of CI.

A run on the 2-core shared development machine (load average ~8, torch CPU build, defaults):
step 0.921 wall / 0.959 CPU (718.3 vs 748.7 ms CPU), backward windows 0.845, block 0 alone
0.922 (63.5 vs 68.8 ms CPU); the FLOP model gives 1 - 0.213 / 3 = 0.929 for one block's
`Fg + B` (backward = 2 forwards), and about 0.95 for the whole step (~4.3 forward-equivalents
per block with the head). A second run: step 0.903 wall / 0.941 CPU, block 0 alone 0.947.
Wall ratios swing by +-0.1 between runs under that load (0.79 and 1.02 seen in earlier
wall-only runs); the CPU-time ratios within ~0.02.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lazytrain.models import adapter_from_model
from lazytrain.planner.heuristics import megatrain_plan
from lazytrain.runtime.block_autograd import grad_leaves
from lazytrain.runtime.build import make_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import batch, make_config, make_problem  # noqa: E402


def down_share(args) -> float:
    """FLOPs of the down projection / FLOPs of one block forward (projections + attention
    scores and values, causal: half of the S x S products), from the shapes."""
    tokens, hidden, inter = args.batch * args.seq, args.hidden, args.hidden * 8 // 3
    down = 2 * tokens * hidden * inter
    mlp = 3 * down
    attn_proj = 4 * 2 * tokens * hidden * hidden
    scores = 2 * 2 * args.batch * args.seq * args.seq * hidden / 2
    return down / (mlp + attn_proj + scores)


def block_times(adapter, args) -> dict[str, float]:
    """Per mode, the best of `args.reps` interleaved re-forward + backward of block 0 alone
    (`Fg + B`), in CPU seconds of this thread (compute runs on it with one torch thread): the
    same comparison without the step's other windows, and without other processes' load."""
    group = adapter.params.blocks[0]
    x0 = torch.randn(args.batch, args.seq, args.hidden)
    grad = torch.randn_like(x0)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    kwargs = adapter.block_kwargs(ids, x0)[0]
    best = {"truncated": float("inf"), "full": float("inf")}
    for _ in range(args.reps):
        for mode in best:
            adapter.truncated_reforward = mode == "truncated"
            t0 = time.thread_time()
            x = x0.clone().requires_grad_()
            leaves = grad_leaves(group, group.master)
            with torch.enable_grad():
                out = adapter.forward_block(0, x, leaves, kwargs, truncated=True)
            torch.autograd.grad([out], (x, *leaves.values()), [grad])
            best[mode] = min(best[mode], time.thread_time() - t0)
    return best


def run(args, tmp: Path) -> dict:
    """Per mode, (step wall s, summed backward windows ms, step CPU s of the process) of each
    round; "block": `block_times`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(args), dtype=torch.float32)
    adapter = adapter_from_model(model)
    plan = megatrain_plan(make_problem(adapter, args), k=1)
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp / "nvme", lr=1e-4)
    times: dict = {"truncated": [], "full": []}
    try:
        engine.step([batch(args, 0)])  # warm-up: allocator, threads
        engine.optimizer.wait_all()
        times["block"] = block_times(adapter, args)
        for r in range(args.rounds):
            for mode in ("truncated", "full"):
                adapter.truncated_reforward = mode == "truncated"
                cpu0 = time.process_time()
                stats = engine.step([batch(args, r + 1)])
                engine.optimizer.wait_all()
                bwd = sum(ms for w, ms in stats.window_ms.items() if w.startswith("b"))
                times[mode].append((stats.step_s, bwd, time.process_time() - cpu0))
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
    ap.add_argument("--reps", type=int, default=15, help="block-level repetitions per mode")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        times = run(args, Path(tmp))
    block = times.pop("block")
    best = {m: tuple(min(r[i] for r in v) for i in range(3)) for m, v in times.items()}
    print(f"{args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.rounds} interleaved rounds, {args.threads} threads, every block re-forwarded")
    for mode, (step_s, bwd_ms, cpu_s) in best.items():
        print(f"  {mode:>9}: best step {step_s * 1e3:8.1f} ms wall, {cpu_s * 1e3:8.1f} ms CPU; "
              f"backward windows {bwd_ms:8.1f} ms")
    ratio = [best["truncated"][i] / best["full"][i] for i in range(3)]
    print(f"step-time ratio truncated / full: {ratio[0]:.3f} wall, {ratio[2]:.3f} CPU")
    print(f"backward-window ratio truncated / full: {ratio[1]:.3f}")
    print(f"block 0 re-forward + backward (best of {args.reps}): truncated "
          f"{block['truncated'] * 1e3:.1f} ms, full {block['full'] * 1e3:.1f} ms, ratio "
          f"{block['truncated'] / block['full']:.3f}")
    print(f"down projection share of one block forward (FLOPs): {down_share(args):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
