"""`lazytrain plan` and `lazytrain simulate`, run in-process on a tiny model config."""

from __future__ import annotations

import json

import pytest

import lazytrain.cli.main as cli_main
from lazytrain.cli.main import main
from lazytrain.report.plan_table import ranges

pytest.importorskip("lazytrain.planner.build", reason="problem_from_config not in the tree yet")
pytest.importorskip("lazytrain.planner.heuristics", reason="heuristics not in the tree yet")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def only_planning_verbs(monkeypatch):
    """Register only `plan` and `simulate`, so another verb's import cannot fail these tests."""
    monkeypatch.setattr(cli_main, "COMMANDS", {k: v for k, v in cli_main.COMMANDS.items()
                                               if k in ("plan", "simulate")})


@pytest.fixture
def tiny_config(tmp_path):
    """A run config YAML for a 4-block, hidden-64 Llama on h800-paper (planning only)."""
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "tiny.yaml").write_text(
        "model:\n  config_path: tiny.json\n  dtype: bf16\n"
        "hardware:\n  preset: h800-paper\n"
        "data:\n  seq_len: 64\n"
        "train:\n  micro_batch: 2\n  grad_accum: 1\n"
        "planner:\n  time_limit_s: 5\n")
    return tmp_path / "tiny.yaml"


def test_ranges_compress_sorted_indices():
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranges([]) == "-"


def test_plan_prints_tiers_policy_megatrain_and_bounds(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--policy", "heuristic"]) == 0
    out = capsys.readouterr().out
    assert "4 blocks, seq 64, micro-batch 2" in out
    assert "boundaries (5): hbm" in out
    for label in ("heuristic", "megatrain as published (K=4)", "memory bound", "roofline (inf HBM)",
                  "recomputed blocks",
                  "keep-internals", "speedup over the MegaTrain rule", "event simulator"):
        assert label in out, label


def test_plan_milp_writes_plan_and_gantt_atomically(tiny_config, tmp_path, capsys):
    pytest.importorskip("highspy")
    out_json, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["plan", "--config", str(tiny_config), "--policy", "milp", "--backend", "highs",
                 "--out", str(out_json), "--gantt", str(png)]) == 0
    cap = capsys.readouterr()
    assert "LP bound" in cap.out and "solver: highs" in cap.out
    assert f"wrote {out_json}" in cap.err and f"wrote {png}" in cap.err
    assert json.loads(out_json.read_text())["version"] == 1
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_plan_json_holds_plan_and_comparison_and_nothing_else_on_stdout(tiny_config, capfd):
    # capfd: a solver banner written to file descriptor 1 would break the JSON
    assert main(["plan", "--config", str(tiny_config), "--policy", "megatrain", "--json"]) == 0
    doc = json.loads(capfd.readouterr().out)
    assert [b["tier"] for b in doc["plan"]["boundaries"]][-1] == "hbm"
    rows = doc["comparison"]["rows"]
    assert "megatrain as published (K=4)" in rows
    # the speedup is against the faster published rule that fits: the best fixed K is never
    # slower than K = 4; the plan is the K = 4 rule with the truncated re-forward
    best = f"best fixed K as published (K={doc['comparison']['best_fixed_k']})"
    assert rows[best]["step_ms"] <= rows["megatrain as published (K=4)"]["step_ms"]
    assert doc["comparison"]["speedup_vs_megatrain"] == pytest.approx(
        rows[best]["step_ms"] / rows["megatrain"]["step_ms"])


def test_flags_named_after_config_keys_override_the_yaml(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--policy", "megatrain",
                 "--seq-len", "128", "--micro-batch", "3", "--json"]) == 0
    prov = json.loads(capsys.readouterr().out)["plan"]["provenance"]
    assert (prov["seq_len"], prov["micro_batch"]) == (128, 3)


