"""Predicted vs measured, window by window: the numbers behind `lazytrain report`.

Owns comparing a run's `windows.jsonl` records (schema: `runtime/instrument.py`; read with
`lazytrain.atomic.read_jsonl`, which skips a torn last line) with the plan's per-window
predictions (`Plan.windows`: time_ms, compute_ms, exposed_ms). Measured values are medians over the steps after warm-up: a window's measured time is the median over
every (step, micro-batch) sample of its `wall_ms`; the measured step time is the median over
steps of the sum of all windows' `wall_ms` over the step's micro-batches (work outside windows,
e.g. loading the resident embedding/head before `pre`, is not in it). `pre` and `post` have
no per-window prediction in a plan (they are constant terms; execution_model.md), so their
`predicted_ms` is None and they are left out of "most wrong". A window's `host_blocked_ms`
(the compute stream idle while the engine's thread was blocked; not compute, not a copy wait)
is shown beside its waits and summed per step, where the run recorded it.

Saved internals (save levels L1/L2 in the dram tier, docs/execution_model.md "Save levels"):
where the run recorded per-window `saved_d2h_bytes` / `saved_h2d_bytes`, each window's median
is shown beside the bytes the plan's `internal_transfers` move there (fraction x S1[j] at L1 or
S2[j] at L2; the sizes from plan provenance `saved_bytes`, without which the prediction is
unknown), with both totals per micro-batch.

Must not know torch or the runtime: it reads JSON only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lazytrain.planner.memory_model import memory_model_of
from lazytrain.planner.plan import plan_digest

CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
"""`wait_ms` keys of windows.jsonl (runtime/instrument.py)."""
BYTE_CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write")
"""Per-window byte channels: the plan's `{channel}_bytes`, the ledger's `moved`."""
SAVED_KINDS = ("d2h", "h2d")
"""Directions of the saved internals' transfers; windows.jsonl keys `saved_{kind}_bytes`."""


def plan_id_of_dict(plan_dict: dict) -> str:
    """Same digest as `runtime.instrument.plan_id` (`planner.plan.plan_digest`)."""
    return plan_digest(plan_dict)


@dataclass(kw_only=True, frozen=True, slots=True)
class WindowRow:
    """One window: predicted (plan) vs measured (median), ms; peaks in bytes."""

    name: str
    predicted_ms: float | None
    measured_ms: float
    predicted_compute_ms: float | None
    measured_compute_ms: float
    predicted_exposed_ms: float | None
    exposed_ms: dict[str, float]
    """Measured median wait per channel, ms."""
    predicted_hbm_bytes: float | None
    """The plan's hbm_checkpoint_bytes of the window (activation store only)."""
    measured_hbm_bytes: int
    """The store's measured checkpoint bytes (max over samples)."""
    predicted_bytes: dict[str, float] | None = None
    """The plan's bytes per channel in this window (one micro-batch)."""
    measured_bytes: dict[str, int] | None = None
    """The ledger's bytes moved per channel (median over samples; None for runs recorded
    before the ledger)."""
    measured_ledger_hbm_bytes: int | None = None
    """The ledger's peak HBM bytes over all owners in the window (max over samples)."""
    measured_host_blocked_ms: float | None = None
    """Median time the compute stream idled while the engine's thread was blocked (a host
    wait, its own host work), ms; not compute, not a copy wait. None for runs recorded before
    the field."""
    predicted_saved_bytes: dict[str, float] | None = None
    """{"d2h", "h2d"}: bytes of saved internals the plan moves in this window (None: the plan
    does not carry the blocks' saved sizes)."""
    measured_saved_bytes: dict[str, float] | None = None
    """{"d2h", "h2d"}: median bytes of saved internals the run moved (None: not recorded)."""

    @property
    def delta_ms(self) -> float | None:
        """measured - predicted, ms (None without a prediction)."""
        return None if self.predicted_ms is None else self.measured_ms - self.predicted_ms


