"""The plan's report: how a plan compares with the fixed-K rules and the bounds, the table
`lazytrain plan` prints, and the summary the trainer prints at start-up.

`plan_comparison` plans the MegaTrain rule (the configured K) and the best fixed-K rule that
fits through `planner.heuristics` (the rule on the weight paths `planner.path_choice` gives
it), and checks the plan with the event
simulator; `format_plan_table` and `plan_summary` turn plans into text. The costs line comes
from the caller (`profile.calibrate.costs_line_of`): this module knows neither torch nor the
runtime.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict

from lazytrain.planner.heuristics import best_fixed_k_plan, k_of, megatrain_plan
from lazytrain.planner.memory_model import memory_model_of
from lazytrain.planner.path_choice import choose_weight_paths
from lazytrain.planner.plan import Plan
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.windows import TIERS
from lazytrain.sim import disagreements, simulate
from lazytrain.units import GB


def throughput(problem: PlanningProblem, step_ms: float | None) -> dict:
    """Model TFLOPS and tokens/s of an optimizer-step time in ms (None values when unknown)."""
    if not step_ms:
        return {"step_ms": step_ms, "model_tflops": None, "tokens_per_s": None}
    s = step_ms / 1e3
    return {"step_ms": step_ms,
            "model_tflops": problem.model_flops_per_micro_batch * problem.grad_accum / s / 1e12,
            "tokens_per_s": problem.tokens_per_micro_batch * problem.grad_accum / s}


def nvme_write_bytes_per_step(plan: Plan, grad_accum: int) -> float:
    """Bytes a step writes to NVMe: `grad_accum` x the NVMe writes of the plan's windows (one
    micro-batch each). What wears the drive: its endurance is rated in bytes written."""
    return grad_accum * math.fsum(w.nvme_write_bytes for w in plan.windows)


def nvme_writes_line(plan: Plan, grad_accum: int) -> str:
    """`NVMe writes: 28.69 GB per step, 28.69 TB per 1,000 steps` (1 GB = 1e9 bytes, 1 TB =
    1e12 bytes), plus what the fastest plan found wrote when the least-wear phase
    (`planner/wear.py`, provenance `least_wear`) chose this one."""
    per_step = nvme_write_bytes_per_step(plan, grad_accum)
    line = (f"NVMe writes: {per_step / 1e9:.2f} GB per step, "
            f"{per_step * 1000 / 1e12:.2f} TB per 1,000 steps")
    wear = plan.provenance.get("least_wear")
    if wear:
        before = wear["nvme_write_bytes_per_step"]["before"]
        line += (f" (least-wear phase: the fastest plan found wrote {before / 1e9:.2f} GB per "
                 f"step; this one is at most {100 * wear['step_slack']:g}% slower)")
    return line


HOST_BOUND_NAMES_SHOWN = 8
"""Host-bound windows named in the host line; the rest are counted."""


def host_line(plan: Plan) -> str | None:
    """`host (assumed): convert 3.17 GB/s, accumulate 3.05 GB/s, 1.20 ms per micro-batch;
    host-bound windows (2 of 9): f1, b2` from plan provenance `host` (`planner/host_bound.py`;
    1 GB = 1e9 bytes; a rate of 0 prints "not modelled"). None for a plan without that record
    (one written before it existed)."""
    rec = plan.provenance.get("host")
    if not rec:
        return None
    rate = lambda bps: f"{bps / 1e9:.3g} GB/s" if bps > 0 else "not modelled"  # noqa: E731
    bound = list(rec["bound_windows"])
    names = ", ".join(bound[:HOST_BOUND_NAMES_SHOWN]) or "none"
    if len(bound) > HOST_BOUND_NAMES_SHOWN:
        names += f", ... {len(bound) - HOST_BOUND_NAMES_SHOWN} more"
    return (f"host (assumed): convert {rate(rec['convert_bytes_per_s'])}, accumulate "
            f"{rate(rec['accumulate_bytes_per_s'])}, {rec['host_ms']:.2f} ms per micro-batch; "
            f"host-bound windows ({len(bound)} of {len(plan.windows)}): {names}")


def planner_lines(plan: Plan) -> list[str]:
    """The lines every plan report carries beside the solver's: that the MILP was unavailable
    (provenance `milp_unavailable`, `planner.policy.MILP_UNAVAILABLE`) and `host_line`."""
    out = [plan.provenance["milp_unavailable"]] if plan.provenance.get("milp_unavailable") \
        else []
    host = host_line(plan)
    return out + ([host] if host else [])


def _row(problem, plan) -> dict:
    pr = plan.predicted
    row = throughput(problem, pr.step_ms if pr else None)
    if pr:
        row.update(model_tflops=pr.model_tflops, tokens_per_s=pr.tokens_per_s,
                   peak_hbm_bytes=pr.peak_hbm_bytes)
    return row


PUBLISHED = "megatrain as published"
"""The label of the MegaTrain rule priced as the paper runs it: every block re-forwarded in full
in its backward window (a plan without save levels); the baseline of the speedup."""

NO_SOLVER_LABEL = "heuristic (no MILP solver)"
"""The table row of a milp-policy plan that the heuristic made (provenance `milp_unavailable`)."""


def plan_comparison(problem: PlanningProblem, plan: Plan, options: PlannerOptions) -> dict:
    """Rows for the chosen policy (NO_SOLVER_LABEL when the heuristic stood in for the MILP),
    the MegaTrain rule (`options.megatrain_k`, the paper's 4 by
    default; at most `problem.k_max` unless the policy is megatrain itself) and the best fixed-K
    rule that fits, both as published (full re-forward), the best fixed-K rule with the truncated
    re-forward (when the problem truncates), the bounds, plus the simulator check (plain data:
    `lazytrain plan --json`
    prints it as `comparison`).

    `speedup_vs_megatrain` is against the faster of the two rules among those that fit the
    budgets (`baseline` names it); None when neither fits. Step times in ms, tokens/s, model
    TFLOPS, peak HBM in bytes.

    Args:
        problem: the problem `plan` was made for.
        plan: the plan (made with `options`).
        options: the planner options (policy, megatrain_k).
    """
    policy = options.policy
    # the rule at the longest segment the job allows (a segment beyond k_max is no valid plan)
    megatrain_k = options.megatrain_k if policy == "megatrain" else min(options.megatrain_k,
                                                                        problem.k_max)
    # the rule as published: no save levels, every block re-forwarded in full, on the weight
    # paths the policy would give it
    baseline = megatrain_plan(choose_weight_paths(problem), megatrain_k, as_published=True)
    best_fixed = best_fixed_k_plan(problem, as_published=True)
    ours_label = NO_SOLVER_LABEL if plan.provenance.get("milp_unavailable") else policy
    rows = {ours_label: _row(problem, plan)}
    paper = f"{PUBLISHED} (K={megatrain_k})"
    rows[paper] = _row(problem, baseline)
    fits = {} if baseline.provenance.get("violations") else {paper: baseline}
    if baseline.provenance.get("violations"):
        rows[paper]["over_budget"] = True
    if best_fixed is None:
        rows["best fixed K (none fits)"] = throughput(problem, None)
    else:
        best_label = f"best fixed K as published (K={k_of(best_fixed)})"
        rows[best_label] = _row(problem, best_fixed)
        fits[best_label] = best_fixed
    truncated = best_fixed_k_plan(problem) if problem.reforward != problem.fwd_grad_ms else None
    if truncated is not None:
        rows[f"best fixed K truncated (K={k_of(truncated)})"] = _row(problem, truncated)
    b = plan.bounds
    for label, value in (("LP bound", b.lp_step_ms), ("memory bound", b.memory_step_ms),
                         ("roofline (inf HBM)", b.roofline_step_ms),
                         ("ideal (inf HBM)", b.ideal_step_ms)):
        if value is not None:
            rows[label] = throughput(problem, value)
    ours = rows[ours_label]["step_ms"]
    strongest = min(fits, key=lambda k: fits[k].predicted.step_ms) if fits else None
    base = rows[strongest]["step_ms"] if strongest else None
    sim = simulate(problem, plan)
    return {
        "rows": rows,
        "baseline": strongest,
        "best_fixed_k": None if best_fixed is None else k_of(best_fixed),
        "best_fixed_k_truncated": None if truncated is None else k_of(truncated),
        "speedup_vs_megatrain": base / ours if ours and base else None,
        "solver": None if plan.solver is None else asdict(plan.solver),
        "bounds": asdict(b),
        "simulator": {"step_ms": sim.step_ms, "disagreements": disagreements(problem, plan)},
        "violations": list(plan.provenance.get("violations") or []),
        "nvme_write_bytes_per_step": nvme_write_bytes_per_step(plan, problem.grad_accum),
    }


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


LEVEL_TIERS = (("L1", "hbm"), ("L1", "dram"), ("L2", "hbm"), ("L2", "dram"))
"""The (save level, saved tier) pairs a saving block can take, in the order lines print."""


def save_level_line(plan: Plan) -> str:
    """`save levels: L0 20, kept 2, L1 hbm 3, L2 dram 5` (kept: the keep-internals blocks,
    L0 in the plan but keeping everything; pairs with no block left out), or `save levels:
    none (every block re-forwarded in full)` for a plan without them (the MegaTrain rule as
    published, plans written before the field)."""
    if plan.reforwards_in_full:
        return "save levels: none (every block re-forwarded in full)"
    counts = Counter(zip(plan.save_levels, plan.saved_tiers))
    kept = len(plan.keep_internals)
    parts = [f"L0 {plan.save_levels.count('L0') - kept}"] + ([f"kept {kept}"] if kept else [])
    parts += [f"{level} {tier} {counts[level, tier]}" for level, tier in LEVEL_TIERS
              if counts[level, tier]]
    return "save levels: " + ", ".join(parts)


def save_level_lines(problem: PlanningProblem, plan: Plan) -> list[str]:
    """`save_level_line`, then per (level, tier) taken its blocks and the bytes they keep
    (`  L2 dram   3-7  5 blocks, 0.21 GB`), then the saved bytes per block, compact: each
    distinct (S1, S2) once with its blocks (`saved bytes per block (S1 / S2): 43.9 / 57.2 GB
    48 blocks 0-2,4-6,8-10,...; 13.6 / 26.9 GB 16 blocks 3,7,11,...`). The bytes line is left
    out when the problem has no `saved_bytes` (levels unavailable)."""
    out = [save_level_line(plan)]
    sizes = problem.saved_bytes
    for level, tier in LEVEL_TIERS:
        blocks = [j for j in plan.saved_blocks()
                  if (plan.save_levels[j], plan.saved_tiers[j]) == (level, tier)]
        if blocks:
            held = sum(sizes[j][level == "L2"] for j in blocks) if sizes else 0
            out.append(f"  {level} {tier:<6} {ranges(blocks)}  {len(blocks)} "
                       f"block{'s' if len(blocks) > 1 else ''}, {held / GB:.2f} GB")
    if sizes:
        out.append(f"saved bytes per block (S1 / S2): {compact_pairs(sizes)}")
    return out


SIZE_RANGES_SHOWN = 4
"""Index ranges printed per distinct saved size before '...'."""


def compact_pairs(sizes) -> str:
    """Each distinct (S1, S2) byte pair once, in order of first block, with its block count and
    ranges (at most SIZE_RANGES_SHOWN): [(1e6, 2e6)] * 2 + [(3e6, 4e6)] -> '1 / 2 MB 2 blocks
    0-1; 3 / 4 MB 1 block 2'. Sizes in GB when the largest is at least 1 GB, else MB (3
    significant digits)."""
    unit, name = (GB, "GB") if max(b for pair in sizes for b in pair) >= GB else (1e6, "MB")
    blocks: dict[str, list[int]] = {}
    for j, (s1, s2) in enumerate(sizes):
        blocks.setdefault(f"{s1 / unit:.3g} / {s2 / unit:.3g} {name}", []).append(j)
    parts = []
    for text, idx in blocks.items():
        spans = ranges(idx).split(",")
        shown = ",".join(spans[:SIZE_RANGES_SHOWN]) + (",..." if len(spans) > SIZE_RANGES_SHOWN
                                                        else "")
        parts.append(f"{text} {len(idx)} block{'s' if len(idx) > 1 else ''} {shown}")
    return "; ".join(parts)


def recomputed_blocks(plan: Plan) -> list[int]:
    """Blocks re-run in backward before their segment's last block: s..e-2 of each segment."""
    return [k for s, e in plan.segments() for k in range(s, e - 1)]


