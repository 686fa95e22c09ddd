"""The duplex rule: how an H2D and a D2H copy of one window share the link's cap on both.

Owns the time the two directions of a GPU window take together (`duplex_ms`, the evaluator's
"duplex" term) and the same function as a maximum of linear pieces (`duplex_pieces`, the
MILP's `time_duplex` rows). The rule (docs/execution_model.md, "Duplex sharing"): both copy
streams start at the window's start; a lone copy runs at its own rate; while both run they
share the cap max-min fairly (each gets min(own rate, cap / 2), and the one that needs less
leaves the rest to the other), which is what two DMA engines competing for the link get with
no pacing by the engine; when one ends, the other continues at its own rate. A cap below a
direction's own rate (a measurement under load) counts as that rate: running both never makes
the pair slower than the faster copy alone. The event simulator (`sim/events.py`) applies the
same rule task by task, from its own code.

Pure Python; no solver, no torch.
"""

from __future__ import annotations


def effective_cap(h2d_rate: float, d2h_rate: float, duplex_rate: float) -> float:
    """The cap the rule uses: max(duplex, h2d, d2h) (any rate unit, the same for all three)."""
    return max(duplex_rate, h2d_rate, d2h_rate)


def shared_rates(h2d_rate: float, d2h_rate: float, duplex_rate: float) -> tuple[float, float]:
    """(H2D rate, D2H rate) while both copies run: the max-min fair split of the cap.

    Args:
        h2d_rate, d2h_rate: each direction's own rate, > 0 (any rate unit).
        duplex_rate: the cap on their sum (same unit; raised to `effective_cap`).
    """
    cap = effective_cap(h2d_rate, d2h_rate, duplex_rate)
    if h2d_rate + d2h_rate <= cap:
        return h2d_rate, d2h_rate
    if h2d_rate <= cap / 2:
        return h2d_rate, cap - h2d_rate
    if d2h_rate <= cap / 2:
        return cap - d2h_rate, d2h_rate
    return cap / 2, cap / 2


def duplex_ms(h2d_bytes: float, d2h_bytes: float, *, h2d_bytes_per_s: float,
              d2h_bytes_per_s: float, duplex_bytes_per_s: float) -> float:
    """Time until both copies of a window have ended, ms, under the duplex rule.

    Phase 1: both run at `shared_rates` until the first ends; phase 2: the other finishes
    alone at its own rate. With no cap binding this is max(h2d / bw_h2d, d2h / bw_d2h).
    """
    h, d = float(h2d_bytes), float(d2h_bytes)
    if h <= 0 or d <= 0:
        return max(h / h2d_bytes_per_s, d / d2h_bytes_per_s, 0.0) * 1e3
    sh, sd = shared_rates(h2d_bytes_per_s, d2h_bytes_per_s, duplex_bytes_per_s)
    first = min(h / sh, d / sd)
    left_h, left_d = h - sh * first, d - sd * first
    return (first + max(left_h, 0.0) / h2d_bytes_per_s + max(left_d, 0.0) / d2h_bytes_per_s
            ) * 1e3


def duplex_pieces(h2d_rate: float, d2h_rate: float, duplex_rate: float
                  ) -> tuple[tuple[float, float], ...]:
    """Linear pieces (a, b) with `duplex time = max over pieces of a * H2D + b * D2H`.

    Time units per byte unit of the rates given (GB/ms in, ms per GB out for the MILP). The
    two lone pieces (1/bw_h2d, 0) and (0, 1/bw_d2h) are left out (the H2D and D2H rows have
    them). Derivation, with r_h, r_d the own rates and X the effective cap:
    - r_h + r_d <= X: nothing is shared; no piece.
    - r_h <= X/2 (H2D keeps its rate, D2H gets X - r_h while both run): when H2D ends first,
      D2H moves (X - r_h) H / r_h meanwhile and the rest at r_d:
      T = H / r_h (1 - (X - r_h) / r_d) + D / r_d; symmetric for r_d <= X/2.
    - both > X/2 (each X/2 while both run): D2H ends first: T = D / (X/2) + (H - D) / r_h;
      H2D first: T = H / (X/2) + (D - H) / r_d. Their maximum is the time because X >= the
      harmonic mean of r_h and r_d (X >= max(r_h, r_d)), so each piece is below the other on
      the other's side.
    Each piece is a lower bound everywhere and exact on its side, so the maximum is exact and
    convex: an epigraph row per piece, no binary.
    """
    cap = effective_cap(h2d_rate, d2h_rate, duplex_rate)
    rh, rd = h2d_rate, d2h_rate
    if rh + rd <= cap:
        return ()
    if rh <= cap / 2:
        return ((1 / rh * (1 - (cap - rh) / rd), 1 / rd),)
    if rd <= cap / 2:
        return ((1 / rh, 1 / rd * (1 - (cap - rd) / rh)),)
    half = cap / 2
    return ((1 / rh, 1 / half - 1 / rh), (1 / half - 1 / rd, 1 / rd))
