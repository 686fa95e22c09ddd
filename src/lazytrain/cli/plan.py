"""`lazytrain plan`: solve the activation placement for a run config and print the plan.

Reads the run config (YAML + flags named after config keys + `--set section.key=value`),
builds the PlanningProblem, plans with the chosen policy, and prints a table: boundaries per
tier, recomputed blocks, keep-internals, save levels (blocks per level and tier, their saved
bytes), predicted step time / model TFLOPS / tokens/s / peak HBM next to the MegaTrain rule and
the bounds, the solver record, and the event simulator's check. `--out` writes the Plan JSON, `--gantt` the simulated timeline (both atomically, paths
on stderr). The costs are those `lazytrain train` would plan with
(`profile.calibrate.resolve_profile`: `hardware.profile_path`, else this machine's cached
calibration, else the preset's analytic model); the table's `costs:` line says which (stderr
with `--json`). Exit codes: 0 ok; 1 no plan fits the budgets; 2 bad usage or config.

This module parses, calls and prints: the problem comes from
`profile.calibrate.costed_problem` (one rank's share through `planner.topology`), the plan
from `planner.policy.plan`, the texts from `report.plan_table` and `report.capacity`. It
imports neither torch nor transformers, even with a calibration cached (`profile.machine`).
"""

from __future__ import annotations

import argparse
import json
import sys

from lazytrain.config import apply_overrides, config_from_dict, load_config
from lazytrain.config.dpo import planning_config
from lazytrain.config.grpo import check_grpo_rows
from lazytrain.planner import policy
from lazytrain.planner.build import hardware_from_config, rank_problem_from_config, topology_of
from lazytrain.planner.capacity import max_batch_search
from lazytrain.planner.grpo_phase import grpo_plan_lines
from lazytrain.planner.infeasible import PlanInfeasibleError, shortfall_fix
from lazytrain.planner.inference_plans import summary_lines as inference_lines
from lazytrain.planner.policy import BACKENDS, POLICIES, planner_options
from lazytrain.planner.solvers import solver_output_to_stderr
from lazytrain.planner.topology import rank_problem, scaling_table
from lazytrain.profile.calibrate import costed_problem, costs_line_of
from lazytrain.report.capacity import format_batch_table, over_dram_hint
from lazytrain.report.capacity import scaling_text as format_scaling
from lazytrain.report.gantt import render_sim_gantt
from lazytrain.report.plan_table import format_plan_table, plan_comparison
from lazytrain.sim import simulate
from lazytrain.spec.model import read_hf_config

FLAG_KEYS = {
    "model": "model.config_path",
    "hardware": "hardware.preset",
    "profile": "hardware.profile_path",
    "seq_len": "data.seq_len",
    "micro_batch": "train.micro_batch",
    "grad_accum": "train.grad_accum",
    "policy": "planner.policy",
    "backend": "planner.backend",
    "time_limit_s": "planner.time_limit_s",
    "gap": "planner.gap",
    "k_max": "planner.k_max",
    "megatrain_k": "planner.megatrain_k",
    "nproc_per_node": "dist.nproc_per_node",
    "nnodes": "dist.nnodes",
    "allow_implausible": "hardware.allow_implausible",
}
"""argparse dest -> the config key the flag sets (flags are named after config keys)."""

EPILOG = """\
examples:
  lazytrain plan --config configs/qwen3.6-27b-h800.yaml --out plan.json --gantt plan.png
  lazytrain plan --config configs/qwen3.6-27b-h800.yaml --policy heuristic --micro-batch 36
  lazytrain plan --config configs/qwen3.6-27b-h800.yaml --policy heuristic --max-batch \\
      --hardware h200 --grad-accums 1,4
  lazytrain plan --model smollm2-135m-instruct --hardware h100-pcie --seq-len 4096 \\
      --micro-batch 8 --set planner.time_limit_s=30 --json
"""


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """The flags that set config keys (shared by `plan` and `simulate`)."""
    p.add_argument("--config", metavar="FILE.yaml", help="run config YAML (default: built-in job)")
    p.add_argument("--model", metavar="CONFIG_JSON", help="model.config_path: HF config.json, "
                   "model dir or built-in name")
    p.add_argument("--hardware", metavar="NAME_OR_FILE",
                   help="hardware.preset: preset name (h800-paper, h100-sxm, cpu, ...) or file")
    p.add_argument("--profile", metavar="profile.json",
                   help="hardware.profile_path: measured costs from `lazytrain profile`")
    p.add_argument("--seq-len", type=int, metavar="N", help="data.seq_len, tokens")
    p.add_argument("--micro-batch", type=int, metavar="N", help="train.micro_batch, sequences")
    p.add_argument("--grad-accum", type=int, metavar="N", help="train.grad_accum, micro-batches")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key (repeatable; named flags win over --set)")
    p.add_argument("--allow-implausible", action="store_const", const=True, default=None,
                   help="hardware.allow_implausible: accept hardware figures outside their "
                   "plausible range (by default refused as a likely unit mistake)")


