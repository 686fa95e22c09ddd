"""`lazytrain plan`: solve the activation placement for a run config and print the plan.

Reads the run config (YAML + flags named after config keys + `--set section.key=value`),
builds the PlanningProblem, plans with the chosen policy, and prints a table: boundaries per
tier, recomputed blocks, keep-internals, predicted step time / model TFLOPS / tokens/s / peak
HBM next to the MegaTrain rule and the bounds, the solver record, and the event simulator's
check. `--out` writes the Plan JSON, `--gantt` the simulated timeline (both atomically, paths
on stderr). The costs are those `lazytrain train` would plan with
(`runtime.calibrate.resolve_profile`: `hardware.profile_path`, else this machine's cached
calibration, else the preset's analytic model); the table's `costs:` line says which (stderr
with `--json`). Exit codes: 0 ok; 1 no plan fits the budgets; 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import sys

from lazytrain.planner.solvers import solver_output_to_stderr

POLICIES = ("milp", "heuristic", "megatrain", "ideal")

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
  lazytrain plan --model ../shared/models/qwen3-8b.json --hardware h100-pcie --seq-len 4096 \\
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
        "plan", help="choose where each block-boundary activation lives and print the plan",
        description=__doc__.split("\n\n")[1], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    p.add_argument("--policy", choices=POLICIES, help="planner.policy")
    p.add_argument("--backend", choices=("auto", "scip", "highs"), help="planner.backend (MILP solver)")
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
    """(RunConfig, PlanningProblem) from `--config` (or `base`, a resolved config dict) + flags.

    The costs are resolved as `lazytrain train` resolves them
    (`runtime.calibrate.resolve_profile`), except that a missing calibration is not measured
    here: the problem is then analytic and its provenance `costs` note says that `lazytrain
    train` (or `lazytrain profile --calibrate`) measures one. The returned config is the one
    given (without the cache file as `hardware.profile_path`).

    Raises:
        ValueError, TypeError, FileNotFoundError: bad config (main prints one line, exit 2).
    """
    from lazytrain.config import apply_overrides, config_from_dict, load_config
    from lazytrain.planner.build import problem_from_config
    from lazytrain.runtime.calibrate import resolve_profile

    overrides = config_overrides(args)
    if args.config is None and base is not None:
        cfg = apply_overrides(config_from_dict(base), overrides)
    else:
        cfg = load_config(args.config, overrides)
    costs = resolve_profile(cfg, log=lambda msg: print(msg, file=sys.stderr))
    return cfg, costs.annotate(problem_from_config(costs.config))


def run(args: argparse.Namespace) -> int:
    """Plan, compare, print; write --out / --gantt. Returns the exit code."""
    from lazytrain.planner.milp import PlanInfeasibleError
    from lazytrain.planner.policy import plan_with_policy

    cfg, problem = load_problem(args)
    if getattr(args, "max_batch", False):
        return run_max_batch(args, cfg)
    node_problem, topo = problem, None
    if cfg.dist.nproc_per_node > 1 or cfg.dist.nnodes > 1:  # data parallel: one rank's share
        from lazytrain.planner.build import hardware_from_config
        from lazytrain.planner.topology import rank_problem, topology_from_config
        topo = topology_from_config(cfg, hardware_from_config(cfg))
        problem = rank_problem(problem, topo)
    pc = cfg.planner
    kw = dict(backend=pc.backend, time_limit_s=pc.time_limit_s, gap=pc.gap,
              threads=pc.threads, seed=pc.seed, megatrain_k=pc.megatrain_k)
    try:
        with solver_output_to_stderr():
            plan = plan_with_policy(problem, pc.policy, **kw)
            baseline = plan if pc.policy == "megatrain" else plan_with_policy(
                problem, "megatrain", lp_bound=False, **kw)
    except PlanInfeasibleError as exc:
        if topo is not None:  # which rank counts do fit, and what to change
            print(scaling_text(node_problem, topo, kw, policy=pc.policy))
            exc = (f"{exc}; with {topo.nproc_per_node} ranks per node each gets "
                   f"1/{topo.nproc_per_node} of the node's DRAM: use fewer ranks per node "
                   f"(table above)" + ("" if topo.shared_masters else
                                       " or dist.shared_masters: true (one master copy per "
                                       "node)"))
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from lazytrain.planner.heuristics import best_fixed_k_plan

    report = build_report(problem, plan, baseline, policy=pc.policy, megatrain_k=pc.megatrain_k,
                          best_fixed=best_fixed_k_plan(problem))
    if args.json:
        from lazytrain.runtime.calibrate import costs_line_of

        print(costs_line_of(plan.provenance), file=sys.stderr)
        print(json.dumps({"plan": plan.to_dict(), "comparison": report}, indent=1))
    else:
        print(format_table(problem, plan, report))
        if topo is not None:
            print(scaling_text(node_problem, topo, kw, policy=pc.policy))
    write_outputs(problem, plan, out=args.out, gantt=args.gantt)
    violations = plan.provenance.get("violations") or []
    if violations and pc.policy != "ideal":
        from lazytrain.planner.feasibility import shortfall_fix

        fixes = [shortfall_fix(v.split()[0], problem) for v in violations]  # "HBM short by ..."
        print(f"error: the {pc.policy} plan breaks {len(violations)} budget(s): "
              f"{'; '.join(violations)}; {'; '.join(dict.fromkeys(fixes))}", file=sys.stderr)
        return 1
    return 0


def run_max_batch(args: argparse.Namespace, cfg) -> int:
    """`--max-batch`: search the largest feasible micro-batch (planner/capacity.py), print the
    table or `--json`. Exit 1 when not even one sequence fits."""
    from lazytrain.config import apply_overrides
    from lazytrain.planner.build import hardware_from_config, problem_from_config
    from lazytrain.planner.capacity import format_batch_table, max_batch_search

    try:
        accums = ([int(x) for x in args.grad_accums.split(",")] if args.grad_accums
                  else [1, cfg.train.grad_accum])
    except ValueError:
        raise ValueError(f"--grad-accums: {args.grad_accums!r} is not a comma-separated list "
                         f"of integers; e.g. 1,4") from None
    topo = None
    if cfg.dist.nproc_per_node > 1 or cfg.dist.nnodes > 1:
        from lazytrain.planner.topology import topology_from_config
        topo = topology_from_config(cfg, hardware_from_config(cfg))

    def problem_at(m: int, g: int):
        problem = problem_from_config(apply_overrides(
            cfg, [f"train.micro_batch={m}", f"train.grad_accum={g}"]))
        if topo is not None:
            from lazytrain.planner.topology import rank_problem
            problem = rank_problem(problem, topo)
        return problem

    pc = cfg.planner
    with solver_output_to_stderr():
        search = max_batch_search(problem_at, policy=pc.policy, grad_accums=accums,
                                  backend=pc.backend, time_limit_s=pc.time_limit_s, gap=pc.gap,
                                  threads=pc.threads, seed=pc.seed)
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


def scaling_text(node_problem, topo, kw: dict, *, policy: str) -> str:
    """The predicted scaling table (`lazytrain.planner.topology`); MILP is replaced by the
    heuristic there (four solves would take minutes)."""
    from lazytrain.planner.topology import format_scaling_table, scaling_table

    policy = "heuristic" if policy == "milp" else policy
    with solver_output_to_stderr():
        rows = scaling_table(node_problem, topo, policy=policy, **kw)
    masters = ("one shared master copy per node" if topo.shared_masters
               else "a master copy per rank (dist.shared_masters: false)")
    return (f"scaling (policy {policy}; per-rank plan + exposed gradient all-reduce; "
            f"{masters}; tokens/s of the whole node):\n" + format_scaling_table(rows))


def write_outputs(problem, plan, *, out: str | None, gantt: str | None) -> None:
    """Write the plan JSON and the Gantt PNG atomically; print their paths on stderr."""
    if out:
        print(f"wrote {plan.save(out)}", file=sys.stderr)
    if gantt:
        from lazytrain.report.gantt import render_sim_gantt
        from lazytrain.sim import simulate

        title = f"{problem.name}: simulated micro-batch"
        print(f"wrote {render_sim_gantt(simulate(problem, plan), gantt, title=title)}",
              file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Report (plain data for --json, table for humans)


def throughput(problem, step_ms: float | None) -> dict:
    """Model TFLOPS and tokens/s of a step time (None when unknown)."""
    if not step_ms:
        return {"step_ms": step_ms, "model_tflops": None, "tokens_per_s": None}
    s = step_ms / 1e3
    return {"step_ms": step_ms,
            "model_tflops": problem.model_flops_per_micro_batch * problem.grad_accum / s / 1e12,
            "tokens_per_s": problem.tokens_per_micro_batch * problem.grad_accum / s}


def _row(problem, plan) -> dict:
    pr = plan.predicted
    row = throughput(problem, pr.step_ms if pr else None)
    if pr:
        row.update(model_tflops=pr.model_tflops, tokens_per_s=pr.tokens_per_s,
                   peak_hbm_bytes=pr.peak_hbm_bytes)
    return row


def build_report(problem, plan, baseline, *, policy: str, megatrain_k: int,
                 best_fixed=None) -> dict:
    """Rows for the chosen policy, the MegaTrain rule (the configured K, the paper's 4 by
    default) and the best fixed-K rule that fits, the bounds, plus the simulator check.

    `speedup_vs_megatrain` is against the faster of the two rules among those that fit the
    budgets (`baseline` names it); None when neither fits.
    """
    from lazytrain.planner.heuristics import k_of
    from lazytrain.sim import compare, simulate

    rows = {policy: _row(problem, plan)}
    paper = f"megatrain (K={megatrain_k})"
    rows[paper] = _row(problem, baseline)
    fits = {} if baseline.provenance.get("violations") else {paper: baseline}
    if baseline.provenance.get("violations"):
        rows[paper]["over_budget"] = True
    if best_fixed is None:
        rows["best fixed K (none fits)"] = throughput(problem, None)
    else:
        best_label = f"best fixed K (K={k_of(best_fixed)})"
        rows[best_label] = _row(problem, best_fixed)
        fits[best_label] = best_fixed
    b = plan.bounds
    for label, value in (("LP bound", b.lp_step_ms), ("memory bound", b.memory_step_ms),
                         ("roofline (inf HBM)", b.roofline_step_ms),
                         ("ideal (inf HBM)", b.ideal_step_ms)):
        if value is not None:
            rows[label] = throughput(problem, value)
    ours = rows[policy]["step_ms"]
    strongest = min(fits, key=lambda k: fits[k].predicted.step_ms) if fits else None
    base = rows[strongest]["step_ms"] if strongest else None
    sim = simulate(problem, plan)
    return {
        "rows": rows,
        "baseline": strongest,
        "best_fixed_k": None if best_fixed is None else k_of(best_fixed),
        "speedup_vs_megatrain": base / ours if ours and base else None,
        "solver": None if plan.solver is None else _asdict(plan.solver),
        "bounds": _asdict(b),
        "simulator": {"step_ms": sim.step_ms, "disagreements": compare(problem, plan)},
        "violations": list(plan.provenance.get("violations") or []),
    }


def _asdict(obj) -> dict:
    from dataclasses import asdict

    return asdict(obj)


def ranges(indices) -> str:
    """Compact index list: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' ('-' when empty)."""
    idx = sorted(indices)
    if not idx:
        return "-"
    parts, lo, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(lo) if lo == prev else f"{lo}-{prev}")
        if i is not None:
            lo = prev = i
    return ",".join(parts)


