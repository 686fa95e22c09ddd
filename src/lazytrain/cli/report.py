"""`lazytrain report`: predicted (the plan) vs measured (RUN_DIR/windows.jsonl), per window.

Prints the per-window table and the totals (step time, exposed time per channel, peak HBM
checkpoint bytes) and names the windows where the cost model is most wrong; `--gantt` draws
the planned and the measured timeline one above the other. Exit codes: 0 ok; 2 bad usage or a
missing/unreadable run directory or plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median_low

from lazytrain.atomic import read_jsonl
from lazytrain.report.gantt import (bars_from_measured, bars_from_planned, render_panels,
                                    spans_from_durations)
from lazytrain.report.tables import compare_with_run, format_table, plan_id_of_dict

EPILOG = """\
examples:
  lazytrain train --config configs/tiny-llama-cpu.yaml --run-dir runs/tiny --steps 6
  lazytrain report runs/tiny --gantt runs/tiny/gantt.png
  lazytrain report runs/tiny --plan other_plan.json --force --json --skip-steps 2
"""


def register(subparsers) -> None:
    """Add the `report` subcommand."""
    p = subparsers.add_parser(
        "report", description=__doc__.split("\n\n")[1], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with windows.jsonl")
    p.add_argument("--plan", metavar="plan.json", help="the plan to compare with (default: "
                   "RUN_DIR/plan.json); refused when the run measured another plan")
    p.add_argument("--force", action="store_true",
                   help="with --plan: compare even when its digest is not the run's plan_id")
    p.add_argument("--skip-steps", type=int, default=1, metavar="N",
                   help="warm-up steps left out of the medians (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--gantt", metavar="out.png", help="write planned vs measured timelines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, compare, print; returns the exit code."""
    run_dir = Path(args.run_dir)
    plan_path = Path(args.plan) if args.plan else run_dir / "plan.json"
    if args.skip_steps < 0:
        raise ValueError(f"--skip-steps must be >= 0; got {args.skip_steps}")
    if not (run_dir / "windows.jsonl").is_file() and (run_dir / "rank-0").is_dir():
        raise FileNotFoundError(f"{run_dir} is a data-parallel run: each rank measured its own "
                                f"windows; pass one rank's directory, e.g. `lazytrain report "
                                f"{run_dir / 'rank-0'}`")
    if not (run_dir / "windows.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir / 'windows.jsonl'}: no measured windows; run "
                                "`lazytrain train --run-dir RUN_DIR` first")
    if not plan_path.is_file():
        raise FileNotFoundError(f"{plan_path}: no plan; pass --plan plan.json")
    plan_dict = json.loads(plan_path.read_text())
    records = read_jsonl(run_dir / "windows.jsonl")
    if args.plan and not args.force:
        check_plan_of_run(plan_dict, records, plan_path=plan_path)
    comparison = compare_with_run(plan_dict, records, skip_steps=args.skip_steps)
    if args.json:
        print(json.dumps(comparison.to_dict(), indent=1))
    else:
        print(format_table(comparison))
    if args.gantt:
        path = render_comparison_gantt(args.gantt, plan_dict=plan_dict, records=records,
                                       steps=comparison.steps_used, plan_id=comparison.plan_id)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def check_plan_of_run(plan_dict: dict, records: list[dict], *, plan_path: Path) -> None:
    """Refuse a plan the run did not measure (its digest is none of the records' plan_id).

    Records without a plan_id (older runs) cannot be checked and are accepted.

    Raises:
        ValueError: one line naming the file, both digests and `--force`.
    """
    measured = sorted({r["plan_id"] for r in records if r.get("plan_id")})
    pid = plan_id_of_dict(plan_dict)
    if measured and pid not in measured:
        raise ValueError(f"--plan: {plan_path} has digest {pid} but the run measured plan "
                         f"{', '.join(measured)}; pass the run's plan.json, or --force to "
                         f"compare anyway")


def render_comparison_gantt(path, *, plan_dict: dict, records: list[dict], steps: list[int],
                            plan_id: str) -> Path:
    """Planned timeline (plan windows back to back) above one measured micro-batch: the
    median-length step of `steps`, its micro-batch 0."""
    planned = list(plan_dict.get("windows", []))
    p_spans = spans_from_durations([w["name"] for w in planned], [w["time_ms"] for w in planned])
    mine = [r for r in records if r["step"] in steps and r["micro_batch"] == 0]
    totals = {r["step"]: sum(w["wall_ms"] for w in r["windows"]) for r in mine}
    pick = median_low(sorted(totals.values()))
    rec = next(r for r in mine if totals[r["step"]] == pick)
    m_spans = spans_from_durations([w["name"] for w in rec["windows"]],
                                   [w["wall_ms"] for w in rec["windows"]])
    return render_panels(path, panels=[
        (bars_from_planned(planned, p_spans), p_spans,
         f"planned (plan {plan_id}), {p_spans[-1].end_ms if p_spans else 0:.1f} ms per micro-batch"
         " excluding pre/post"),
        (bars_from_measured(rec["windows"], m_spans), m_spans,
         f"measured: step {rec['step']} micro-batch 0, {m_spans[-1].end_ms:.1f} ms "
         "(schematic within a window: compute, then waits per channel)"),
    ])