@dataclass(kw_only=True, frozen=True, slots=True)
class Comparison:
    """Everything `lazytrain report` prints."""

    plan_id: str
    steps_used: list[int]
    predicted_step_ms: float | None
    measured_step_ms: float
    predicted_exposed_ms: float
    """grad_accum * sum of the plan windows' exposed_ms."""
    measured_exposed_ms: dict[str, float]
    """Per channel: median over steps of the step's summed waits, ms."""
    predicted_peak_checkpoint_bytes: float
    """Max over windows of the plan's hbm_checkpoint_bytes (activation store only)."""
    measured_peak_checkpoint_bytes: int
    """Max over windows of the store's measured checkpoint bytes."""
    windows: list[WindowRow]
    predicted_peak_hbm_bytes: float | None = None
    """The plan's whole predicted peak HBM (fixed working set + checkpoints + kept graphs)."""
    measured_peak_hbm_bytes: int | None = None
    """The allocation ledger's peak over all owners (None: run recorded before the ledger)."""
    predicted_pinned_bytes: float | None = None
    """The plan's DRAM bytes less the host states: DRAM-tier checkpoints + staging pools."""
    measured_pinned_bytes: int | None = None
    """The ledger's peak pinned host bytes."""
    peak_window: str | None = None
    """Window of the ledger's HBM peak."""
    peak_owners: dict[str, int] | None = None
    """Largest owners at the ledger's HBM peak, bytes."""
    measured_host_blocked_ms: float | None = None
    """Median over steps of the step's summed `host_blocked_ms`, ms (None: not recorded)."""

    def saved_totals(self, side: str) -> dict[str, float] | None:
        """{"d2h", "h2d"}: saved-internals bytes per micro-batch, summed over the windows'
        `predicted_saved_bytes` (`side` "predicted") or `measured_saved_bytes` ("measured");
        None when no window has them."""
        cells = [getattr(w, f"{side}_saved_bytes") for w in self.windows]
        cells = [c for c in cells if c is not None]
        if not cells:
            return None
        return {k: sum(c[k] for c in cells) for k in SAVED_KINDS}

    def most_wrong(self, k: int = 5) -> list[WindowRow]:
        """The k windows with the largest |measured - predicted| (predicted windows only)."""
        rows = [w for w in self.windows if w.predicted_ms is not None]
        return sorted(rows, key=lambda w: -abs(w.delta_ms))[:k]

    def to_dict(self) -> dict:
        return {
            "plan_id": self.plan_id, "steps_used": self.steps_used,
            "predicted_step_ms": self.predicted_step_ms, "measured_step_ms": self.measured_step_ms,
            "predicted_exposed_ms": self.predicted_exposed_ms,
            "measured_exposed_ms": self.measured_exposed_ms,
            "predicted_peak_hbm_bytes": self.predicted_peak_hbm_bytes,
            "measured_peak_hbm_bytes": self.measured_peak_hbm_bytes,
            "predicted_pinned_bytes": self.predicted_pinned_bytes,
            "measured_pinned_bytes": self.measured_pinned_bytes,
            "predicted_peak_checkpoint_bytes": self.predicted_peak_checkpoint_bytes,
            "measured_peak_checkpoint_bytes": self.measured_peak_checkpoint_bytes,
            "peak_window": self.peak_window, "peak_owners": self.peak_owners,
            "measured_host_blocked_ms": self.measured_host_blocked_ms,
            "windows": [{"name": w.name, "predicted_ms": w.predicted_ms,
                         "measured_ms": w.measured_ms, "delta_ms": w.delta_ms,
                         "predicted_compute_ms": w.predicted_compute_ms,
                         "measured_compute_ms": w.measured_compute_ms,
                         "measured_host_blocked_ms": w.measured_host_blocked_ms,
                         "predicted_exposed_ms": w.predicted_exposed_ms,
                         "exposed_ms": w.exposed_ms,
                         "predicted_checkpoint_bytes": w.predicted_hbm_bytes,
                         "measured_checkpoint_bytes": w.measured_hbm_bytes,
                         "measured_hbm_bytes": w.measured_ledger_hbm_bytes,
                         "predicted_bytes": w.predicted_bytes,
                         "measured_bytes": w.measured_bytes,
                         "predicted_saved_bytes": w.predicted_saved_bytes,
                         "measured_saved_bytes": w.measured_saved_bytes}
                        for w in self.windows],
            "predicted_saved_bytes": self.saved_totals("predicted"),
            "measured_saved_bytes": self.saved_totals("measured"),
            "most_wrong": [w.name for w in self.most_wrong()],
        }


