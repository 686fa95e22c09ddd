"""Gantt chart (PNG) of a step's timeline: one row per stream, windows shaded and labelled.

Owns drawing only. Input is plain bars and window spans, so the same function draws a plan's
simulated timeline (`lazytrain.sim.SimResult`, converted by `bars_from_events` and
`spans_from_windows`, which read attributes and import nothing from `sim`) and, later, measured
windows from the runtime's instrumentation (`spans_from_durations`, `bars_from_measured`), and both one above the other (`render_panels`).
Every image is `FIG_WIDTH_PX` wide with a legend entry for every colour drawn; a long timeline
(a 64-block step) is split into a forward and a backward panel so its window names stay legible.
The saved internals of L1/L2 blocks in the dram tier (`saved_d2h`, `saved_h2d`) get their
own colours on the D2H and H2D rows, apart from the boundaries' offloads and prefetches.
`bars_from_planned` draws a plan's windows without a simulator: compute from the window start,
then the exposed remainder. matplotlib (Agg backend) is imported only when a chart is drawn
(`_matplotlib`); it is the `report` extra.
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
    "d2h": "#8C8C8C", "h2d": "#CCB974", "nvme_read": "#4C4C4C", "nvme_write": "#1F9E89",
    "saved_d2h": "#6A3D9A", "saved_h2d": "#B15928",
    "exposed": "#E5AE38", "optimizer": "#B07AA1",
    "wait_h2d": "#CCB974", "wait_d2h": "#8C8C8C", "wait_nvme_read": "#4C4C4C",
    "wait_nvme_write": "#1F9E89",
}
"""Bar colour per task kind (others: grey)."""

KIND_LABELS = {
    "fwd": "forward", "fwd_grad": "forward, internals kept for backward", "bwd": "backward",
    "recompute": "recompute", "head": "LM head + loss", "embed": "embedding",
    "weights": "weight H2D", "grad": "gradient D2H", "d2h": "activation D2H (offload)",
    "h2d": "activation H2D (prefetch)", "nvme_read": "NVMe read", "nvme_write": "NVMe write",
    "saved_d2h": "saved internals D2H (L1/L2, dram)",
    "saved_h2d": "saved internals H2D (L1/L2, dram)",
    "exposed": "exposed wait (planned)", "optimizer": "optimizer wait (measured)",
    "wait_h2d": "H2D wait (measured)", "wait_d2h": "D2H wait (measured)",
    "wait_nvme_read": "NVMe read wait (measured)", "wait_nvme_write": "NVMe write wait (measured)",
}
"""Legend text per task kind (one entry per colour in `KIND_COLORS`)."""
OTHER_COLOR = "#BBBBBB"
SHADE_COLOR = "#EEEEEE"

FIG_WIDTH_PX = 1600
"""Image width: a laptop screen's width at 100% zoom, so 8-10 pt text stays legible."""
DPI = 100
AXES_WIDTH_PX = 0.88 * FIG_WIDTH_PX
"""Approximate plot-area width (the rest is row names and margins), for label fitting."""
SPLIT_ABOVE_WINDOWS = 40
"""A timeline of more windows is drawn as a forward and a backward panel: a 64-block step has
131 windows, about 11 px each on one 1400 px axis, 21 px in two."""
ROW_IN, PANEL_OVERHEAD_IN, LEGEND_IN = 0.32, 1.15, 0.55
"""Inches per stream row, per panel (title, window names, time axis) and for the legend."""
WINDOW_LABEL_PX_PER_CHAR = 5
"""Width of one character of a 7 pt label at 100 dpi, px (horizontal window names)."""
WINDOW_LABEL_MIN_GAP_PX = 11
"""Rotated window names closer than this overlap (a 7 pt line is about 10 px)."""
BAR_LABEL_PX_PER_CHAR = 5
"""A bar shows its label only when it is this wide per character (plus one), px."""
WINDOW_LABEL_PAD_PT = 26
"""Title padding above the window names, points."""


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
        rows: row order, top to bottom (rows without any bar are left out).

    Returns:
        The written path.

    Raises:
        ImportError: matplotlib is not installed (`pip install lazytrain[report]`).
    """
    return render_panels(path, panels=[(bars, windows, title)], rows=rows)


def split_phases(bars: Sequence[Bar], spans: Sequence[Span], title: str
                 ) -> list[tuple[list[Bar], list[Span], str]]:
    """One timeline as one panel, or as two (forward up to the turn, backward from the first
    b window) when it has more than `SPLIT_ABOVE_WINDOWS` windows. A bar goes to each panel it
    overlaps in time; the panel's time range clips it."""
    first_b = next((k for k, s in enumerate(spans) if s.name.startswith("b")), None)
    if len(spans) <= SPLIT_ABOVE_WINDOWS or not first_b:
        return [(list(bars), list(spans), title)]
    cut = spans[first_b].start_ms
    return [([b for b in bars if b.start_ms < cut], list(spans[:first_b]),
             f"{title}: forward" if title else "forward"),
            ([b for b in bars if b.end_ms > cut], list(spans[first_b:]),
             f"{title}: backward" if title else "backward")]


