"""build_problem: the planning problem's memory model and provenance on real configs."""

from __future__ import annotations

import pytest

from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config

SEED = "configs/qwen3.6-27b-h800.yaml"


@pytest.fixture(scope="module")
def seed_cfg(repo_root, shared_dir):
    return load_config(repo_root / SEED)


def test_seed_bf16_master_states_fit_360_gb_with_room_for_checkpoints(seed_cfg):
    p = problem_from_config(seed_cfg)
    mem = p.provenance["memory"]
    # 26.896e9 params x 12 B = 322.8 GB of master weights, grads and Adam moments.
    assert mem["states_bytes"] == pytest.approx(322.75e9, rel=1e-3)
    assert p.host_bytes_per_param == 12.0 and p.dram_bytes == 360e9
    # bf16 masters step through an fp32 [2, largest group] scratch; the largest group is the
    # ends (embedding + untied head, 2 x 248320 x 5120 + 5120 = 2.543e9 params): 20.3 GB
    assert mem["optimizer_scratch_bytes"] == 8 * (2 * 248320 * 5120 + 5120)
    # Left for DRAM-tier checkpoints after states, staging and scratch: about 10.8 GB
    # (322.75 + 8.1 staging + 20.3 scratch of 360 GB)
    assert 8e9 < mem["dram_free_for_checkpoints_bytes"] < 13e9


def test_seed_fp32_master_states_alone_exceed_360_gb(repo_root, shared_dir):
    cfg = load_config(repo_root / SEED, ["train.master_dtype=fp32"])
    mem = problem_from_config(cfg).provenance["memory"]
    assert mem["states_bytes"] == pytest.approx(16 * 26.896e9, rel=1e-3)  # 430.3 GB
    assert mem["states_bytes"] > 360e9
    assert mem["dram_free_for_checkpoints_bytes"] < 0


def test_seed_fixed_hbm_is_the_sum_of_its_parts_and_leaves_room(seed_cfg):
    p = problem_from_config(seed_cfg)
    mem = p.provenance["memory"]
    parts = ("weight_buffers_bytes", "grad_buffers_bytes", "ends_bytes", "block_inputs_bytes")
    # the block and head workspaces are never live together (the head runs in turn only)
    assert p.fixed_hbm_bytes == sum(mem[k] for k in parts) + max(
        mem["block_workspace_bytes"], mem["head_workspace_bytes"])
    assert p.hbm_bytes == int(80e9 * 0.95)
    # ends: embedding + head 2 x 248320 x 5120 (+ norm 5120): bf16 weights (2 B) and the
    # engine's fp32 gradient accumulator (4 B)
    assert mem["ends_bytes"] == (2 + 4) * (2 * 248320 * 5120 + 5120)
    room = p.hbm_bytes - p.fixed_hbm_bytes
    assert room > 20 * p.boundary_bytes[0]


def test_provenance_carries_the_resolved_config_and_horizons(seed_cfg):
    p = problem_from_config(seed_cfg)
    prov = p.provenance
    assert (prov["seq_len"], prov["micro_batch"], prov["grad_accum"], prov["dtype"]) == (
        1024, 72, 1, "bf16")
    assert prov["hardware"] == "h800-paper" and len(prov["model_config_sha256"]) == 64
    assert prov["horizons"] == {"drain_windows": 4, "prefetch_windows": 4,
                                "nvme_lead_windows": 4, "k_max": 16}
    assert prov["config"]["model"]["config_path"].endswith("qwen3.5-27b.json")
    assert prov["created_by"].startswith("lazytrain ")
    assert p.model_flops_per_micro_batch == pytest.approx(6 * 26.896e9 * 73728, rel=1e-3)


def test_default_job_builds_a_cpu_problem_without_files():
    cfg = load_config(None)
    p = problem_from_config(cfg)
    assert p.num_blocks == 30 and not p.copies_overlap_compute
    # [micro_batch, seq_len, hidden 576] in fp32
    assert p.boundary_bytes[0] == cfg.train.micro_batch * cfg.data.seq_len * 576 * 4
    assert p.host_bytes_per_param == 16.0


