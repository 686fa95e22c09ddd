"""The ends' gradient is accumulated on the device over the step and drains once, in `post` of
the step's last micro-batch (docs/execution_model.md, "Step time" and the ends paragraph): the
terms by hand, and the evaluator, the MILP's constant and the event simulator agreeing."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import Decisions, evaluate
from lazytrain.planner.milp_inputs import scale_inputs
from lazytrain.planner.plan import Plan
from lazytrain.planner.window_time import ends_step_ms, post_ms
from lazytrain.sim.simulate import disagreements, simulate
from test_prefetch_post import ALL_HBM, GB, _problem

# test_prefetch_post's worked example (GPU, grad_accum 2) with a 1 GB ends gradient
# (D2H 10 GB/s: 100 ms; host accumulation 20 GB/s: 50 ms):
#   micro-batch 0: post = max(P0 H2D 100, G0 D2H 50, both within the cap 20: 100,
#                             conversion 50 + accumulation 25 = 75) = 100 (no ends gradient;
#                             charged: G0 + ends 150 ms on the link, 150 with the load)
#   micro-batch 1: post = max(G0 + ends D2H 150, accumulation 25 + 50 = 75) = 150
#   ends = pre 100 + post 100 + pre 20 + post 150 = 370 (420 with the ends in both posts)
# grad_accum 3: 100 + 2 x (100 + 20) + 150 = 490.
# CPU: pre 170, pre (next) 20, post (prefetch) 100 + 50 + 50 + 25 = 225,
#   post 150 + 75 = 225: ends 640.
ENDS = {"ends_grad_bytes": GB}


def test_only_the_last_post_drains_the_ends_gradient_by_hand():
    p = _problem(**ENDS)
    assert post_ms(p, prefetch=True) == pytest.approx(100.0)
    assert post_ms(p) == pytest.approx(150.0)
    assert ends_step_ms(p) == pytest.approx(370.0)
    assert ends_step_ms(_problem(grad_accum=3, **ENDS)) == pytest.approx(490.0)
    assert ends_step_ms(_problem(copies_overlap_compute=False, **ENDS)) == pytest.approx(640.0)


@pytest.mark.parametrize("kw,ends", [({}, 370.0), ({"grad_accum": 3}, 490.0),
                                     ({"copies_overlap_compute": False}, 640.0)],
                         ids=["gpu", "ga3", "cpu"])
def test_evaluator_milp_and_simulator_charge_the_ends_gradient_once(kw, ends):
    p = _problem(**ENDS, **kw)
    ev = evaluate(p, Decisions(tiers=ALL_HBM))
    windows = sum(w.time_ms for w in ev.windows)
    assert ev.step_ms == pytest.approx(p.grad_accum * windows + ends + 3.0)
    assert scale_inputs(p).step_const_ms == pytest.approx(ends + 3.0)
    plan = Plan(tiers=ALL_HBM)
    assert simulate(p, plan).step_ms == pytest.approx(ev.step_ms)
    assert disagreements(p, plan) == []
