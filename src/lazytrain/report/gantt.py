"""Gantt chart (PNG) of a step's timeline: one row per stream, windows shaded and labelled.

Owns drawing only. Input is plain bars and window spans, so the same function draws a plan's
simulated timeline (`lazytrain.sim.SimResult`, converted by `bars_from_events` and
`spans_from_windows`, which read attributes and import nothing from `sim`) and, later, measured
windows from the runtime's instrumentation (`spans_from_durations`, `bars_from_measured`), and both one above the other (`render_panels`).
`bars_from_planned` draws a plan's windows without a simulator: compute from the window start,
then the exposed remainder. matplotlib (Agg backend)
is imported only when a chart is drawn; it is the `report` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from lazytrain.atomic import atomic_path

ROWS = ("compute", "h2d", "d2h", "nvme_read", "nvme_write")
"""Rows top to bottom: the compute stream and the four copy channels."""

KIND_COLORS = {
    "fwd": "#4C72B0", "fwd_grad": "#55A868", "bwd": "#C44E52", "recompute": "#DD8452",
    "head": "#8172B3", "embed": "#937860", "weights": "#64B5CD", "grad": "#DA8BC3",
    "d2h": "#8C8C8C", "h2d": "#CCB974", "nvme_read": "#4C4C4C", "nvme_write": "#A0A0A0",
    "exposed": "#E5AE38", "optimizer": "#B07AA1",
}
"""Bar colour per task kind (others: grey)."""

_MAX_WINDOW_LABELS = 48
"""Above this many windows only every k-th window is labelled (readability)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Bar:
    """One task on one row, ms from the start of the timeline."""

    row: str
    start_ms: float
    end_ms: float
    label: str = ""
    kind: str = ""


@dataclass(kw_only=True, frozen=True, slots=True)
class Span:
    """One window (f3, turn, b3, pre, post), ms."""

    name: str
    start_ms: float
    end_ms: float


def bars_from_events(events: Iterable) -> list[Bar]:
    """Bars from objects with `stream`, `start_ms`, `end_ms`, `name`, `kind` (SimEvent)."""
    return [Bar(row=e.stream, start_ms=e.start_ms, end_ms=e.end_ms, label=e.name, kind=e.kind)
            for e in events]


def spans_from_windows(windows: Iterable) -> list[Span]:
    """Spans from objects with `name`, `start_ms`, `end_ms` (SimWindow)."""
    return [Span(name=w.name, start_ms=w.start_ms, end_ms=w.end_ms) for w in windows]


def spans_from_durations(names: Sequence[str], durations_ms: Sequence[float]) -> list[Span]:
    """Back-to-back spans from measured window durations (ms), in execution order.

    Raises:
        ValueError: the two sequences differ in length or a duration is negative.
    """
    if len(names) != len(durations_ms):
        raise ValueError(f"got {len(names)} window names but {len(durations_ms)} durations")
    out, t = [], 0.0
    for name, d in zip(names, durations_ms):
        if d < 0:
            raise ValueError(f"window {name}: duration {d} ms is negative")
        out.append(Span(name=name, start_ms=t, end_ms=t + d))
        t += d
    return out


def render_gantt(path: str | Path, *, bars: Sequence[Bar], windows: Sequence[Span] = (),
                 title: str = "", rows: Sequence[str] = ROWS) -> Path:
    """Draw the chart and write it as PNG atomically (temp file + rename).

    Args:
        path: output file (.png).
        bars: tasks; a bar whose row is not in `rows` is skipped.
        windows: spans shaded alternately and labelled above the rows.
        title: chart title.
        rows: row order, top to bottom.

    Returns:
        The written path.

    Raises:
        ImportError: matplotlib is not installed (`pip install lazytrain[report]`).
    """
    return render_panels(path, panels=[(bars, windows, title)], rows=rows)