def recomputed_blocks(plan) -> list[int]:
    """Blocks re-run in backward before their segment's last block: s..e-2 of each segment."""
    return [k for s, e in plan.segments() for k in range(s, e - 1)]


def format_table(problem, plan, report: dict) -> str:
    """The human-readable plan summary (stdout)."""
    from lazytrain.planner.plan import TIERS

    L, prov = plan.num_blocks, plan.provenance
    source = ((prov.get("config") or {}).get("model") or {}).get("config_path")
    model = prov.get('model', problem.name) + (f" ({source})" if source else "")
    lines = [f"plan for {model} on {prov.get('hardware', '?')}: "
             f"{L} blocks, seq {prov.get('seq_len', '?')}, micro-batch "
             f"{prov.get('micro_batch', '?')}, grad-accum {problem.grad_accum}"]
    from lazytrain.runtime.calibrate import costs_line_of

    lines.append(costs_line_of(prov))
    s = report["solver"]
    if s:
        gap = "-" if s.get("gap") is None else f"{100 * s['gap']:.2f}%"
        lines.append(f"solver: {s['backend']} ({s['status']}), {s['solve_s']:.2f} s, gap {gap}, "
                     f"{s['num_vars']} vars, {s['num_rows']} rows")
    lines.append("")
    lines.append(f"boundaries ({L + 1}): " + "  ".join(
        f"{t} {plan.tiers.count(t)}" for t in TIERS))
    for t in TIERS:
        lines.append(f"  {t:<10} {ranges(i for i, x in enumerate(plan.tiers) if x == t)}")
    rec = recomputed_blocks(plan)
    lines.append(f"recomputed blocks ({len(rec)}): {ranges(rec)}")
    lines.append(f"keep-internals ({len(plan.keep_internals)}): {ranges(plan.keep_internals)}")
    lines.append(f"resident weights ({len(plan.resident_weights)}): "
                 f"{ranges(plan.resident_weights)}")
    frac = plan.predicted.q8_param_fraction if plan.predicted else 0.0
    lines.append(f"8-bit Adam states ({len(plan.q8_blocks)} blocks, {100 * frac:.2f}% of "
                 f"parameters): {ranges(plan.q8_blocks)}")
    lines.append("")
    lines += _perf_table(report)
    lines += _check_lines(report)
    return "\n".join(lines)