def register(subparsers) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser(
        "plan", description=__doc__.split("\n\n")[1], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    p.add_argument("--policy", choices=POLICIES, help="planner.policy")
    p.add_argument("--backend", choices=BACKENDS, help="planner.backend (MILP solver)")
    p.add_argument("--time-limit-s", type=float, metavar="S", help="planner.time_limit_s")
    p.add_argument("--gap", type=float, metavar="G", help="planner.gap (relative, 0.005 = 0.5%%)")
    p.add_argument("--k-max", type=int, metavar="K", help="planner.k_max (longest segment)")
    p.add_argument("--megatrain-k", type=int, metavar="K", help="planner.megatrain_k")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="dist.nproc_per_node: plan one of N ranks sharing the node's DRAM, NVMe "
                        "and PCIe switches, and print the predicted 1/2/4/8-rank scaling table")
    p.add_argument("--nnodes", type=int, metavar="M",
                   help="dist.nnodes: nodes in the job (Adam moments sharded over all ranks)")
    p.add_argument("--out", metavar="plan.json", help="write the Plan JSON here")
    p.add_argument("--gantt", metavar="plan.png", help="write the simulated timeline as PNG")
    p.add_argument("--json", action="store_true",
                   help="print the plan JSON and the comparison instead of the table")
    p.add_argument("--max-batch", action="store_true",
                   help="instead of one plan: the largest micro-batch with a feasible plan "
                        "(planner's memory model; policy milp or heuristic) and the predicted "
                        "tokens/s of candidate batches (analytic costs: a calibration holds "
                        "one micro-batch)")
    p.add_argument("--grad-accums", metavar="N,N,...",
                   help="with --max-batch: accumulation candidates (default: 1 and "
                        "train.grad_accum)")
    p.set_defaults(func=run)


def config_overrides(args: argparse.Namespace) -> list[str]:
    """`--set` strings followed by the named flags as `section.key=value` (flags win)."""
    out = list(args.set)
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            # JSON text is valid YAML: strings stay strings ("on", "1e3" are not reinterpreted)
            out.append(f"{key}={json.dumps(value)}")
    return out


def load_problem(args: argparse.Namespace, *, base: dict | None = None):
    """(RunConfig, PlanningProblem of the node) from `--config` (or `base`, a resolved config
    dict) + flags.

    The costs are resolved as `lazytrain train` resolves them
    (`profile.calibrate.costed_problem`), except that a missing calibration is not measured
    here: the problem is then analytic and its provenance `costs` note says that `lazytrain
    train` (or `lazytrain profile --calibrate`) measures one. The returned config is the one
    given (without the cache file as `hardware.profile_path`).

    Raises:
        ValueError, TypeError, FileNotFoundError: bad config (main prints one line, exit 2).
    """
    overrides = config_overrides(args)
    if args.config is None and base is not None:
        cfg = apply_overrides(config_from_dict(base), overrides)
    else:
        cfg = load_config(args.config, overrides)
    cfg = planning_config(cfg)  # DPO: 2 rows per pair, as the trainer plans
    check_grpo_rows(cfg)  # GRPO: the rollouts fill the micro-batches, as the trainer checks
    return cfg, costed_problem(cfg, log=lambda msg: print(msg, file=sys.stderr))