def test_megatrain_plan_of_the_planner_predicts_176_9_tflops(seed_cfg):
    heuristics = pytest.importorskip("lazytrain.planner.heuristics")
    # the rule as published re-forwards every block in full
    published = problem_from_config(seed_cfg).replace(reforward_ms=())
    plan = heuristics.megatrain_plan(published, k=4)
    assert plan.predicted.model_tflops == pytest.approx(176.9, abs=0.2)


def test_the_seed_problem_charges_the_truncated_reforward(seed_cfg):
    """Every block of the seed (Qwen3.5 dense MLP, truncated by the runtime) re-forwards for
    less than Fg, by the analytic share of its down projection."""
    p = problem_from_config(seed_cfg)
    shares = [1 - r / g for r, g in zip(p.reforward_ms, p.fwd_grad_ms)]
    assert all(0.15 < s < 0.3 for s in shares)


def test_building_a_problem_does_not_import_torch_or_a_solver(seed_cfg):
    problem_from_config(seed_cfg)
    # Other tests in the same process may have imported torch; check the build modules only.
    import lazytrain.planner.build as build
    import lazytrain.spec.costs as costs
    import lazytrain.spec.model as model
    for mod in (build, costs, model):
        src = open(mod.__file__).read()
        assert "import torch" not in src and "pyscipopt" not in src and "highspy" not in src


def test_seed_host_rates_are_the_server_stream_figure_rescaled_to_bf16_masters(seed_cfg):
    p = problem_from_config(seed_cfg)
    # h800-paper quotes 230.4 GB/s of STREAM copy/add over 3 B of traffic per converted byte
    # (fp32 -> bf16) and 5 B per accumulated byte (bf16 into fp32); bf16 masters move
    # (2 + 2) / 2 = 2 and (2 + 2 x 2) / 2 = 3 B per byte: 230.4 / 2 = 115.2 GB/s and
    # 230.4 / 3 = 76.8 GB/s
    assert p.host_convert_bytes_per_s == pytest.approx(115.2e9)
    assert p.host_accumulate_bytes_per_s == pytest.approx(76.8e9)


def test_default_cpu_job_gets_the_cpu_presets_host_rates_for_fp32():
    p = problem_from_config(load_config(None))
    # cpu: 5 GB/s memcpy = 10 GB/s of traffic; fp32 -> fp32 conversion moves 2 B per byte
    # (5 GB/s), fp32 gradients into fp32 accumulators 3 B per byte (3.33 GB/s)
    assert p.host_convert_bytes_per_s == pytest.approx(5e9)
    assert p.host_accumulate_bytes_per_s == pytest.approx(10e9 / 3)


def test_seed_head_workspace_counts_one_chunks_softmax_and_the_head_weight_gradient(seed_cfg):
    mem = problem_from_config(seed_cfg).provenance["memory"]
    # micro-batch 72, seq 1024, bf16 (2 B), hidden 5120, vocab 248320; a chunk is
    # 72 x (1024 // 72 = 14) = 1008 tokens. The d loss / d h buffer: 72 x 1024 x 5120 x 2 B;
    # the final norm: 12 B x 1008 x 5120; the peak of the chunk: the larger of the loss
    # backward's 12 B per logit (fp32 log-softmax, nll gradient, log-softmax gradient) and the
    # matmul backward's bf16 logit gradient beside the [V, H] head weight gradient.
    c, V, H = 1008, 248320, 5120
    softmax, matmul = 12 * c * V, 2 * (c * V + V * H)
    assert (softmax, matmul) == (3003678720, 3043409920)  # 3.00 GB, 3.04 GB
    assert mem["head_workspace_bytes"] == 72 * 1024 * H * 2 + 12 * c * H + matmul