def _fmt(v, spec: str) -> str:
    """`format(v, spec)`, or "-" right-aligned to the spec's width when `v` is None."""
    return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)


def _perf_table(report: dict) -> list[str]:
    head = f"{'':<24} {'step ms':>12} {'model TFLOPS':>13} {'tokens/s':>11} {'peak HBM GB':>12}"
    out = [head]
    for label, r in report["rows"].items():
        hbm = r.get("peak_hbm_bytes")
        out.append(f"{label:<24} {_fmt(r['step_ms'], '12.1f')} {_fmt(r['model_tflops'], '13.1f')}"
                   f" {_fmt(r['tokens_per_s'], '11.1f')} "
                   f"{_fmt(None if hbm is None else hbm / 1e9, '12.2f')}"
                   + ("  over budget" if r.get("over_budget") else ""))
    return out


BOUND_NOTES = (
    "LP bound       the MILP relaxed, within every budget",
    "memory bound   no recompute; keep-internals only as far as HBM holds them",
    "(inf HBM)      every block kept, unlimited HBM: unreachable when it does not fit",
)
"""One line per bound row of the table (printed under it)."""


def _check_lines(report: dict) -> list[str]:
    out = [f"  {n}" for n in BOUND_NOTES] + [""]
    if report["speedup_vs_megatrain"]:
        out.append(f"speedup over the MegaTrain rule: {report['speedup_vs_megatrain']:.3f}x "
                   f"(against the faster rule that fits: {report['baseline']})")
    else:
        out.append("speedup over the MegaTrain rule: - (no fixed-K rule fits the budgets)")
    sim = report["simulator"]
    n = len(sim["disagreements"])
    out.append(f"event simulator: step {sim['step_ms']:.1f} ms; "
               + ("agrees with the evaluator" if not n else f"{n} disagreement(s):"))
    out += [f"  {d}" for d in sim["disagreements"][:8]]
    if n > 8:
        out.append(f"  ... {n - 8} more (lazytrain simulate plan.json)")
    out += [f"violation: {v}" for v in report["violations"]]
    return out