def select_records(records: list[dict], *, plan_id: str, skip_steps: int) -> list[dict]:
    """Records of `plan_id` (all records if none match) without the first `skip_steps` steps.

    Raises:
        ValueError: no records left (names the fix).
    """
    mine = [r for r in records if r.get("plan_id") == plan_id] or records
    steps = sorted({r["step"] for r in mine})
    keep = set(steps[skip_steps:])
    out = [r for r in mine if r["step"] in keep]
    if not out:
        raise ValueError(f"windows.jsonl: {len(steps)} step(s) recorded, --skip-steps "
                         f"{skip_steps} leaves none; run more steps or pass --skip-steps 0")
    return out


def compare_with_run(plan_dict: dict, records: list[dict], *, skip_steps: int = 1) -> Comparison:
    """Predicted (plan JSON dict) vs measured (windows.jsonl records), see the module docstring.

    Raises:
        ValueError: no records left after warm-up.
    """
    pid = plan_id_of_dict(plan_dict)
    recs = select_records(records, plan_id=pid, skip_steps=skip_steps)
    predicted = {w["name"]: w for w in plan_dict.get("windows", [])}
    names: list[str] = []
    samples: dict[str, list[dict]] = {}
    for r in recs:
        for w in r["windows"]:
            if w["name"] not in samples:
                names.append(w["name"])
            samples.setdefault(w["name"], []).append(w)
    steps = sorted({r["step"] for r in recs})
    step_ms, exposed_by_step, blocked_by_step = [], {c: [] for c in CHANNELS}, []
    for s in steps:
        ws = [w for r in recs if r["step"] == s for w in r["windows"]]
        step_ms.append(sum(w["wall_ms"] for w in ws))
        if all("host_blocked_ms" in w for w in ws):
            blocked_by_step.append(sum(w["host_blocked_ms"] for w in ws))
        for c in CHANNELS:
            exposed_by_step[c].append(sum(w["wait_ms"].get(c, 0.0) for w in ws))
    saved = predicted_saved_bytes(plan_dict)
    rows = [_row(n, samples[n], predicted.get(n),
                 None if saved is None else saved.get(n, dict.fromkeys(SAVED_KINDS, 0.0)))
            for n in names]
    accum = int((plan_dict.get("provenance") or {}).get("grad_accum", 1) or 1)
    pred = plan_dict.get("predicted") or {}
    memory = memory_model_of(plan_dict.get("provenance"))
    peaks = [r["ledger_peak"] for r in recs if "ledger_peak" in r]
    top = max(peaks, key=lambda p: p["hbm_bytes"]) if peaks else None
    return Comparison(
        plan_id=pid, steps_used=steps,
        predicted_step_ms=pred.get("step_ms"),
        measured_step_ms=statistics.median(step_ms),
        predicted_exposed_ms=accum * sum(w["exposed_ms"] for w in predicted.values()),
        measured_exposed_ms={c: statistics.median(v) for c, v in exposed_by_step.items()},
        predicted_peak_checkpoint_bytes=max([w["hbm_checkpoint_bytes"]
                                             for w in predicted.values()] or [0.0]),
        measured_peak_checkpoint_bytes=max(w.measured_hbm_bytes for w in rows),
        windows=rows,
        predicted_peak_hbm_bytes=pred.get("peak_hbm_bytes"),
        measured_peak_hbm_bytes=None if top is None else max(p["hbm_bytes"] for p in peaks),
        predicted_pinned_bytes=(pred.get("pinned_bytes") or
                                (memory.pinned_bytes_of(pred["dram_bytes"])
                                 if "dram_bytes" in pred else None)),
        measured_pinned_bytes=None if top is None else max(p["pinned_bytes"] for p in peaks),
        peak_window=None if top is None else top["window"],
        peak_owners=None if top is None else top["owners"],
        measured_host_blocked_ms=(statistics.median(blocked_by_step)
                                  if len(blocked_by_step) == len(steps) else None))


