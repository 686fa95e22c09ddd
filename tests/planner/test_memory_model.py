"""The typed memory model of a plan (`planner/memory_model.py`): the keys `planner/build.py`
writes, the defaults of a plan without one, one-line errors for a damaged one, and the same
pinned bytes in every reader (budgets, report, training preflight).

References: byte counts written out by hand and the build's own dict (its keys and values,
which the model must carry unchanged: the Plan JSON does not change)."""

from __future__ import annotations

import pytest

from lazytrain.config import load_config
from lazytrain.errors import UserError
from lazytrain.planner.budgets import plan_budgets, predicted_pinned_bytes
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.memory_model import MemoryModel, MemoryModelError, memory_model_of
from lazytrain.planner.plan import Plan, Predicted
from lazytrain.report.tables import compare_with_run

SEED = "configs/qwen3.6-27b-h800.yaml"

HAND = {"hbm_budget_bytes": 70_000, "fixed_hbm_bytes": 20_000, "states_bytes": 8_000,
        "staging_bytes": 1_500, "optimizer_scratch_bytes": 300,
        "dram_free_for_checkpoints_bytes": 6_500}
"""A memory model written by hand: DRAM budget 8000 + 1500 + 6500 = 16000 B."""


def _plan(memory: dict | None, *, dram_bytes: float, pinned_bytes: float = 0.0) -> Plan:
    provenance = {} if memory is None else {"memory": memory}
    return Plan(provenance=provenance, tiers=("hbm", "hbm"),
                predicted=Predicted(step_ms=1.0, model_tflops=0.0, hardware_tflops=0.0,
                                    tokens_per_s=0.0, peak_hbm_bytes=0.0,
                                    dram_bytes=dram_bytes, nvme_bytes=0.0,
                                    pinned_bytes=pinned_bytes))


def test_the_builds_memory_dict_is_the_models_fields_unchanged(repo_root, shared_dir):
    mem = problem_from_config(load_config(repo_root / SEED)).provenance["memory"]
    model = MemoryModel.from_dict(mem)
    assert model.to_dict() == mem  # every key known, every value kept
    assert list(model.to_dict()) == list(mem)  # and in the build's order
    assert model.states_bytes == mem["states_bytes"]
    assert model.dram_budget_bytes == 360_000_000_000  # the seed's hardware DRAM


def test_a_plan_without_a_memory_model_reads_as_all_unknown():
    assert memory_model_of({}) == memory_model_of(None) == MemoryModel()
    plan = _plan(None, dram_bytes=9_000)
    assert plan_budgets(plan) == (None, None)
    assert predicted_pinned_bytes(plan) is None
    assert MemoryModel().pinned_bytes_of(9_000) is None


def test_pinned_bytes_are_dram_less_states_and_scratch_by_hand():
    model = MemoryModel.from_dict(HAND)
    assert model.pageable_bytes == 8_300
    assert model.pinned_bytes_of(12_000) == 3_700
    assert MemoryModel(states_bytes=8_000).pinned_bytes_of(12_000) == 4_000  # no scratch
    assert model.dram_budget_bytes == 16_000


RUN = [{"step": 1, "windows": [{"name": "f0", "wall_ms": 1.0, "compute_ms": 1.0,
                                 "wait_ms": {c: 0.0 for c in ("h2d", "d2h", "nvme_read",
                                                              "nvme_write")},
                                 "bytes": {}, "peak_bytes": {"hbm": 0, "dram": 0, "nvme": 0}}]}]
"""One recorded step of one window: enough for `compare_with_run`."""


def test_budgets_and_the_report_agree_on_a_plan_without_predicted_pinned_bytes():
    plan = _plan(HAND, dram_bytes=12_000)
    assert predicted_pinned_bytes(plan) == 3_700  # 12000 - 8000 states - 300 scratch
    report = compare_with_run(plan.to_dict(), RUN, skip_steps=0)
    assert report.predicted_pinned_bytes == 3_700
    # the runtime's limits: HBM 70000; pinned = budget 16000 - pageable 8300 = 1500 + 6500 - 300
    assert plan_budgets(plan) == (70_000, 7_700)
    # a plan that predicts its pinned bytes: limit = 16000 - (12000 - 2000) = 6000
    assert plan_budgets(_plan(HAND, dram_bytes=12_000, pinned_bytes=2_000)) == (70_000, 6_000)


@pytest.mark.parametrize("memory, named", [
    ([1, 2], "provenance.memory must be a JSON object"),
    ({"states_bytes": "8 GB"}, "provenance.memory.states_bytes must be a number of bytes"),
    ({"hbm_budget_bytes": True}, "provenance.memory.hbm_budget_bytes must be a number"),
])
def test_a_damaged_memory_model_is_one_line_naming_the_key(memory, named):
    with pytest.raises(MemoryModelError, match=named) as info:
        memory_model_of({"memory": memory})
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert "re-plan" in str(info.value)


def test_the_report_names_a_damaged_memory_model_in_one_line():
    plan = _plan(dict(HAND, states_bytes="8 GB"), dram_bytes=12_000).to_dict()
    with pytest.raises(UserError, match=r"provenance\.memory\.states_bytes"):
        compare_with_run(plan, RUN, skip_steps=0)
