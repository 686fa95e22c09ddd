"""The default job over several seeds: held-out exact match before and after, and wall time.

Run:  python benchmarks/default_job.py [--seeds 0 1 2] [--out default_job.json]

Each seed runs exactly the README's main job (`lazytrain train`, the embedded arithmetic
problems and SmolLM2-135M-Instruct with the default config) with `train.seed` set, which
draws a different set of problems, held-out prompts and data order. Prints per seed the
exact match before and after training (k/16), the eval loss, the wall time of the whole
command and its parts (from summary.json), and the first held-out sample before and after.
The target: every seed at least 4/16 after training, the whole command within 5 minutes on
2 cores. Wall times depend on what else runs on the machine; the exact-match numbers do
not (the run is deterministic for a seed). Not part of CI: CI tests the task and the scorer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_CORRECT = 4
"""Held-out problems (of 16) every seed must get right after training."""
BUDGET_S = 300.0
"""The job's wall-time budget on 2 cores, s."""


def run_seed(seed: int, run_dir: Path) -> dict:
    """One `lazytrain train` of the default job; returns its summary plus the command's wall s."""
    cmd = [sys.executable, "-m", "lazytrain.cli.main", "train", "--run-dir", str(run_dir),
           "--set", f"train.seed={seed}", "--no-progress"]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"seed {seed}: lazytrain train exited {res.returncode}:\n"
                           f"{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "command_wall_s": wall_s, "summary": summary}


def describe(result: dict) -> list[str]:
    """Human-readable lines for one seed."""
    s = result["summary"]
    before, after = s["eval_before"], s["eval_after"]
    hits = [e["num_correct"] for e in (before, after)]
    t = s["timings_s"]
    lines = [f"seed {result['seed']}: exact match {hits[0]}/{before['num_scored']} -> "
             f"{hits[1]}/{after['num_scored']}, eval loss {before['loss']:.3f} -> "
             f"{after['loss']:.3f}, {s['steps_completed']} steps; wall "
             f"{result['command_wall_s']:.0f} s (set-up {t['setup_s']:.0f}, evals "
             f"{t['eval_before_s'] + t['eval_after_s']:.0f}, train {t['train_s']:.0f}, "
             f"{s['mean_step_s']:.2f} s/step)"]
    for when, ev in (("before", before), ("after", after)):
        sample = ev["samples"][0]
        wrote = " / ".join(ln.strip() for ln in sample["generated"].strip().splitlines())
        lines.append(f"  {when}: {wrote!r} -> {sample['predicted']} (expected "
                     f"{sample['answer']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, help="write every seed's summary here (JSON)")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="default-job-") as tmp:
        for seed in args.seeds:
            results.append(run_seed(seed, Path(tmp) / f"seed-{seed}"))
            print("\n".join(describe(results[-1])), flush=True)
    correct = [r["summary"]["eval_after"]["num_correct"] for r in results]
    walls = [r["command_wall_s"] for r in results]
    ok = min(correct) >= TARGET_CORRECT
    print(f"after training: {correct} of 16 (target >= {TARGET_CORRECT} each: "
          f"{'met' if ok else 'MISSED'}); command wall {min(walls):.0f}-{max(walls):.0f} s "
          f"(budget {BUDGET_S:.0f} s on 2 cores)")
    if args.out:
        tmp_out = args.out.with_name(f".{args.out.name}.tmp")
        tmp_out.write_text(json.dumps(results, indent=1))
        tmp_out.replace(args.out)
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