def format_plan_table(problem: PlanningProblem, plan: Plan, report: dict, *,
                      costs_line: str) -> str:
    """The human-readable plan table `lazytrain plan` prints (stdout).

    Args:
        problem: the problem the plan was made for.
        plan: the plan.
        report: `plan_comparison(problem, plan, options)`.
        costs_line: where the costs came from (`profile.calibrate.costs_line_of`).
    """
    L, prov = plan.num_blocks, plan.provenance
    source = ((prov.get("config") or {}).get("model") or {}).get("config_path")
    model = prov.get('model', problem.name) + (f" ({source})" if source else "")
    lines = [f"plan for {model} on {prov.get('hardware', '?')}: "
             f"{L} blocks, seq {prov.get('seq_len', '?')}, micro-batch "
             f"{prov.get('micro_batch', '?')}, grad-accum {problem.grad_accum}"]
    lines.append(costs_line)
    s = report["solver"]
    if s:
        g = s.get("gap")
        # float noise below a bound that equals the plan is 0, not "-0.00%"
        gap = "-" if g is None else f"{100 * (max(g, 0.0) if g > -1e-9 else g):.2f}%"
        if g is not None and g < -1e-9:  # the step against the best bound, never clamped
            gap += " (a lower bound lies above this plan: a planner bug, please report it)"
        took = f"{s['solve_s']:.2f} s" if s['solve_s'] else "solve time not recorded"
        lines.append(f"solver: {s['backend']} ({s['status']}), {took}, gap {gap}, "
                     f"{s['num_vars']} vars, {s['num_rows']} rows")
    lines += planner_lines(plan)
    lines.append("")
    lines.append(f"boundaries ({L + 1}): " + "  ".join(
        f"{t} {plan.tiers.count(t)}" for t in TIERS))
    for t in TIERS:
        lines.append(f"  {t:<10} {ranges(i for i, x in enumerate(plan.tiers) if x == t)}")
    rec = recomputed_blocks(plan)
    lines.append(f"recomputed blocks ({len(rec)}): {ranges(rec)}")
    lines.append(nvme_writes_line(plan, problem.grad_accum))
    lines.append(f"keep-internals ({len(plan.keep_internals)}): {ranges(plan.keep_internals)}")
    lines += save_level_lines(problem, plan)
    lines.append(f"resident weights ({len(plan.resident_weights)}): "
                 f"{ranges(plan.resident_weights)}")
    frac = plan.predicted.q8_param_fraction if plan.predicted else 0.0
    lines.append(f"8-bit Adam states ({len(plan.q8_blocks)} blocks, {100 * frac:.2f}% of "
                 f"parameters): {ranges(plan.q8_blocks)}")
    if plan.predicted:
        reference = memory_model_of(problem.provenance).reference_bytes
        lines.append(f"host DRAM: {plan.predicted.dram_bytes / GB:.2f} of "
                     f"{problem.dram_bytes / GB:.2f} GB (optimizer states, staging, DRAM "
                     f"checkpoints); page-locked at the peak {plan.predicted.pinned_bytes / GB:.2f}"
                     f" GB" + (f"; the budget is hardware.dram_gb less the GRPO KL reference "
                               f"copy of the weights (grpo.kl_coef), {reference / GB:.2f} GB"
                               if reference else ""))
    lines.append("")
    lines += _perf_table(report)
    lines += _check_lines(report)
    return "\n".join(lines)


