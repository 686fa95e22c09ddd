"""Truncated vs full re-forward: CPU engine step time, side by side in one run.

Run:  python benchmarks/truncated_reforward.py [--layers 6] [--hidden 512] [--seq 256]
          [--batch 1] [--rounds 4] [--threads 2]

A Llama-shaped model (intermediate 8/3 H), every boundary kept in HBM and no block kept, so
every block is re-forwarded in its own backward window b{j} (MegaTrain k=1). One engine runs
interleaved rounds of one step with the truncated re-forward (the default: no MLP down
projection in the re-forward, models/truncate.py) and one with the full re-forward
(`adapter.truncated_reforward = False`). Prints the best step and the best summed backward
windows (b*) of each, their ratios truncated / full, and the down projection's share of one
block forward by FLOPs (the ideal saving: one such share per re-forwarded block).
Ratios only matter; absolute times depend on the load. Not part of CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lazytrain.models import adapter_from_model
from lazytrain.planner.heuristics import megatrain_plan
from lazytrain.runtime.engine import Engine

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


def run(args, tmp: Path) -> dict[str, list[tuple[float, float]]]:
    """Per mode, (step s, summed backward windows ms) of each round."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(args), dtype=torch.float32)
    adapter = adapter_from_model(model)
    plan = megatrain_plan(make_problem(adapter, args), k=1)
    engine = Engine(adapter, plan, device="cpu", nvme_dir=tmp / "nvme", lr=1e-4)
    times: dict[str, list[tuple[float, float]]] = {"truncated": [], "full": []}
    try:
        engine.step([batch(args, 0)])  # warm-up: allocator, threads
        engine.optimizer.wait_all()
        for r in range(args.rounds):
            for mode in ("truncated", "full"):
                adapter.truncated_reforward = mode == "truncated"
                stats = engine.step([batch(args, r + 1)])
                engine.optimizer.wait_all()
                bwd = sum(ms for w, ms in stats.window_ms.items() if w.startswith("b"))
                times[mode].append((stats.step_s, bwd))
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
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        times = run(args, Path(tmp))
    best = {m: (min(s for s, _ in v), min(b for _, b in v)) for m, v in times.items()}
    print(f"{args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.rounds} interleaved rounds, {args.threads} threads, every block re-forwarded")
    for mode, (step_s, bwd_ms) in best.items():
        print(f"  {mode:>9}: best step {step_s * 1e3:8.1f} ms   backward windows {bwd_ms:8.1f} ms")
    print(f"step-time ratio truncated / full: {best['truncated'][0] / best['full'][0]:.3f}")
    print(f"backward-window ratio truncated / full: {best['truncated'][1] / best['full'][1]:.3f}")
    print(f"down projection share of one block forward (FLOPs): {down_share(args):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
