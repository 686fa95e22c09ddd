"""Block 0's weights for micro-batch m + 1 load in `post` of micro-batch m (docs/execution_model.md,
"Step time"): the `pre`/`post` terms of every micro-batch of a step computed by hand, and the
evaluator, the MILP's constant and the event simulator agreeing with them."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import Decisions, evaluate
from lazytrain.planner.milp_inputs import scale_inputs
from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.window_time import ends_step_ms, post_ms, pre_ms
from lazytrain.sim.simulate import disagreements, simulate

GB = 10**9


def _problem(**kw) -> PlanningProblem:
    """The worked example of docs/execution_model.md "Step time": 2 blocks, embed 20 ms,
    P = 1 GB (host_convert: Pc = 1 GB), G = 0.5 GB, no ends gradient; H2D and D2H 10 GB/s
    (P: 100 ms, G: 50 ms), duplex cap 20 GB/s; host conversion and accumulation 20 GB/s
    (P: 50 ms, G: 25 ms); grad_accum 2 (every drain is added on the host); const 3 ms."""
    base = dict(
        fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), bwd_ms=(20.0, 20.0),
        weight_bytes=(GB,) * 2, grad_bytes=(GB // 2,) * 2, internal_bytes=(GB // 10,) * 2,
        boundary_bytes=(GB // 10,) * 3, params_per_block=(10**8,) * 2,
        embed_ms=20.0, head_ms=4.0, const_ms=3.0,
        h2d_bytes_per_s=10 * GB, d2h_bytes_per_s=10 * GB, duplex_bytes_per_s=20 * GB,
        nvme_read_bytes_per_s=5 * GB, nvme_write_bytes_per_s=5 * GB,
        host_convert_bytes_per_s=20 * GB, host_accumulate_bytes_per_s=20 * GB,
        hbm_bytes=10**13, fixed_hbm_bytes=0, dram_bytes=10**13, nvme_bytes=0,
        allow_keep=False, grad_accum=2,
    )
    base.update(kw)
    return PlanningProblem(**base)


ALL_HBM = ("hbm", "hbm", "hbm")

# GPU, grad_accum 2:
#   micro-batch 0: pre  = max(embed 20, P0 H2D 100, P0 conversion 50) = 100
#                  post = max(P0 H2D 100, G0 D2H 50, both within the cap 20: 100,
#                             conversion 50 + accumulation 25 = 75) = 100  (prefetch for m 1)
#   micro-batch 1: pre  = embed 20 (block 0 already on the device)
#                  post = max(G0 D2H 50, accumulation 25) = 50
#   ends = 100 + 100 + 20 + 50 = 270 (one pre load per step: 2 x (100 + 50) = 300 before)
# Duplex cap 10 GB/s: in post of m 0 P0 (1 GB) and G0 (0.5 GB) share 5 GB/s each until G0
# ends (100 ms), P0's last 0.5 GB alone at 10 GB/s (50 ms): 150; ends 320.
# grad_accum 3: 100 + 2 x (100 + 20) + 50 = 390.
# CPU (every term adds up): pre (load) 20 + 100 + 50 = 170, pre (next) 20, post (prefetch)
# 100 + 50 + 50 + 25 = 225, post 50 + 25 = 75: ends 490.


def test_pre_and_post_terms_by_hand():
    p = _problem()
    assert pre_ms(p) == pytest.approx(100.0)
    assert pre_ms(p, load=False) == pytest.approx(20.0)
    assert post_ms(p, prefetch=True) == pytest.approx(100.0)
    assert post_ms(p) == pytest.approx(50.0)
    assert ends_step_ms(p) == pytest.approx(270.0)
    assert ends_step_ms(_problem(duplex_bytes_per_s=10 * GB)) == pytest.approx(320.0)
    assert ends_step_ms(_problem(grad_accum=3)) == pytest.approx(390.0)
    assert ends_step_ms(_problem(copies_overlap_compute=False)) == pytest.approx(490.0)


def test_one_micro_batch_loads_block_0_in_pre_only():
    # grad_accum 1: no prefetch; the drain lands in the accumulator (no host add): post 50
    p = _problem(grad_accum=1)
    assert ends_step_ms(p) == pytest.approx(100.0 + 50.0)


@pytest.mark.parametrize("kw,ends", [({}, 270.0), ({"duplex_bytes_per_s": 10 * GB}, 320.0),
                                     ({"grad_accum": 3}, 390.0),
                                     ({"copies_overlap_compute": False}, 490.0)],
                         ids=["gpu", "gpu_shared_link", "ga3", "cpu"])
def test_evaluator_and_milp_charge_the_hand_computed_ends(kw, ends):
    p = _problem(**kw)
    ev = evaluate(p, Decisions(tiers=ALL_HBM))
    windows = sum(w.time_ms for w in ev.windows)
    assert ev.step_ms == pytest.approx(p.grad_accum * windows + ends + 3.0)
    # the MILP's constant: the ends + const (no window overhead here)
    assert scale_inputs(p).step_const_ms == pytest.approx(ends + 3.0)


@pytest.mark.parametrize("kw,ends", [({}, 270.0), ({"duplex_bytes_per_s": 10 * GB}, 320.0),
                                     ({"grad_accum": 3}, 390.0),
                                     ({"copies_overlap_compute": False}, 490.0)],
                         ids=["gpu", "gpu_shared_link", "ga3", "cpu"])
def test_simulator_post_carries_block_0_for_the_next_micro_batch(kw, ends):
    p = _problem(**kw)
    plan = Plan(tiers=ALL_HBM)
    sim = simulate(p, plan)
    post = [e for e in sim.events if e.window == "post"]
    assert [e.name for e in post if e.kind == "weights"] == ["W0 next"]
    windows = sum(w.time_ms for w in evaluate(p, Decisions(tiers=ALL_HBM)).windows)
    assert sim.step_ms == pytest.approx(p.grad_accum * windows + ends + 3.0)
    assert disagreements(p, plan) == []