def predicted_saved_bytes(plan_dict: dict) -> dict[str, dict[str, float]] | None:
    """{window: {"d2h": bytes, "h2d": bytes}} of saved internals the plan's
    `internal_transfers` move (fraction x S1[j] at L1, x S2[j] at L2), windows with none left
    out; {} for a plan without internal transfers; None when it has some but no per-block
    sizes (provenance `saved_bytes`, [S1, S2] per block).

    Raises:
        ValueError: a transfer names a block the sizes or levels do not cover.
    """
    moves = plan_dict.get("internal_transfers") or []
    if not moves:
        return {}
    sizes = (plan_dict.get("provenance") or {}).get("saved_bytes")
    if not sizes:
        return None
    levels = plan_dict.get("save_levels") or []
    out: dict[str, dict[str, float]] = {}
    for t in moves:
        j = t["block"]
        if not (j < len(sizes) and j < len(levels)):
            raise ValueError(f"plan internal_transfers name block {j} but provenance "
                             f"saved_bytes has {len(sizes)} and save_levels {len(levels)} "
                             f"entries; re-plan with `lazytrain plan --out`")
        nbytes = t["fraction"] * sizes[j][1 if levels[j] == "L2" else 0]
        cell = out.setdefault(t["window"], dict.fromkeys(SAVED_KINDS, 0.0))
        cell[t["kind"]] += nbytes
    return out


def _row(name: str, ws: list[dict], pred: dict | None,
         pred_saved: dict[str, float] | None = None) -> WindowRow:
    med = statistics.median
    return WindowRow(
        name=name,
        predicted_ms=None if pred is None else pred["time_ms"],
        measured_ms=med(w["wall_ms"] for w in ws),
        predicted_compute_ms=None if pred is None else pred["compute_ms"],
        measured_compute_ms=med(w["compute_ms"] for w in ws),
        predicted_exposed_ms=None if pred is None else pred["exposed_ms"],
        exposed_ms={c: med(w["wait_ms"].get(c, 0.0) for w in ws) for c in CHANNELS},
        predicted_hbm_bytes=None if pred is None else pred["hbm_checkpoint_bytes"],
        measured_hbm_bytes=max(int(w["peak_bytes"].get("hbm", 0)) for w in ws),
        predicted_bytes=(None if pred is None else
                         {c: pred.get(f"{c}_bytes", 0.0) for c in BYTE_CHANNELS}),
        measured_bytes=({c: med(w["ledger"]["moved"][c] for w in ws) for c in BYTE_CHANNELS}
                        if all("ledger" in w for w in ws) else None),
        measured_ledger_hbm_bytes=(max(w["ledger"]["hbm_bytes"] for w in ws)
                                   if all("ledger" in w for w in ws) else None),
        measured_host_blocked_ms=(med(w["host_blocked_ms"] for w in ws)
                                  if all("host_blocked_ms" in w for w in ws) else None),
        predicted_saved_bytes=None if pred is None else pred_saved,
        measured_saved_bytes=({k: med(w[f"saved_{k}_bytes"] for w in ws) for k in SAVED_KINDS}
                              if all(f"saved_{k}_bytes" in w for w in ws for k in SAVED_KINDS)
                              else None))