def render_panels(path: str | Path, *, panels: Sequence[tuple[Sequence[Bar], Sequence[Span], str]],
                  rows: Sequence[str] = ROWS) -> Path:
    """Several timelines one above the other on one time axis, written as PNG atomically.

    Args:
        path: output file (.png).
        panels: (bars, window spans, title) per panel, top to bottom.
        rows: row order of every panel, top to bottom.

    Returns:
        The written path.

    Raises:
        ImportError: matplotlib is not installed (`pip install lazytrain[report]`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    end = max([b.end_ms for bars, _, _ in panels for b in bars]
              + [w.end_ms for _, spans, _ in panels for w in spans] + [1e-9])
    n_windows = max(len(spans) for _, spans, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(max(8.0, min(40.0, 4.0 + 0.12 * n_windows)),
                                      0.4 + 2.8 * len(panels)))
    for ax, (bars, spans, title) in zip(axes[:, 0], panels):
        _draw(ax, bars=bars, windows=spans, title=title, rows=rows, end=end)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=150)
    finally:
        plt.close(fig)
    return path


def _draw(ax, *, bars: Sequence[Bar], windows: Sequence[Span], title: str,
          rows: Sequence[str], end: float) -> None:
    y = {r: len(rows) - 1 - k for k, r in enumerate(rows)}
    step = max(1, -(-len(windows) // _MAX_WINDOW_LABELS))
    for k, w in enumerate(windows):
        ax.axvspan(w.start_ms, w.end_ms, color="#EEEEEE" if k % 2 else "#FFFFFF", zorder=0)
        if k % step == 0:
            ax.text((w.start_ms + w.end_ms) / 2, len(rows) - 0.35, w.name, ha="center",
                    va="bottom", fontsize=6, rotation=90 if len(windows) > 24 else 0)
    for b in bars:
        if b.row not in y or b.end_ms <= b.start_ms:
            continue
        ax.broken_barh([(b.start_ms, b.end_ms - b.start_ms)], (y[b.row] - 0.4, 0.8),
                       facecolors=KIND_COLORS.get(b.kind, "#BBBBBB"), edgecolor="white",
                       linewidth=0.3, zorder=2)
        if b.label and (b.end_ms - b.start_ms) > end / 60:
            ax.text((b.start_ms + b.end_ms) / 2, y[b.row], b.label, ha="center", va="center",
                    fontsize=5, color="white", zorder=3, clip_on=True)
    ax.set_yticks([y[r] for r in rows], list(rows))
    ax.set_ylim(-0.6, len(rows) + 0.4)
    ax.set_xlim(0, end)
    if title:
        ax.set_title(title, fontsize=9)


def render_sim_gantt(result, path: str | Path, *, title: str = "") -> Path:
    """Gantt PNG of one simulated micro-batch (`lazytrain.sim.SimResult`); see `render_gantt`."""
    return render_gantt(path, bars=bars_from_events(result.events),
                        windows=spans_from_windows(result.windows), title=title)


def bars_from_planned(windows: Iterable, spans: Sequence[Span]) -> list[Bar]:
    """Compute bars (window start + compute_ms) and an `exposed` bar for the rest of each window.

    Args:
        windows: plan window records with `name`, `compute_ms`, `time_ms` (dicts or objects).
        spans: the windows' spans (same order), e.g. `spans_from_durations` of their time_ms.
    """
    out = []
    for w, s in zip(windows, spans):
        get = w.get if isinstance(w, dict) else (lambda k, w=w: getattr(w, k))
        c = min(float(get("compute_ms")), s.end_ms - s.start_ms)
        out.append(Bar(row="compute", start_ms=s.start_ms, end_ms=s.start_ms + c,
                       label=s.name, kind=_compute_kind(s.name)))
        if s.end_ms > s.start_ms + c:
            out.append(Bar(row="compute", start_ms=s.start_ms + c, end_ms=s.end_ms,
                           kind="exposed"))
    return out


def bars_from_measured(windows: Sequence[dict], spans: Sequence[Span]) -> list[Bar]:
    """Bars of measured windows (windows.jsonl `windows` entries), laid out per window.

    Within a window the measured quantities are totals, not a trace, so the layout is
    schematic: compute from the window start for `compute_ms`, then each channel's wait in
    CHANNEL order on its own row (the optimizer's wait on the compute row, kind `optimizer`).
    """
    out = []
    for w, s in zip(windows, spans):
        t = s.start_ms + w["compute_ms"]
        out.append(Bar(row="compute", start_ms=s.start_ms, end_ms=t, label=s.name,
                       kind=_compute_kind(s.name)))
        for channel in ("optimizer", "h2d", "d2h", "nvme_read", "nvme_write"):
            ms = w["wait_ms"].get(channel, 0.0)
            if ms > 0:
                row = "compute" if channel == "optimizer" else channel
                out.append(Bar(row=row, start_ms=t, end_ms=t + ms, kind=channel))
                t += ms
    return out


def _compute_kind(name: str) -> str:
    return {"f": "fwd", "b": "bwd", "t": "head", "p": "embed"}.get(name[:1], "")
