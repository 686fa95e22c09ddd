"""The one planning entry: every caller (the trainer's `make_plan`, `lazytrain plan`, a re-plan)
plans through `planner.policy.plan` with the options the config gives, and gets the same plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

import lazytrain.cli.main as cli_main
from lazytrain.config import PlannerConfig, load_config
from lazytrain.planner import policy
from lazytrain.planner.policy import PlannerOptions, planner_options

pytest.importorskip("lazytrain.planner.heuristics", reason="heuristics not in the tree yet")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
RANKS = {"one process": ("", ""),
         "2 ranks per node": ("dist:\n  nproc_per_node: 2\n", "  gpus_per_node: 2\n")}
"""Job shape -> (dist section, hardware lines) of the config."""


def write_config(tmp_path, *, policy_name: str, ranks: tuple[str, str]) -> str:
    """A planning-only run config for a 4-block, hidden-64 Llama on h800-paper; its own
    calibration cache directory, so no cached calibration of another test is read."""
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    dist, hardware_extra = ranks
    (tmp_path / "tiny.yaml").write_text(
        "model:\n  config_path: tiny.json\n"
        f"hardware:\n  preset: h800-paper\n{hardware_extra}"
        "data:\n  seq_len: 64\n"
        "train:\n  micro_batch: 2\n  grad_accum: 1\n"
        f"planner:\n  policy: {policy_name}\n  time_limit_s: 10\n  gap: 0.000001\n"
        f"runtime:\n  calibration_dir: {tmp_path / 'calibration'}\n" + dist)
    return str(tmp_path / "tiny.yaml")


def test_planner_options_default_to_the_config_defaults():
    # the values documented in config.PlannerConfig, written out by hand
    assert PlannerOptions() == PlannerOptions(policy="milp", backend="auto", time_limit_s=10.0,
                                              gap=0.005, threads=1, seed=0, megatrain_k=4,
                                              lp_bound=True)
    assert planner_options(PlannerConfig()) == PlannerOptions()


def test_planner_options_carry_every_solver_key_of_the_config():
    cfg = PlannerConfig(policy="heuristic", backend="scip", time_limit_s=3.5, gap=0.02,
                        threads=2, seed=7, megatrain_k=3)
    assert planner_options(cfg) == PlannerOptions(policy="heuristic", backend="scip",
                                                  time_limit_s=3.5, gap=0.02, threads=2,
                                                  seed=7, megatrain_k=3)


def test_an_unknown_backend_is_rejected_naming_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"planner.backend must be one of \('auto'"):
        PlannerOptions(backend="gurobi")


@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("policy_name", ["heuristic", "milp"])
def test_the_three_callers_get_the_same_plan_and_the_same_default_backend(
        tmp_path, monkeypatch, capfd, policy_name, ranks):
    if policy_name == "milp":
        pytest.importorskip("highspy")
    from lazytrain.planner.heuristics import megatrain_plan
    from lazytrain.planner.build import topology_of
    from lazytrain.planner.topology import rank_problem
    from lazytrain.train.replan import resolve
    from lazytrain.profile.calibrate import costed_problem
    from lazytrain.train.setup import make_plan

    path = write_config(tmp_path, policy_name=policy_name, ranks=RANKS[ranks])
    cfg = load_config(path)
    calls = []
    real_plan = policy.plan

    def spy(problem, options=None, warm_start=None):
        calls.append((problem.name, options))
        return real_plan(problem, options, warm_start)

    monkeypatch.setattr(policy, "plan", spy)
    monkeypatch.setattr(cli_main, "COMMANDS", {"plan": cli_main.COMMANDS["plan"]})

    trained = make_plan(cfg, calibrate=False, log=lambda msg: None)
    first_cli = len(calls)
    assert cli_main.main(["plan", "--config", path, "--json"]) == 0
    cli = json.loads(capfd.readouterr().out)["plan"]
    problem = costed_problem(cfg, log=lambda msg: None)
    topo = topology_of(cfg)
    if topo is not None:
        problem = rank_problem(problem, topo)
    running = megatrain_plan(problem, k=2)  # a re-plan starts from another (worse) plan
    first_replan = len(calls)
    replanned = resolve(problem, running, planner_options(cfg.planner))

    # the same problem (one rank's share when data parallel) and the same options
    names = {calls[i][0] for i in (0, first_cli, first_replan)}
    assert names == {problem.name} and ("[1 of 2 ranks/node]" in problem.name) == bool(topo)
    opts = [calls[i][1] for i in (0, first_cli, first_replan)]
    assert {o.backend for o in opts} == {"auto"}
    assert {dataclasses.replace(o, lp_bound=True) for o in opts} == {
        PlannerOptions(policy=policy_name, time_limit_s=10.0, gap=0.000001)}
    # the same plan: predicted step and tiers
    assert list(trained.tiers) == cli_tiers(cli) == list(replanned.tiers)
    assert trained.predicted.step_ms == pytest.approx(cli["predicted"]["step_ms"], rel=1e-9)
    assert trained.predicted.step_ms == pytest.approx(replanned.predicted.step_ms, rel=1e-9)
    if policy_name == "milp":  # auto resolves to the same solver for each caller
        assert trained.solver.backend == cli["solver"]["backend"] == replanned.solver.backend


def cli_tiers(plan_json: dict) -> list[str]:
    return [b["tier"] for b in plan_json["boundaries"]]