def render_panels(path: str | Path, *, panels: Sequence[tuple[Sequence[Bar], Sequence[Span], str]],
                  rows: Sequence[str] = ROWS) -> Path:
    """Several timelines one above the other, `FIG_WIDTH_PX` wide, with a legend of every colour
    drawn, written as PNG atomically.

    A timeline of more than `SPLIT_ABOVE_WINDOWS` windows is split into a forward and a
    backward panel (`split_phases`); the forward panels of every timeline come first, then the
    backward ones, so that a planned and a measured phase sit next to each other. Each panel has
    its own time axis (ms). Rows without any bar in any panel are left out.

    Args:
        path: output file (.png).
        panels: (bars, window spans, title) per timeline, top to bottom.
        rows: row order of every panel, top to bottom.

    Returns:
        The written path.

    Raises:
        ImportError: matplotlib is not installed (`pip install lazytrain[report]`).
    """
    fig = build_figure(panels, rows=rows)
    try:
        with atomic_path(Path(path)) as tmp:
            fig.savefig(tmp, format="png", dpi=DPI)
    finally:
        _matplotlib().pyplot.close(fig)
    return Path(path)


def _matplotlib():
    """The matplotlib package with `pyplot` (and with it `patches`) loaded, drawing on the Agg
    backend: into files, no display needed.

    Raises:
        ImportError: matplotlib is not installed (`pip install lazytrain[report]`).
    """
    import matplotlib.pyplot  # lazy: optional dependency (the [report] extra)

    matplotlib.use("Agg")  # a no-op once Agg is the backend, so open figures stay open
    return matplotlib


def build_figure(panels: Sequence[tuple[Sequence[Bar], Sequence[Span], str]], *,
                 rows: Sequence[str] = ROWS):
    """The matplotlib figure `render_panels` writes (the caller closes it).

    Raises:
        ImportError: matplotlib is not installed (`pip install lazytrain[report]`).
    """
    plt = _matplotlib().pyplot
    parts = [split_phases(bars, spans, title) for bars, spans, title in panels]
    drawn = [p[k] for k in range(max(len(p) for p in parts)) for p in parts if k < len(p)]
    used = {b.row for bars, _, _ in drawn for b in bars if b.end_ms > b.start_ms}
    rows = [r for r in rows if r in used or r == "compute"]
    panel_h = PANEL_OVERHEAD_IN + ROW_IN * len(rows)
    fig_h = panel_h * len(drawn) + LEGEND_IN
    fig, axes = plt.subplots(len(drawn), 1, squeeze=False,
                             figsize=(FIG_WIDTH_PX / DPI, fig_h), dpi=DPI)
    for ax, (bars, spans, title) in zip(axes[:, 0], drawn):
        _draw(ax, bars=bars, windows=spans, title=title, rows=rows)
    kinds = [k for k in KIND_COLORS if any(b.kind == k for bars, _, _ in drawn for b in bars)]
    _legend(fig, kinds, other=any(b.kind not in KIND_COLORS for bs, _, _ in drawn for b in bs))
    fig.tight_layout(rect=(0, LEGEND_IN / fig_h, 1, 1), h_pad=0.6)
    return fig


