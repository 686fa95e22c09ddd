"""`lazytrain profile`: measure the cost model on this machine, or refit it from a run.

Measure (`--config`): per block kind forward / forward-with-autograd / backward time for the
configured micro-batch and sequence length, head and embedding time, H2D / D2H / duplex copy
rates and NVMe write / read through the activation store, each also while the CPU optimizer
runs, and on a CPU the contention model (`lazytrain.profile.profiler`). Refit (`--from-run
RUN_DIR`): least squares on the run's measured windows (`RUN_DIR/windows.jsonl`) under its
plan (`lazytrain.planner.refit`), starting from the profile the run used (or `--profile`).

Output: the profile JSON (`lazytrain.spec.costs` schema) to `--out` (atomically) or stdout;
`lazytrain plan --profile profile.json` (or `hardware.profile_path` in the
YAML) plans with it. Calibrate (`--calibrate`, with or without `--config`): measure this
machine's calibration for the config in the quick mode and store it in the calibration cache
(`lazytrain.profile.calibrate`; replaces the entry), which `lazytrain plan` and `lazytrain
train` then use with `runtime.calibrate: auto`; the cache file's path goes to stdout. Exit
codes: 0 ok; 2 bad usage, config or missing run files, or a config that is not for this
machine (`--calibrate`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lazytrain.atomic import write_json_atomic
from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.plan import Plan
from lazytrain.planner.refit import load_windows, refit_profile, select_windows
from lazytrain.profile.calibrate import calibrate, config_for_plan, local_device
from lazytrain.spec.model import ModelSpec
from lazytrain.train import setup
from lazytrain.units import GB

EPILOG = """examples:
  lazytrain profile --config configs/tiny-llama-cpu.yaml --out profile.json
  lazytrain profile --calibrate
  lazytrain profile --from-run runs/default --out profile.refit.json
  lazytrain plan --config configs/tiny-llama-cpu.yaml --profile profile.json
"""


def register(subparsers) -> None:
    """Add the `profile` subcommand."""
    p = subparsers.add_parser("profile", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE.yaml", help="run config to measure for "
                     "(default: the embedded default job)")
    src.add_argument("--from-run", metavar="RUN_DIR", help="refit from RUN_DIR/windows.jsonl "
                     "under RUN_DIR/plan.json")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's calibration (quick mode) into the calibration "
                   "cache (runtime.calibration_dir) instead of writing a profile")
    p.add_argument("--profile", metavar="profile.json", help="(--from-run) prior profile "
                   "(default: the run's hardware.profile_path or the calibration its plan "
                   "used, else analytic times)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", metavar="profile.json", help="write here (default: stdout)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--skip-steps", type=int, default=1,
                   help="(--from-run) warm-up steps left out of the fit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        if args.from_run or args.out:
            raise ValueError("--calibrate: measures into the calibration cache; drop "
                             "--from-run / --out (or drop --calibrate to write a profile)")
        return calibrate_cache(args)
    profile = refit_from_run(args) if args.from_run else measure(args)
    if args.out:
        write_json_atomic(Path(args.out), profile)
        print(f"profile written to {args.out}", file=sys.stderr)
    else:
        print(json.dumps(profile, indent=1))
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Load the configured model and run `profile.profiler.measure_profile`
    (`train.setup.measure_config_profile`, `--repeats` / `--warmup` runs per figure)."""
    cfg = load_config(args.config, args.overrides)
    device = local_device(cfg.runtime.device)
    if device is None:
        raise ValueError("runtime.device: cuda requested but torch sees no CUDA device; use "
                         "runtime.device=cpu")
    return setup.measure_config_profile(
        cfg, device, repeats=args.repeats, warmup=args.warmup,
        log=setup.to_stderr)


def calibrate_cache(args: argparse.Namespace) -> int:
    """`--calibrate`: measure this machine's calibration for the config into the cache (the
    entry is replaced), print the file's path."""
    cfg = load_config(args.config, args.overrides)
    costs = calibrate(cfg, setup.measure_calibration, log=setup.to_stderr)
    print(costs.path)
    return 0


def refit_from_run(args: argparse.Namespace) -> dict:
    """The run's prior profile refitted to its measured windows (planner.refit)."""
    run_dir = Path(args.from_run)
    for name in ("config.yaml", "plan.json"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} not found; is {run_dir} a run directory?")
    cfg = load_config(run_dir / "config.yaml", args.overrides)
    plan = Plan.load(run_dir / "plan.json")
    spec = ModelSpec.from_hf_config(cfg.model.config_path, name=cfg.model.name)
    # the costs the run planned with: its profile, else the calibration its plan names
    prior_path = args.profile or config_for_plan(cfg, plan.provenance).hardware.profile_path
    prior = json.loads(Path(prior_path).read_text()) if prior_path else \
        analytic_profile(problem_from_config(cfg), [b.kind for b in spec.blocks], cfg)
    windows = select_windows(load_windows(run_dir / "windows.jsonl"),
                             skip_steps=args.skip_steps)
    return refit_profile(prior, plan, [b.kind for b in spec.blocks], windows,
                         copies_overlap_compute=plan.provenance.get("hardware_spec", {}).get(
                             "copies_overlap_compute", True))


def analytic_profile(problem, kinds: list[str], cfg) -> dict:
    """A profile holding the problem's (analytic) times and rates: the prior of a refit."""
    block_kinds = {}
    for j, kind in enumerate(kinds):
        block_kinds.setdefault(kind, {"fwd_ms": problem.fwd_ms[j],
                                      "fwd_grad_ms": problem.fwd_grad_ms[j],
                                      "bwd_ms": problem.bwd_ms[j]})
    gb = GB
    return {"version": 1, "model_config_sha256": problem.provenance.get("model_config_sha256"),
            "seq_len": cfg.data.seq_len, "micro_batch": cfg.train.micro_batch,
            "compute_dtype": cfg.train.compute_dtype, "block_kinds": block_kinds,
            "ends": {"embed_ms": problem.embed_ms, "head_ms": problem.head_ms},
            "bandwidths": {"h2d_gb_per_s": problem.h2d_bytes_per_s / gb,
                           "d2h_gb_per_s": problem.d2h_bytes_per_s / gb,
                           "duplex_gb_per_s": problem.duplex_bytes_per_s / gb,
                           "nvme_read_gb_per_s": problem.nvme_read_bytes_per_s / gb,
                           "nvme_write_gb_per_s": problem.nvme_write_bytes_per_s / gb}}