def run(args: argparse.Namespace) -> int:
    """Plan, compare, print; write --out / --gantt. Returns the exit code."""
    cfg, node_problem = load_problem(args)
    if getattr(args, "max_batch", False):
        return run_max_batch(args, cfg)
    topo = topology_of(cfg)  # data parallel: one rank's share of the node
    problem = node_problem if topo is None else rank_problem(node_problem, topo)
    options = policy.planner_options(cfg.planner)
    try:
        with solver_output_to_stderr():
            plan = policy.plan(problem, options)
            report = plan_comparison(problem, plan, options)
    except PlanInfeasibleError as exc:
        if topo is not None:  # which rank counts do fit, and what to change
            print(scaling_text(node_problem, topo, options))
            exc = f"{exc}; {over_dram_hint(topo)}"
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(costs_line_of(plan.provenance), file=sys.stderr)
        print(json.dumps({"plan": plan.to_dict(), "comparison": report}, indent=1))
    else:
        print(format_plan_table(problem, plan, report, costs_line=costs_line_of(plan.provenance)))
        print("\n".join(inference_lines(
            problem, read_hf_config(cfg.model.config_path),
            hbm_bytes_per_s=hardware_from_config(cfg).hbm_bandwidth_bytes_per_s)))
        if cfg.train.method == "grpo":  # its generation phase and its training phase
            print("\n".join(grpo_plan_lines(
                problem, read_hf_config(cfg.model.config_path), plan=plan, grpo=cfg.grpo,
                compute_dtype=cfg.train.compute_dtype,
                hbm_bytes_per_s=hardware_from_config(cfg).hbm_bandwidth_bytes_per_s)))
        if topo is not None:
            print(scaling_text(node_problem, topo, options))
    write_outputs(problem, plan, out=args.out, gantt=args.gantt)
    violations = plan.provenance.get("violations") or []
    if violations and options.policy != "ideal":
        fixes = [shortfall_fix(v.split()[0], problem) for v in violations]  # "HBM short by ..."
        print(f"error: the {options.policy} plan breaks {len(violations)} budget(s): "
              f"{'; '.join(violations)}; {'; '.join(dict.fromkeys(fixes))}", file=sys.stderr)
        return 1
    return 0


def run_max_batch(args: argparse.Namespace, cfg) -> int:
    """`--max-batch`: search the largest feasible micro-batch (planner/capacity.py), print the
    table or `--json`. Exit 1 when not even one sequence fits."""
    try:
        accums = ([int(x) for x in args.grad_accums.split(",")] if args.grad_accums
                  else [1, cfg.train.grad_accum])
    except ValueError:
        raise ValueError(f"--grad-accums: {args.grad_accums!r} is not a comma-separated list "
                         f"of integers; e.g. 1,4") from None

    def problem_at(m: int, g: int):  # one rank's share when data parallel
        return rank_problem_from_config(apply_overrides(
            cfg, [f"train.micro_batch={m}", f"train.grad_accum={g}"]))

    with solver_output_to_stderr():
        search = max_batch_search(problem_at, planner_options(cfg.planner), grad_accums=accums)
    if args.json:
        print(json.dumps({"max_batch": search.to_dict()}, indent=1))
    else:
        title = (f"max batch for {cfg.model.name or cfg.model.config_path} on "
                 f"{cfg.hardware.preset}, seq {cfg.data.seq_len}:")
        print(format_batch_table(search, title=title))
    if search.max_micro_batch == 0:
        print(f"error: not even micro_batch 1 fits: {search.rows[-1].violation}; raise the "
              f"budget or shrink data.seq_len", file=sys.stderr)
        return 1
    return 0


def scaling_text(node_problem, topo, options) -> str:
    """The predicted scaling table (`planner.topology.scaling_table`, text from
    `report.capacity`); MILP is replaced by the heuristic there (four solves would take
    minutes)."""
    if options.policy == "milp":
        options = options.replace(policy="heuristic")
    with solver_output_to_stderr():
        rows = scaling_table(node_problem, topo, options)
    return format_scaling(rows, topo, policy=options.policy)


def write_outputs(problem, plan, *, out: str | None, gantt: str | None) -> None:
    """Write the plan JSON and the Gantt PNG atomically; print their paths on stderr."""
    if out:
        print(f"wrote {plan.save(out)}", file=sys.stderr)
    if gantt:
        title = f"{problem.name}: simulated micro-batch"
        print(f"wrote {render_sim_gantt(simulate(problem, plan), gantt, title=title)}",
              file=sys.stderr)
