"""`max_batch_search`: the largest micro-batch with a feasible plan, checked by brute force over
every tier assignment (fluid evaluator) at the answer and at answer + 1."""

from __future__ import annotations

import itertools

import pytest

from lazytrain.planner.capacity import BatchSearch, max_batch_search
from lazytrain.planner.evaluate import decisions_from_tiers, evaluate
from lazytrain.planner.window_time import ends_step_ms
from lazytrain.planner.windows import TIERS
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.problem import PlanningProblem
from lazytrain.report.capacity import format_batch_table

MB = 10**6
L = 3


def problem_at(micro_batch: int, grad_accum: int = 1) -> PlanningProblem:
    """3 blocks; every activation term scales with the micro-batch: A = 10 MB x m, I = 30 MB x m;
    HBM 300 MB beside 100 MB fixed; DRAM room for two boundaries at m = 4; no NVMe."""
    m = micro_batch
    A, I = 10 * MB * m, 30 * MB * m  # noqa: E741
    params = 10 * MB
    states = 16 * (L * params)
    return PlanningProblem(
        fwd_ms=(5.0 * m,) * L, fwd_grad_ms=(6.0 * m,) * L, bwd_ms=(10.0 * m,) * L,
        weight_bytes=(2 * params,) * L, grad_bytes=(2 * params,) * L, internal_bytes=(I,) * L,
        boundary_bytes=(A,) * (L + 1), params_per_block=(params,) * L,
        h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, duplex_bytes_per_s=40e9,
        nvme_read_bytes_per_s=5e9, nvme_write_bytes_per_s=5e9,
        hbm_bytes=400 * MB, fixed_hbm_bytes=100 * MB, dram_bytes=states + 80 * MB,
        nvme_bytes=0, grad_accum=grad_accum, tokens_per_micro_batch=128 * m,
        model_flops_per_micro_batch=1e12 * m)


def any_plan_fits(problem: PlanningProblem) -> bool:
    """Brute force: some tier assignment of boundaries 0..L-1 (boundary L is hbm), with or
    without keep-internals on each block, has a legal schedule and no capacity violation."""
    options = [t for t in TIERS if t != "nvme"]
    for tiers in itertools.product(options, repeat=L):
        full = tiers + ("hbm",)
        mats = [j for j in range(L) if full[j + 1] != "recompute"]
        for r in range(len(mats) + 1):
            for keep in itertools.combinations(mats, r):
                try:
                    d = decisions_from_tiers(problem, full, keep)
                except ValueError:
                    continue
                if evaluate(problem, d).feasible:
                    return True
    return False


@pytest.fixture(scope="module")
def milp_search() -> BatchSearch:
    pytest.importorskip("highspy", reason="the MILP policy needs a solver")
    return max_batch_search(problem_at, PlannerOptions(policy="milp", backend="highs",
                                                       time_limit_s=10, gap=0.0),
                            grad_accums=(1, 4))


def test_max_micro_batch_fits_and_one_more_does_not_by_brute_force(milp_search):
    best = milp_search.max_micro_batch
    assert best >= 1
    assert any_plan_fits(problem_at(best))
    assert not any_plan_fits(problem_at(best + 1))


def test_table_rows_cover_powers_of_two_the_maximum_and_the_first_infeasible_batch(milp_search):
    best = milp_search.max_micro_batch
    sizes = sorted({r.micro_batch for r in milp_search.rows})
    assert sizes[-1] == best + 1 and best in sizes and 1 in sizes
    for r in milp_search.rows:
        assert r.global_batch == r.micro_batch * r.grad_accum
        assert r.feasible == (r.micro_batch <= best)
    assert milp_search.max_global_batch == best * 4
    last = [r for r in milp_search.rows if r.micro_batch == best + 1]
    assert all(r.violation and "short" in r.violation for r in last)


def test_accumulation_raises_tokens_per_step_not_memory(milp_search):
    by = {(r.micro_batch, r.grad_accum): r for r in milp_search.rows if r.feasible}
    for (m, g), r in by.items():
        if g == 4:
            one = by[m, 1]
            assert r.peak_hbm_bytes == one.peak_hbm_bytes
            # step = g x (sum of window times) + pre/post of the step (const_ms = 0 here):
            # the windows repeat per micro-batch; block 0's load and the ends' gradient drain
            # are not repeated (prefetched in post, drained once), so tokens/s never falls
            windows_g = r.step_ms - ends_step_ms(problem_at(m, g))
            windows_1 = one.step_ms - ends_step_ms(problem_at(m, 1))
            assert windows_g == pytest.approx(4 * windows_1)
            assert r.step_ms <= 4 * one.step_ms + 1e-9
            assert r.tokens_per_s >= one.tokens_per_s * (1 - 1e-12)


def test_heuristic_search_never_claims_more_than_fits():
    search = max_batch_search(problem_at, PlannerOptions(policy="heuristic", time_limit_s=5))
    best = search.max_micro_batch
    assert best >= 1 and any_plan_fits(problem_at(best))
    assert search.rows[-1].micro_batch == best + 1 and not search.rows[-1].feasible
    assert "largest micro-batch that fits" in format_batch_table(search)


def test_no_batch_fits_reports_zero():
    def too_big(m: int, g: int) -> PlanningProblem:
        return problem_at(m, g).replace(hbm_bytes=50 * MB)

    search = max_batch_search(too_big, PlannerOptions(policy="heuristic", time_limit_s=5))
    assert search.max_micro_batch == 0 and search.rows[-1].micro_batch == 1
    assert not search.rows[-1].feasible


def test_policies_that_ignore_budgets_are_rejected():
    with pytest.raises(ValueError, match="planner.policy"):
        max_batch_search(problem_at, PlannerOptions(policy="ideal"))
