"""PlanningProblem's save-level fields (saved_bytes, reforward_l1_ms): validation, JSON round
trip, rescaling with the compute times, and how build_problem fills them (or not)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.refit import problem_with_rates
from lazytrain.spec.costs import DTYPE_BYTES, FWD_GRAD_FACTOR
from lazytrain.spec.model import ModelSpec


def problem(**kw) -> PlanningProblem:
    """Two blocks; Fg = 12 ms, Fr = 9 ms each."""
    base = dict(fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), reforward_ms=(9.0, 9.0),
                bwd_ms=(20.0, 20.0), weight_bytes=(100, 100), grad_bytes=(100, 100),
                internal_bytes=(300, 300), boundary_bytes=(50, 50, 50),
                params_per_block=(10, 10), h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
                duplex_bytes_per_s=1.5e9, nvme_read_bytes_per_s=1e9,
                nvme_write_bytes_per_s=1e9, hbm_bytes=10**6, dram_bytes=10**7,
                saved_bytes=((120, 280), (100, 250)), reforward_l1_ms=(5.0, 4.0))
    return PlanningProblem(**(base | kw))


def test_levels_are_available_with_both_fields_and_unavailable_with_neither():
    assert problem().save_levels_available
    assert not problem(saved_bytes=(), reforward_l1_ms=()).save_levels_available


@pytest.mark.parametrize("changes,field", [
    (dict(saved_bytes=((120, 280),)), "saved_bytes must have 2 entries"),
    (dict(reforward_l1_ms=(5.0,)), "reforward_l1_ms must have 2 entries"),
    (dict(reforward_l1_ms=()), "reforward_l1_ms must have 2 entries"),
    (dict(saved_bytes=()), "saved_bytes must have 2 entries"),
    (dict(saved_bytes=((300, 280), (100, 250))), r"saved_bytes\[0\] must be \(S1, S2\)"),
    (dict(saved_bytes=((120, 280), (-1, 250))), r"saved_bytes\[1\] must be \(S1, S2\)"),
    (dict(saved_bytes=((120, 280), (100,))), r"saved_bytes\[1\] must be \(S1, S2\)"),
    (dict(reforward_l1_ms=(5.0, 9.5)), r"reforward_l1_ms\[1\] must lie in \[0, reforward"),
    (dict(reforward_l1_ms=(-0.1, 4.0)), r"reforward_l1_ms\[0\] must lie in \[0, reforward"),
], ids=["short-saved", "short-fr1", "fr1-missing", "saved-missing", "s1-above-s2",
        "negative-s1", "not-a-pair", "fr1-above-fr", "negative-fr1"])
def test_bad_save_level_fields_raise_one_error_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        problem(**changes)


def test_fr1_is_checked_against_fg_when_the_problem_has_no_truncated_reforward():
    problem(reforward_ms=(), reforward_l1_ms=(11.0, 12.0))  # Fr = Fg = 12 ms
    with pytest.raises(ValueError, match=r"reforward_l1_ms\[0\]"):
        problem(reforward_ms=(), reforward_l1_ms=(12.5, 1.0))


def test_a_json_round_trip_keeps_the_fields():
    p = problem()
    d = json.loads(json.dumps({f.name: getattr(p, f.name) for f in dataclasses.fields(p)}))
    back = PlanningProblem(**d)
    assert back.saved_bytes == ((120, 280), (100, 250))  # tuples again, as built
    assert back.reforward_l1_ms == (5.0, 4.0)


def test_measured_compute_rescales_fr1_with_the_other_times():
    p = problem_with_rates(problem(), {}, compute_scale=1.5)
    assert p.reforward_l1_ms == (7.5, 6.0) and p.reforward_ms == (13.5, 13.5)
    assert p.saved_bytes == ((120, 280), (100, 250))  # bytes do not scale


def test_build_fills_the_fields_from_the_spec_and_planner_save_levels_false_empties_them():
    cfg = load_config(None)
    p = problem_from_config(cfg)
    model = ModelSpec.from_hf_config(cfg.model.config_path)
    B, S = cfg.train.micro_batch, cfg.data.seq_len
    b = DTYPE_BYTES[cfg.train.compute_dtype]
    assert p.saved_bytes == tuple(
        blk.saved_level_bytes(micro_batch=B, seq_len=S, dtype_bytes=b) for blk in model.blocks)
    # analytic: Fg = FWD_GRAD_FACTOR x F, Fr1 = Fg x the L1 share
    assert p.reforward_l1_ms == pytest.approx(tuple(
        FWD_GRAD_FACTOR * f * blk.reforward_l1_share(S) for f, blk in zip(p.fwd_ms, model.blocks)))
    off = problem_from_config(load_config(None, ["planner.save_levels=false"]))
    assert off.saved_bytes == () and off.reforward_l1_ms == ()
    assert not off.save_levels_available