def _fmt(v, spec: str) -> str:
    """`format(v, spec)`, or "-" right-aligned to the spec's width when `v` is None."""
    return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)


def _perf_table(report: dict) -> list[str]:
    width = max([24] + [len(label) for label in report["rows"]])
    head = (f"{'':<{width}} {'step ms':>12} {'model TFLOPS':>13} {'tokens/s':>11} "
            f"{'peak HBM GB':>12}")
    out = [head]
    for label, r in report["rows"].items():
        hbm = r.get("peak_hbm_bytes")
        out.append(f"{label:<{width}} {_fmt(r['step_ms'], '12.1f')} "
                   f"{_fmt(r['model_tflops'], '13.1f')}"
                   f" {_fmt(r['tokens_per_s'], '11.1f')} "
                   f"{_fmt(None if hbm is None else hbm / 1e9, '12.2f')}"
                   + ("  over budget" if r.get("over_budget") else ""))
    return out


BOUND_NOTES = (
    "LP bound       the MILP relaxed, within every budget: bounds the plans the MILP models",
    "memory bound   no recompute; keep-internals, save levels and resident weights only as far"
    " as HBM (and DRAM, for saved internals) holds them",
    "roofline       every block kept and resident, unlimited HBM: mandatory compute and traffic",
    "ideal          every boundary in HBM, every block resident and kept where that pays,"
    " unlimited HBM: unreachable when it does not fit",
)
"""One line per bound row of the table (printed under it)."""


