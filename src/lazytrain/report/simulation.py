"""A plan under both timing models: the fluid evaluator next to the event simulator, window by
window, as `lazytrain simulate` prints it (text and `--json` data).

Formats what `planner.evaluate` and `sim` computed; knows no torch.
"""

from __future__ import annotations


def simulation_json(ev, sim, diffs: list[str]) -> dict:
    """The evaluator and the simulator side by side, per window (plain data for `--json`;
    times in ms)."""
    return {
        "evaluator": {"step_ms": ev.step_ms, "feasible": ev.feasible,
                      "violations": list(ev.violations)},
        "simulator": {"step_ms": sim.step_ms},
        "windows": [{"name": w.name, "evaluator_ms": w.time_ms,
                     "simulator_ms": sim.window(w.name).time_ms,
                     "evaluator_exposed_ms": w.exposed_ms,
                     "simulator_exposed_ms": sim.window(w.name).exposed_ms,
                     "simulator_exposed_by_channel": sim.window(w.name).exposed_by_channel}
                    for w in ev.windows],
        "disagreements": diffs,
    }


def format_simulation(problem, ev, sim, diffs: list[str]) -> str:
    """Per-window table (both models, exposed time, the simulator's slowest channel) + totals.

    Args:
        problem: the problem both models ran.
        ev: `planner.evaluate.evaluate(problem, plan)`.
        sim: `sim.simulate(problem, plan)`.
        diffs: `sim.disagreements(problem, plan)`, one line per disagreement.
    """
    lines = [f"{problem.name}: {problem.num_blocks} blocks, "
             f"{'GPU (copies overlap compute)' if problem.copies_overlap_compute else 'CPU'}",
             f"{'window':<7} {'eval ms':>10} {'sim ms':>10} {'diff ms':>9} {'eval exp':>9} "
             f"{'sim exp':>9}  sim exposed by"]
    for w in ev.windows:
        s = sim.window(w.name)
        chan = ", ".join(f"{k} {v:.2f}" for k, v in s.exposed_by_channel.items() if v > 1e-6)
        if s.stall_ms > 1e-6:
            chan = f"compute stall {s.stall_ms:.2f}" + (f", {chan}" if chan else "")
        lines.append(f"{w.name:<7} {w.time_ms:10.3f} {s.time_ms:10.3f} "
                     f"{s.time_ms - w.time_ms:+9.3f} {w.exposed_ms:9.3f} {s.exposed_ms:9.3f}  "
                     f"{chan or '-'}")
    lines.append(f"{'step':<7} {ev.step_ms:10.3f} {sim.step_ms:10.3f} "
                 f"{sim.step_ms - ev.step_ms:+9.3f}")
    if ev.violations:
        lines += [f"violation: {v}" for v in ev.violations]
    lines.append("")
    lines.append("agreement: the event simulator matches the evaluator" if not diffs
                 else f"{len(diffs)} disagreement(s):")
    lines += [f"  {d}" for d in diffs]
    return "\n".join(lines)
