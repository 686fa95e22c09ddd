"""`lazytrain simulate`: re-evaluate a saved plan with the fluid evaluator and the event simulator.

The problem is rebuilt from the plan's provenance config (or `--config`), optionally on other
hardware (`--hardware NAME_OR_FILE`), as one rank's share of the node for a data-parallel plan
(the problem the plan was made for), and both models are printed window by window with the
simulator's explanation of each disagreement; a stored prediction that differs from the
re-evaluation is warned about on stderr. Exit codes: 0 ok (disagreements are reported, not
errors); 1 the plan does not fit this problem (breaks a budget, or another block count); 2 bad
usage, config or plan file.
"""

from __future__ import annotations

import argparse
import json
import sys

from lazytrain.cli.plan import add_config_flags, load_problem
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.plan import Plan
from lazytrain.planner.build import rank_problem_of
from lazytrain.report.gantt import render_sim_gantt
from lazytrain.report.simulation import format_simulation, simulation_json
from lazytrain.sim import SimOptions, disagreements, simulate

SIM_WEIGHT_BUFFERS = SimOptions().weight_buffers
"""The simulated engine's weight buffers by default: the runtime's (`SimOptions`)."""
PREDICTED_REL_TOL = 1e-6
"""A stored `predicted.step_ms` further than this (relative) from the re-evaluation is warned
about: the plan was made for other costs (hardware, profile, model) or by an older planner."""

EPILOG = """\
examples:
  lazytrain plan --config configs/qwen3.6-27b-h800.yaml --out plan.json
  lazytrain simulate plan.json
  lazytrain simulate plan.json --hardware h100-pcie --gantt h100.png
"""


def register(subparsers) -> None:
    """Add the `simulate` subcommand."""
    p = subparsers.add_parser(
        "simulate", description=__doc__.split("\n\n")[1], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="plan.json", help="a plan written by `lazytrain plan --out`")
    add_config_flags(p)
    p.add_argument("--weight-buffers", type=int, default=SIM_WEIGHT_BUFFERS, metavar="N",
                   help=f"device weight buffers of the simulated engine (default "
                   f"{SIM_WEIGHT_BUFFERS}, the runtime's ring and what `plan` simulates; 3 "
                   f"serializes recompute loads)")
    p.add_argument("--gantt", metavar="sim.png", help="write the simulated timeline as PNG")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the plan, rebuild the problem, print the comparison. Returns the exit code."""
    plan = Plan.load(args.plan).validate()
    base = plan.provenance.get("config")
    if args.config is None and not base:
        raise ValueError(f"{args.plan}: provenance has no config; pass --config FILE.yaml")
    cfg, node_problem = load_problem(args, base=base)
    problem = rank_problem_of(cfg, node_problem)  # a data-parallel plan is one rank's share
    if problem.num_blocks != plan.num_blocks:
        print(f"error: {args.plan}: plan has {plan.num_blocks} blocks but the model has "
              f"{problem.num_blocks}; re-plan with `lazytrain plan`", file=sys.stderr)
        return 1
    opts = SimOptions(weight_buffers=args.weight_buffers)
    ev, sim = evaluate(problem, plan), simulate(problem, plan, options=opts)
    diffs = disagreements(problem, plan, options=opts)
    stored = plan.predicted.step_ms if plan.predicted else None
    if stored is not None and abs(stored - ev.step_ms) > PREDICTED_REL_TOL * abs(ev.step_ms):
        print(f"warning: {args.plan} predicts {stored:.1f} ms per step but this problem "
              f"evaluates it at {ev.step_ms:.1f} ms ({100 * (ev.step_ms / stored - 1):+.2f}%): "
              f"it was planned for other costs or by another planner version; re-plan with "
              f"`lazytrain plan`", file=sys.stderr)
    if args.json:
        print(json.dumps(simulation_json(ev, sim, diffs), indent=1))
    else:
        print(format_simulation(problem, ev, sim, diffs))
    if args.gantt:
        print(f"wrote {render_sim_gantt(sim, args.gantt, title=problem.name)}", file=sys.stderr)
    if ev.violations:
        print(f"error: {args.plan} breaks a budget of this problem: {'; '.join(ev.violations)}",
              file=sys.stderr)
        return 1
    return 0
