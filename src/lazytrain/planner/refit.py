"""Refit of the cost model from measured windows: compute per block kind, bandwidth per channel.

Input: the per-window records `runtime/instrument.py` writes to `RUN_DIR/windows.jsonl` (one
JSON object per step and micro-batch: `{"step", "micro_batch", "plan_id", "windows": [{"name",
"wall_ms", "compute_ms", "wait_ms": {channel: ms}, "bytes": {channel: bytes}, ...}]}`) and the
Plan that produced them. Output: per-kind F / Fg / B and head time (ms), effective bytes/s per
channel, and a profile dict in the schema of `lazytrain.spec.costs` (so `lazytrain plan
--profile` and the online re-planner use what was measured).

Compute (least squares, one row per measured window): the plan fixes what every window computes
(docs/execution_model.md, "Per-window work"), so the measured compute of window w is linear in
the unknowns x = (F_k, Fg_k, B_k for every block kind k; head_ms; embed_ms):

    f{j}: F_k(j)  (Fg_k(j) when j keeps its internals)        turn: c_h head_ms
    b{j}: B_k(j) + Fg_k(j) (unless kept) + sum_{m=s..e-2} F_k(m) (+ embed_ms)   when j = e-1

where c_h is the plan's head turn factor (provenance "head" "turn_factor": 4/3 for DPO, whose
head runs a second forward; 1 when absent), so the fitted head_ms stays the one-pass figure
that profiles hold and `planner/build.py` multiplies for DPO again.

One plan rarely separates every unknown (without kept blocks B and Fg only appear as B + Fg), so
the fit is ridge-regularised towards a prior x0 (the profile the plan was made with):
    minimise  sum_rows (a.x - y)^2 + lam * sum_c ((x_c - x0_c) * s)^2,   s = 1 / max(|x0|, 1e-3)
i.e. unknowns the data determines move to the data; the others keep their prior value. With
lam = 0 and a full-rank design it is ordinary least squares.

Bandwidth per channel (through-origin least squares of time on bytes, `inv_bw = sum b t / sum
b^2`): on a CPU (channels contend with compute, the evaluator sums them) t is the time the
window waited for the channel; on a GPU (channels overlap compute) t is the window's wall time
less the time its engine thread was blocked on anything else (`host_blocked_on_ms` of the other
channels: a wait for an AdamW update does not make the h2d slower), over windows whose compute
waited for that channel (the channel bounds those windows).

Pure Python + numpy; knows no torch and no solver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from lazytrain.atomic import read_jsonl
from lazytrain.contract import TURN_WINDOW, backward_window, forward_window
from lazytrain.planner.windows import segments_of
from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.units import GB

CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write")
"""Copy channels with a bandwidth in the problem (the instrument's byte keys)."""
PROBLEM_FIELD = {"h2d": "h2d_bytes_per_s", "d2h": "d2h_bytes_per_s",
                 "nvme_read": "nvme_read_bytes_per_s", "nvme_write": "nvme_write_bytes_per_s"}
"""Channel -> PlanningProblem bandwidth field (bytes/s)."""
PROFILE_KEY = {"h2d": "h2d_gb_per_s", "d2h": "d2h_gb_per_s",
               "nvme_read": "nvme_read_gb_per_s", "nvme_write": "nvme_write_gb_per_s"}
"""Channel -> profile `bandwidths` key (GB/s)."""
TIME_KEYS = ("fwd_ms", "fwd_grad_ms", "bwd_ms")
"""Per-kind unknowns, named as in the profile's `block_kinds` entries."""
DEFAULT_RIDGE = 1e-4
"""lam of the ridge term: small against a window row (rows weigh 1 ms^2 per ms^2 of error), so
determined unknowns follow the data within ~0.01%; undetermined ones keep their prior."""
MIN_BYTES = 1
"""Windows moving fewer bytes on a channel carry no information about its bandwidth."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ComputeFit:
    """Result of `fit_compute`."""

    kinds: dict
    """kind -> {"fwd_ms", "fwd_grad_ms", "bwd_ms"}, ms per micro-batch."""
    head_ms: float
    """Head + loss, one forward and backward (the turn window's compute / the plan's head turn
    factor), ms."""
    embed_ms: float
    """Embedding forward, ms (prior unless some window re-embeds)."""
    rms_ms: float
    """Root-mean-square residual over the rows, ms."""
    rows: int
    """Measured windows used."""


def design_rows(plan: Plan, block_kinds: Sequence[str]) -> tuple[list[tuple], dict[str, dict]]:
    """The columns and, per window name, its row of coefficients (see the module docstring).

    Args:
        plan: the plan the windows were measured under.
        block_kinds: kind of each block j (len L).

    Returns:
        (columns, rows): columns are ("fwd_ms", kind), ("fwd_grad_ms", kind), ("bwd_ms", kind),
        ("head_ms",), ("embed_ms",); rows map window name -> {column: coefficient}.

    Raises:
        ValueError: len(block_kinds) != plan.num_blocks.
    """
    L = plan.num_blocks
    if len(block_kinds) != L:
        raise ValueError(f"block_kinds has {len(block_kinds)} entries; the plan has {L} blocks")
    kinds = sorted(set(block_kinds))
    columns = [(t, k) for k in kinds for t in TIME_KEYS] + [("head_ms",), ("embed_ms",)]
    keep = set(plan.keep_internals)
    rows: dict[str, dict] = {}

    def add(row: dict, col: tuple, c: float = 1.0) -> None:
        row[col] = row.get(col, 0.0) + c

    for j in range(L):
        k = block_kinds[j]
        rows[forward_window(j)] = {("fwd_grad_ms" if j in keep else "fwd_ms", k): 1.0}
        row = {("bwd_ms", k): 1.0}
        if j not in keep:
            add(row, ("fwd_grad_ms", k))
        rows[backward_window(j)] = row
    rows[TURN_WINDOW] = {("head_ms",): float((plan.provenance.get("head") or {})
                                             .get("turn_factor", 1.0))}
    for s, e in segments_of(plan.tiers):
        row = rows[backward_window(e - 1)]
        for m in range(s, e - 1):
            add(row, ("fwd_ms", block_kinds[m]))
        if s == 0 and plan.tiers[0] == "recompute":
            add(row, ("embed_ms",))
    return columns, rows


def ridge_lstsq(a: np.ndarray, y: np.ndarray, x0: np.ndarray, lam: float) -> np.ndarray:
    """argmin_x ||a x - y||^2 + lam ||(x - x0) / max(|x0|, 1e-3)||^2 (lam = 0: plain lstsq).

    Args:
        a: [rows, cols] design; y: [rows] observations; x0: [cols] prior.
    """
    if lam <= 0:
        return np.linalg.lstsq(a, y, rcond=None)[0]
    s = np.sqrt(lam) / np.maximum(np.abs(x0), 1e-3)
    a_aug = np.vstack([a, np.diag(s)])
    y_aug = np.concatenate([y, s * x0])
    return np.linalg.lstsq(a_aug, y_aug, rcond=None)[0]


def fit_compute(plan: Plan, block_kinds: Sequence[str], windows: Iterable[dict], *,
                prior: dict | None = None, prior_head_ms: float = 0.0,
                prior_embed_ms: float = 0.0, lam: float = DEFAULT_RIDGE) -> ComputeFit:
    """Least-squares F / Fg / B per kind and head_ms from measured window compute.

    Args:
        plan: the plan the windows ran under.
        block_kinds: kind of each block.
        windows: window records (`name`, `compute_ms`), any number of steps and micro-batches;
            names not in the plan (`pre`, `post`) are skipped.
        prior: kind -> {"fwd_ms", "fwd_grad_ms", "bwd_ms"} (e.g. the profile's `block_kinds`);
            None: zeros (then use lam = 0 and a design that determines every unknown).
        prior_head_ms, prior_embed_ms: priors of the ends, ms.
        lam: ridge weight (module docstring).

    Returns:
        ComputeFit (times clipped at >= 0).

    Raises:
        ValueError: no usable window.
    """
    columns, rows = design_rows(plan, block_kinds)
    index = {c: n for n, c in enumerate(columns)}
    x0 = np.zeros(len(columns))
    for c, n in index.items():
        if c == ("head_ms",):
            x0[n] = prior_head_ms
        elif c == ("embed_ms",):
            x0[n] = prior_embed_ms
        elif prior and c[1] in prior:
            x0[n] = float(prior[c[1]].get(c[0], 0.0))
    a_rows, y = [], []
    for w in windows:
        row = rows.get(w.get("name"))
        if row is None or w.get("compute_ms") is None:
            continue
        vec = np.zeros(len(columns))
        for c, coef in row.items():
            vec[index[c]] = coef
        a_rows.append(vec)
        y.append(float(w["compute_ms"]))
    if not a_rows:
        raise ValueError("no measured window matches the plan's windows (f{j}, turn, b{j})")
    a, yv = np.array(a_rows), np.array(y)
    x = np.maximum(ridge_lstsq(a, yv, x0, lam), 0.0)
    rms = float(np.sqrt(np.mean((a @ x - yv) ** 2)))
    kinds = {k: {t: float(x[index[(t, k)]]) for t in TIME_KEYS} for k in sorted(set(block_kinds))}
    return ComputeFit(kinds=kinds, head_ms=float(x[index[("head_ms",)]]),
                      embed_ms=float(x[index[("embed_ms",)]]), rms_ms=rms, rows=len(y))


def fit_bandwidths(windows: Iterable[dict], *, copies_overlap_compute: bool
                   ) -> dict[str, float | None]:
    """Effective bytes/s per channel (through-origin least squares; module docstring).

    Args:
        windows: window records with `bytes` and `wait_ms` per channel (and `wall_ms`).
        copies_overlap_compute: GPU (True: fit wall time of the windows that waited for the
            channel, less their host blocks on other channels) or CPU (False: fit the
            channel's wait time).

    Returns:
        channel -> bytes/s, or None when no window moved bytes on it (or all waits were 0).
    """
    sbt = dict.fromkeys(CHANNELS, 0.0)
    sbb = dict.fromkeys(CHANNELS, 0.0)
    for w in windows:
        nbytes, waits = w.get("bytes") or {}, w.get("wait_ms") or {}
        for ch in CHANNELS:
            b = float(nbytes.get(ch) or 0.0)
            if b < MIN_BYTES:
                continue
            wait = float(waits.get(ch) or 0.0)
            if copies_overlap_compute:
                if wait <= 0:
                    continue
                others = (w.get("host_blocked_on_ms") or {}).items()  # absent: older runs
                t = float(w.get("wall_ms") or 0.0) - sum(float(v) for c, v in others if c != ch)
            else:
                t = wait
            sbt[ch] += b * t / 1e3
            sbb[ch] += b * b
    return {ch: (sbb[ch] / sbt[ch] if sbt[ch] > 0 else None) for ch in CHANNELS}


def load_windows(path: str | Path) -> list[dict]:
    """The records of a `windows.jsonl` file (one dict per step and micro-batch), read by
    `lazytrain.atomic.read_jsonl`: a torn last line (a crash mid-append) is skipped.

    Raises:
        FileNotFoundError: no such file (names the fix).
        ValueError: a damaged line other than the last (names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no measured windows at {path} (train with instrumentation on)")
    return read_jsonl(path)


def select_windows(records: Iterable[dict], *, plan_id: str | None = None,
                   skip_steps: int = 0) -> list[dict]:
    """Flatten records to window dicts, keeping one plan's (when given) after a warm-up."""
    out = []
    for rec in records:
        if plan_id is not None and rec.get("plan_id") not in (None, plan_id):
            continue
        if int(rec.get("step", 0)) <= skip_steps:
            continue
        out.extend(rec.get("windows") or [])
    return out


def refit_profile(profile: dict, plan: Plan, block_kinds: Sequence[str], windows: list[dict],
                  *, copies_overlap_compute: bool, lam: float = DEFAULT_RIDGE) -> dict:
    """A new profile dict: `profile` with compute and bandwidths replaced by the fit.

    Block kinds absent from `profile` get their first entry from the fit alone; bandwidths of
    channels without samples keep the old value. A `refit` entry records rows and residual.
    """
    prior = profile.get("block_kinds") or {}
    ends = dict(profile.get("ends") or {})
    fit = fit_compute(plan, block_kinds, windows, prior=prior,
                      prior_head_ms=float(ends.get("head_ms", 0.0)),
                      prior_embed_ms=float(ends.get("embed_ms", 0.0)),
                      lam=lam if prior else 0.0)
    out = json.loads(json.dumps(profile))
    kinds = out.setdefault("block_kinds", {})
    for k, times in fit.kinds.items():
        kinds.setdefault(k, {}).update(times)
    ends.update(head_ms=fit.head_ms, embed_ms=fit.embed_ms)
    out["ends"] = ends
    bw = dict(out.get("bandwidths") or {})
    for ch, rate in fit_bandwidths(windows, copies_overlap_compute=copies_overlap_compute).items():
        if rate is not None:
            bw[PROFILE_KEY[ch]] = rate / GB
    out["bandwidths"] = bw
    out["refit"] = {"rows": fit.rows, "rms_ms": fit.rms_ms}
    return out


def problem_with_rates(problem: PlanningProblem, rates: dict[str, float | None], *,
                       compute_scale: float = 1.0) -> PlanningProblem:
    """`problem` with measured channel bytes/s (None keeps the old value) and every compute
    time scaled by `compute_scale` (the measured / planned compute ratio)."""
    changes = {PROBLEM_FIELD[ch]: r for ch, r in rates.items() if r is not None and r > 0}
    if compute_scale != 1.0:
        for name in ("fwd_ms", "fwd_grad_ms", "reforward_ms", "reforward_l1_ms", "bwd_ms"):
            changes[name] = tuple(t * compute_scale for t in getattr(problem, name))
        changes["head_ms"] = problem.head_ms * compute_scale
        changes["embed_ms"] = problem.embed_ms * compute_scale
    if "h2d_bytes_per_s" in changes or "d2h_bytes_per_s" in changes:
        # duplex never exceeds the two links together, and no link alone is faster than duplex
        h2d = changes.get("h2d_bytes_per_s", problem.h2d_bytes_per_s)
        d2h = changes.get("d2h_bytes_per_s", problem.d2h_bytes_per_s)
        changes["duplex_bytes_per_s"] = min(max(problem.duplex_bytes_per_s, h2d, d2h), h2d + d2h)
    return problem.replace(**changes)
