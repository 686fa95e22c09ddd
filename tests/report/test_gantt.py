"""Gantt PNG of a simulated plan and of measured window durations."""

from __future__ import annotations

import pytest

from lazytrain.planner.plan import Plan, Transfer
from lazytrain.planner.problem import PlanningProblem
from lazytrain.report.gantt import (
    Bar, bars_from_events, render_gantt, render_sim_gantt, spans_from_durations,
)
from lazytrain.sim import simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _problem() -> PlanningProblem:
    L = 2
    return PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.5,) * L, bwd_ms=(2.0,) * L, weight_bytes=(1000,) * L,
        grad_bytes=(1000,) * L, internal_bytes=(0,) * L, boundary_bytes=(1000,) * (L + 1),
        params_per_block=(1,) * L, embed_ms=0.5, head_ms=1.0, h2d_bytes_per_s=1e6,
        d2h_bytes_per_s=1e6, duplex_bytes_per_s=2e6, nvme_read_bytes_per_s=1e6,
        nvme_write_bytes_per_s=1e6, hbm_bytes=10**9, dram_bytes=10**9, nvme_bytes=10**9)


def _nvme_plan() -> Plan:
    t = [("d2h", "f0"), ("nvme_write", "f0"), ("nvme_read", "turn"), ("h2d", "b1")]
    return Plan(tiers=("nvme", "hbm", "hbm"),
                transfers=tuple(Transfer(boundary=0, kind=k, window=w, fraction=1.0)
                                for k, w in t))


def test_bars_cover_every_stream_the_plan_uses():
    r = simulate(_problem(), _nvme_plan())
    rows = {b.row for b in bars_from_events(r.events)}
    assert rows == {"compute", "h2d", "d2h", "nvme_read", "nvme_write"}


def test_sim_gantt_writes_a_png_atomically(tmp_path):
    pytest.importorskip("matplotlib")
    out = render_sim_gantt(simulate(_problem(), _nvme_plan()), tmp_path / "plan.png",
                           title="tiny nvme plan")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # no temp file left behind


def test_measured_windows_render_from_durations(tmp_path):
    pytest.importorskip("matplotlib")
    spans = spans_from_durations(["f0", "turn", "b0"], [2.0, 1.0, 3.5])
    assert [(s.start_ms, s.end_ms) for s in spans] == [(0.0, 2.0), (2.0, 3.0), (3.0, 6.5)]
    bars = [Bar(row="compute", start_ms=0.0, end_ms=6.0, kind="fwd", label="measured")]
    assert render_gantt(tmp_path / "m.png", bars=bars, windows=spans).stat().st_size > 0


def test_durations_and_names_must_pair_up():
    with pytest.raises(ValueError, match="3 window names but 2 durations"):
        spans_from_durations(["f0", "turn", "b0"], [1.0, 2.0])


def _long_problem(L: int = 64) -> PlanningProblem:
    return PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.5,) * L, bwd_ms=(2.0,) * L, weight_bytes=(1000,) * L,
        grad_bytes=(1000,) * L, internal_bytes=(0,) * L, boundary_bytes=(1000,) * (L + 1),
        params_per_block=(1,) * L, embed_ms=0.5, head_ms=1.0, h2d_bytes_per_s=1e6,
        d2h_bytes_per_s=1e6, duplex_bytes_per_s=2e6, nvme_read_bytes_per_s=1e6,
        nvme_write_bytes_per_s=1e6, hbm_bytes=10**9, dram_bytes=10**9, nvme_bytes=10**9)


def _figure_of(result):
    from lazytrain.report.gantt import build_figure, spans_from_windows
    return build_figure([(bars_from_events(result.events), spans_from_windows(result.windows),
                          "64 blocks")])


def _window_name_boxes(fig, ax):
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in ax.texts if t.get_text()[:1] in "fbtp"]


def test_64_block_plan_is_1600_px_wide_split_into_forward_and_backward_panels():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    fig = _figure_of(simulate(_long_problem(), Plan(tiers=("hbm",) * 65, transfers=())))
    try:
        width_px = fig.get_size_inches()[0] * fig.dpi
        assert width_px == 1600
        titles = [ax.get_title() for ax in fig.axes]
        assert titles == ["64 blocks: forward", "64 blocks: backward"]
        for ax in fig.axes:
            names = [t.get_text() for t in ax.texts if t.get_text()[:1] in "fbtp"]
            assert len(names) >= 60  # f0..f63 + turn, or b63..b0 + post: nearly all named
            assert min(t.get_fontsize() for t in ax.texts) >= 7
            boxes = sorted(_window_name_boxes(fig, ax), key=lambda b: b.x0)
            for left, right in zip(boxes, boxes[1:]):  # no two window names overlap
                assert left.x1 <= right.x0 + 0.5, (left, right)
    finally:
        plt.close(fig)


def test_legend_has_an_entry_for_every_colour_drawn():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex
    fig = _figure_of(simulate(_problem(), _nvme_plan()))
    try:
        drawn = {to_hex(c) for ax in fig.axes for coll in ax.collections
                 for c in coll.get_facecolors()}
        legend = fig.legends[0]
        entries = {to_hex(h.get_facecolor()): t.get_text()
                   for h, t in zip(legend.legend_handles, legend.get_texts())}
        assert drawn <= set(entries), drawn - set(entries)
        assert "NVMe write" in entries.values() and "NVMe read" in entries.values()
        assert any("window" in text for text in entries.values())  # the shading too
    finally:
        plt.close(fig)


def test_measured_waits_have_their_own_legend_entries():
    from lazytrain.report.gantt import KIND_COLORS, KIND_LABELS, bars_from_measured
    spans = spans_from_durations(["f0", "b0"], [3.0, 4.0])
    windows = [{"compute_ms": 1.0, "wait_ms": {"h2d": 1.0, "optimizer": 0.5}},
               {"compute_ms": 2.0, "wait_ms": {"d2h": 1.5}}]
    kinds = {b.kind for b in bars_from_measured(windows, spans)}
    assert kinds == {"fwd", "bwd", "wait_h2d", "optimizer", "wait_d2h"}
    assert all(k in KIND_COLORS and "measured" in KIND_LABELS[k] for k in kinds - {"fwd", "bwd"})
    assert set(KIND_LABELS) == set(KIND_COLORS)