def _legend(fig, kinds: Sequence[str], *, other: bool) -> None:
    """One legend entry per colour drawn, and one for the window shading, under the panels."""
    patches = _matplotlib().patches
    handles = [patches.Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in kinds]
    if other:
        handles.append(patches.Patch(facecolor=OTHER_COLOR, label="other task"))
    handles.append(patches.Patch(facecolor=SHADE_COLOR, edgecolor="#999999", linewidth=0.5,
                                 label="window (shaded every other)"))
    ncol = len(handles) if len(handles) <= 7 else -(-len(handles) // 2)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=9, frameon=False)


def _draw(ax, *, bars: Sequence[Bar], windows: Sequence[Span], title: str,
          rows: Sequence[str]) -> None:
    """One panel: window shading and names on top, one bar row per stream, labels inside the
    bars wide enough to hold them."""
    y = {r: len(rows) - 1 - k for k, r in enumerate(rows)}
    if windows:  # the panel's own phase; bars reaching past it are clipped
        lo, hi = windows[0].start_ms, max(windows[-1].end_ms, windows[0].start_ms + 1e-9)
    else:
        lo = min([b.start_ms for b in bars] + [0.0])
        hi = max([b.end_ms for b in bars] + [lo + 1e-9])
    px_per_ms = AXES_WIDTH_PX / (hi - lo)
    _window_labels(ax, windows, px_per_ms=px_per_ms)
    for b in bars:
        if b.row not in y or b.end_ms <= b.start_ms:
            continue
        ax.broken_barh([(b.start_ms, b.end_ms - b.start_ms)], (y[b.row] - 0.4, 0.8),
                       facecolors=KIND_COLORS.get(b.kind, OTHER_COLOR), edgecolor="white",
                       linewidth=0.3, zorder=2)
        if b.label and (b.end_ms - b.start_ms) * px_per_ms >= BAR_LABEL_PX_PER_CHAR * (
                len(b.label) + 1):
            ax.text((b.start_ms + b.end_ms) / 2, y[b.row], b.label, ha="center", va="center",
                    fontsize=7, color="white", zorder=3, clip_on=True)
    ax.set_yticks([y[r] for r in rows], list(rows), fontsize=9)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(lo, hi)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("time (ms)", fontsize=8, labelpad=1)
    if title:
        ax.set_title(title, fontsize=10, pad=WINDOW_LABEL_PAD_PT if windows else 4)


def _window_labels(ax, windows: Sequence[Span], *, px_per_ms: float) -> None:
    """Shade windows alternately and name them above the axes: horizontal when every name
    fits its window, else rotated, every k-th so that names are at least a line apart."""
    if not windows:
        return
    widths_px = [(w.end_ms - w.start_ms) * px_per_ms for w in windows]
    fits = [wpx >= WINDOW_LABEL_PX_PER_CHAR * (len(w.name) + 1)
            for w, wpx in zip(windows, widths_px)]
    flat = sum(fits) * 2 >= len(windows)  # most names fit: horizontal, skip those that do not
    mean_px = sum(widths_px) / len(widths_px)
    step = 1 if flat else max(1, -(-WINDOW_LABEL_MIN_GAP_PX // max(mean_px, 1e-9)))
    for k, w in enumerate(windows):
        ax.axvspan(w.start_ms, w.end_ms, color=SHADE_COLOR if k % 2 else "#FFFFFF", zorder=0)
        if (fits[k] if flat else k % step == 0):
            ax.text((w.start_ms + w.end_ms) / 2, 1.02, w.name, ha="center", va="bottom",
                    fontsize=7, rotation=0 if flat else 90, transform=ax.get_xaxis_transform())


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
                kind = "optimizer" if channel == "optimizer" else f"wait_{channel}"
                out.append(Bar(row=row, start_ms=t, end_ms=t + ms, kind=kind))
                t += ms
    return out


def _compute_kind(name: str) -> str:
    return {"f": "fwd", "b": "bwd", "t": "head", "p": "embed"}.get(name[:1], "")
