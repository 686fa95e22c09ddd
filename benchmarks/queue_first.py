"""Host waits before a window's first compute op and implicit syncs per micro-batch, per plan kind.

Run:  python benchmarks/queue_first.py [--layers 4] [--hidden 128] [--seq 64] [--batch 2]
          [--grad-accum 2] [--steps 2]

Each plan kind (tiers all hbm / all dram / all nvme / mixed / recompute segments of 2, with
clipping and without: early per-block updates) runs `--steps` optimizer steps on the
`cpu-checked` backend, which records every host wait of the engine's thread made in a window
before that window's first compute op (`runtime/queue_audit.py`) and every implicit
host-device sync (`item`, `float`, `bool`, `tolist`, `.cpu()` of a device tensor:
`runtime/sync_audit.py`) per phase. Prints one JSON line per (plan kind, clipping): early waits
per micro-batch by window and what they wait for, implicit syncs per micro-batch, and explicit
step-end syncs per step. Goal: 0 and 0 (a segment's first recompute load is the one wait the
plan charges in its window: `R[s,e]`, docs/execution_model.md). Counts, not times: the figures
do not depend on the machine's load. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from instrument_overhead import TIERS, batch, make_adapter, make_plan  # noqa: E402

from lazytrain.runtime.backends import make_device  # noqa: E402
from lazytrain.runtime.build import make_engine  # noqa: E402

KINDS = {**TIERS, "hbm": lambda L: ["hbm"] * (L + 1), "dram": lambda L: ["dram"] * L + ["hbm"],
         "segments_of_2": lambda L: ["hbm", "recompute"] * (L // 2) + ["hbm"] * (L % 2 + 1)}


TIERS.update(KINDS)  # make_plan reads its tiers there


def measure(args, kind: str, clip: float) -> dict:
    args.tiers = kind
    adapter = make_adapter(args)
    plan = make_plan(adapter, args)
    dev = make_device("cpu-checked", seed=0)
    with tempfile.TemporaryDirectory() as nvme:
        engine = make_engine(adapter, plan, device=dev, nvme_dir=Path(nvme),
                             grad_accum=args.grad_accum, lr=1e-3, clip_grad_norm=clip)
        try:
            for step in range(args.steps):
                engine.step([batch(args, args.grad_accum * step + m)
                             for m in range(args.grad_accum)])
        finally:
            engine.close()
    micro = args.steps * args.grad_accum
    waits = Counter(w for w in dev.queue_audit.early_waits)
    return {"plan": kind, "clip": clip, "micro_batches": micro,
            "early_waits_per_micro_batch": len(dev.queue_audit.early_waits) / micro,
            "early_waits": {k: v / micro for k, v in sorted(waits.items())},
            "implicit_syncs_per_micro_batch":
                len(dev.implicit_syncs.get("micro_batch", [])) / micro,
            "step_end_syncs_per_step": len(dev.implicit_syncs.get("step_end", [])) / args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    for kind in KINDS:
        for clip in (1.0, 0.0):
            print(json.dumps(measure(args, kind, clip)), flush=True)


if __name__ == "__main__":
    main()