def format_table(c: Comparison) -> str:
    """Human-readable report: per-window table, totals, the windows most wrong."""
    def ms(v):
        return f"{v:9.2f}" if v is not None else f"{'-':>9}"

    lines = [f"plan {c.plan_id}; measured = median over steps {c.steps_used}",
             f"{'window':<7} {'pred ms':>9} {'meas ms':>9} {'delta':>9} {'pred cmp':>9} "
             f"{'meas cmp':>9} {'pred exp':>9}  measured waits (ms)"]
    for w in c.windows:
        blocked = w.measured_host_blocked_ms
        waits = ", ".join([f"{k} {v:.2f}" for k, v in w.exposed_ms.items() if v >= 0.005]
                          + ([f"host-blocked {blocked:.2f}"] if blocked else []))
        lines.append(f"{w.name:<7} {ms(w.predicted_ms)} {ms(w.measured_ms)} {ms(w.delta_ms)} "
                     f"{ms(w.predicted_compute_ms)} {ms(w.measured_compute_ms)} "
                     f"{ms(w.predicted_exposed_ms)}  {waits or '-'}")
    delta = (None if c.predicted_step_ms is None else c.measured_step_ms - c.predicted_step_ms)
    lines += ["",
              f"step time      predicted {ms(c.predicted_step_ms)} ms   measured "
              f"{ms(c.measured_step_ms)} ms   delta {ms(delta)} ms",
              f"exposed        predicted {ms(c.predicted_exposed_ms)} ms   measured "
              + ", ".join(f"{k} {v:.2f}" for k, v in c.measured_exposed_ms.items()) + " ms",
              *([f"host-blocked   measured {c.measured_host_blocked_ms:9.2f} ms (compute "
                 f"stream idle while the engine's thread waited or did host work; not in "
                 f"compute)"] if c.measured_host_blocked_ms is not None else []),
              f"peak HBM ckpt  predicted {c.predicted_peak_checkpoint_bytes / 1e6:9.3f} MB   "
              f"measured {c.measured_peak_checkpoint_bytes / 1e6:9.3f} MB",
              f"peak HBM       predicted {_mb(c.predicted_peak_hbm_bytes)} MB   measured "
              f"{_mb(c.measured_peak_hbm_bytes)} MB (ledger, all owners)",
              f"pinned host    predicted {_mb(c.predicted_pinned_bytes)} MB   measured "
              f"{_mb(c.measured_pinned_bytes)} MB",
              *([f"largest at the HBM peak ({c.peak_window}): " + ", ".join(
                  f"{o} {b / 1e6:.2f} MB" for o, b in c.peak_owners.items())]
                if c.peak_owners else []),
              *_saved_lines(c),
              "most wrong: " + ", ".join(f"{w.name} ({w.delta_ms:+.2f} ms)"
                                         for w in c.most_wrong())]
    return "\n".join(lines)


def _saved_lines(c: Comparison) -> list[str]:
    """Saved internals: predicted vs measured bytes per micro-batch, then per window that moves
    any (MB); nothing when the run recorded none, or neither side moves a byte."""
    meas, pred = c.saved_totals("measured"), c.saved_totals("predicted")
    if meas is None or not (any(meas.values()) or (pred is not None and any(pred.values()))):
        return []

    def pair(p: dict | None, m: dict | None, k: str) -> str:
        return f"{k.upper()} {_mb(None if p is None else p[k]).strip()} / {_mb(m[k]).strip()}"

    out = ["saved internals (MB per micro-batch, predicted / measured): "
           + ", ".join(pair(pred, meas, k) for k in SAVED_KINDS)]
    for w in c.windows:
        m, p = w.measured_saved_bytes, w.predicted_saved_bytes
        if m is not None and (any(m.values()) or (p is not None and any(p.values()))):
            out.append(f"  {w.name:<7} " + ", ".join(pair(p, m, k) for k in SAVED_KINDS))
    return out


def _mb(nbytes: float | None) -> str:
    return f"{'-':>9}" if nbytes is None else f"{nbytes / 1e6:9.3f}"