def test_unknown_config_key_exits_2_with_one_line_naming_the_key(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--set", "planner.polcy=milp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "planner.polcy" in err and "planner.policy" in err
    assert len(err.splitlines()) == 1


def test_impossible_hbm_budget_exits_1_naming_the_budget(tiny_config, capsys):
    pytest.importorskip("highspy")
    code = main(["plan", "--config", str(tiny_config), "--policy", "milp",
                 "--set", "hardware.hbm_gb=0.002"])  # 2 MB: plausible, too small
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "HBM" in err


def test_simulate_reevaluates_a_saved_plan_on_other_hardware(tiny_config, tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["plan", "--config", str(tiny_config), "--policy", "megatrain",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan)]) == 0  # the problem rebuilt from the plan's provenance
    same = capsys.readouterr().out
    assert "window" in same and "\nstep " in same and "b0" in same
    assert main(["simulate", str(plan), "--config", str(tiny_config),
                 "--hardware", "h100-pcie", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["windows"]) == 2 * 4 + 1
    assert doc["simulator"]["step_ms"] > 0
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2


@pytest.mark.slow
def test_seed_config_plans_with_the_heuristic(repo_root, shared_dir, capsys):
    seed = repo_root / "configs" / "qwen3.6-27b-h800.yaml"
    if not seed.exists():
        pytest.skip("configs/qwen3.6-27b-h800.yaml not in the tree yet")
    assert main(["plan", "--config", str(seed), "--policy", "heuristic",
                 "--time-limit-s", "2"]) in (0, 1)
    assert "64 blocks" in capsys.readouterr().out


def test_seed_baseline_is_the_best_fixed_k_that_fits_and_speedup_is_against_it(
        repo_root, shared_dir, capsys):
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.heuristics import megatrain_plan

    seed = repo_root / "configs" / "qwen3.6-27b-h800.yaml"
    assert main(["plan", "--config", str(seed), "--policy", "heuristic", "--json"]) == 0
    cmp = json.loads(capsys.readouterr().out)["comparison"]
    # brute force over every K of the rule: the reported K fits and no K that fits is faster
    # the rule as published re-forwards every block in full
    problem = problem_from_config(load_config(seed)).replace(reforward_ms=())
    fitting = {k: megatrain_plan(problem, k).predicted.step_ms for k in range(1, 17)
               if not megatrain_plan(problem, k).provenance.get("violations")}
    k = cmp["best_fixed_k"]
    assert k in fitting and fitting[k] == pytest.approx(min(fitting.values()))
    assert k != 4  # the paper's K = 4 leaves HBM unused on the seed
    rows = cmp["rows"]
    assert cmp["baseline"] == f"best fixed K as published (K={k})"
    assert cmp["speedup_vs_megatrain"] == pytest.approx(
        min(fitting.values()) / rows["heuristic"]["step_ms"])
    assert cmp["speedup_vs_megatrain"] < rows["megatrain as published (K=4)"]["step_ms"] / rows[
        "heuristic"]["step_ms"]


def test_simulate_exits_1_when_the_plan_breaks_a_budget_of_the_problem(tiny_config, tmp_path,
                                                                      capsys):
    plan = tmp_path / "p.json"
    assert main(["plan", "--config", str(tiny_config), "--policy", "megatrain",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--config", str(tiny_config),
                 "--set", "hardware.hbm_gb=0.002"]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "HBM short by" in err


def test_plan_and_simulate_print_the_same_simulated_step(tiny_config, tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["plan", "--config", str(tiny_config), "--policy", "megatrain", "--json",
                 "--out", str(plan)]) == 0
    planned = json.loads(capsys.readouterr().out)["comparison"]["simulator"]["step_ms"]
    assert main(["simulate", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulator"]["step_ms"] == pytest.approx(
        planned, rel=1e-12)


def test_simulate_warns_when_the_stored_prediction_disagrees(tiny_config, tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["plan", "--config", str(tiny_config), "--policy", "megatrain",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan)]) == 0
    assert "warning" not in capsys.readouterr().err  # fresh plan: prediction re-evaluates
    doc = json.loads(plan.read_text())
    doc["predicted"]["step_ms"] *= 1.1
    plan.write_text(json.dumps(doc))
    assert main(["simulate", str(plan)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "re-plan" in err


def test_simulate_reevaluates_a_data_parallel_plan_on_one_ranks_share(tiny_config, tmp_path,
                                                                      capsys):
    # 2 GPUs behind one PCIe switch: each rank gets half the link, so the node's problem
    # predicts about half of the rank plan's transfer-bound step (it did, -50%, before)
    plan = tmp_path / "p.json"
    assert main(["plan", "--config", str(tiny_config), "--policy", "heuristic",
                 "--nproc-per-node", "2", "--set", "hardware.gpus_per_node=2",
                 "--set", "hardware.gpus_per_pcie_switch=2", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan)]) == 0
    cap = capsys.readouterr()
    assert "warning" not in cap.err
    assert cap.out.splitlines()[0].split(":")[0].endswith("[1 of 2 ranks/node]")
    assert main(["simulate", str(plan), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)["evaluator"]["step_ms"]
    assert evaluated == pytest.approx(json.loads(plan.read_text())["predicted"]["step_ms"],
                                      rel=1e-9)


def test_hbm_typed_in_mb_is_refused_in_one_line_unless_allowed(tiny_config, capsys):
    assert main(["plan", "--config", str(tiny_config), "--policy", "heuristic",
                 "--set", "hardware.hbm_gb=80000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: hardware.hbm_gb: 80000 GB") and "MB typed as GB" in err
    assert main(["plan", "--config", str(tiny_config), "--policy", "heuristic",
                 "--set", "hardware.hbm_gb=80000", "--allow-implausible"]) == 0


def test_a_hardware_file_with_hbm_in_the_wrong_unit_is_refused_naming_the_file(tiny_config,
                                                                               tmp_path, capsys):
    from lazytrain.spec.hardware import PRESETS

    spec = PRESETS["h800-paper"].to_dict()
    spec["hbm_bytes"] = 80000  # MB typed as bytes
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(spec))
    assert main(["plan", "--config", str(tiny_config), "--policy", "heuristic",
                 "--hardware", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}: hbm_bytes: 80000 bytes" in err and "MB typed as bytes" in err


def test_the_tiny_cpu_config_with_64_mb_of_device_memory_still_plans(repo_root, capsys):
    assert main(["plan", "--config", str(repo_root / "configs" / "tiny-llama-cpu.yaml"),
                 "--policy", "heuristic"]) == 0


@pytest.mark.parametrize("layer_types, said", [
    (["full_attention"] * 2, "layer_types has 2 entries but num_hidden_layers is 4"),
    (["full_attention"] * 3 + ["windowed"], "layer_types entry 'windowed' is not one of"),
])
def test_layer_types_that_do_not_match_the_layers_exit_2_with_one_line(tmp_path, tiny_config,
                                                                      capsys, layer_types,
                                                                      said):
    """A config with fewer layer_types than layers died with an IndexError traceback."""
    (tmp_path / "tiny.json").write_text(json.dumps({**TINY_LLAMA, "layer_types": layer_types}))
    assert main(["plan", "--config", str(tiny_config), "--policy", "heuristic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "Traceback" not in err[0], err