def _check_lines(report: dict) -> list[str]:
    shown = [n for n in BOUND_NOTES  # a bound not computed (no LP without a solver): no note
             if any(label.startswith(n.split("  ")[0]) for label in report["rows"])]
    out = [f"  {n}" for n in shown] + [""]
    if report["speedup_vs_megatrain"]:
        out.append(f"speedup over the MegaTrain rule: {report['speedup_vs_megatrain']:.3f}x "
                   f"against the fastest fixed K as published that fits ({report['baseline']}; the paper's K "
                   f"is a row of the table)")
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


def plan_summary(plan: Plan, *, source: str | None = None, costs_line: str = "") -> str:
    """A few lines describing the plan (model and where it came from, tiers, segments, kept
    blocks, save levels (`save_level_line`), prediction, solver, whether the MILP was
    unavailable, the host rates assumed and the host-bound windows: `planner_lines`).

    Args:
        plan: the plan.
        source: `model.config_path` (a path, hub id or built-in name), printed after the name
            so that a plan of the wrong model is visible at once.
        costs_line: where the costs came from (`profile.calibrate.costs_line_of`; empty:
            no line).
    """
    prov = plan.provenance
    counts = Counter(plan.tiers)
    tiers = ", ".join(f"{counts[t]} {t}" for t in ("hbm", "dram", "nvme", "recompute")
                      if counts[t])
    model = prov.get('model', '?') + (f" ({source})" if source else "")
    lines = [f"plan: {model} on {prov.get('hardware', '?')}, "
             f"{plan.num_blocks} blocks, seq {prov.get('seq_len', '?')} x micro-batch "
             f"{prov.get('micro_batch', '?')}",
             f"  boundaries: {tiers}; {len(plan.segments())} segments; "
             f"keep-internals {len(plan.keep_internals)} blocks",
             f"  {save_level_line(plan)}"]
    if plan.predicted is not None:
        p = plan.predicted
        lines.append(f"  predicted: {p.step_ms / 1e3:.2f} s/step, {p.tokens_per_s:.0f} tokens/s, "
                     f"{p.model_tflops:.3f} model TFLOPS, peak HBM {p.peak_hbm_bytes / 1e9:.2f} "
                     f"GB, DRAM {p.dram_bytes / 1e9:.2f} GB, NVMe {p.nvme_bytes / 1e9:.2f} GB")
        lines.append(f"  {nvme_writes_line(plan, prov.get('grad_accum', 1))}")
    if plan.solver is not None:
        s = plan.solver
        lines.append(f"  solver: {s.backend} {s.status} in {s.solve_s:.2f} s")
    lines += [f"  {line}" for line in planner_lines(plan)]
    if costs_line:
        lines.append(f"  {costs_line}")
    return "\n".join(lines)
