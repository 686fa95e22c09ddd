"""Per-rank problems of a shared node, the all-reduce term and the scaling table, by hand."""

from __future__ import annotations

import pytest

from lazytrain.planner.build import topology_from_config
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.topology import (
    Topology, allreduce_ms, assign_owners, exposed_allreduce_ms, host_bytes_per_param_rank,
    largest_owner_share, rank_problem, scaling_table,
)

GB = 10**9
SEED = "configs/qwen3.6-27b-h800.yaml"
SEED_NODE = ["dist.nproc_per_node=8", "hardware.gpus_per_node=8", "hardware.dram_gb=1000",
             "hardware.nvme_devices_per_node=2", "hardware.gpus_per_pcie_switch=2"]
"""The `lazytrain plan --nproc-per-node 8 --set ...` node of issue 6: 8 x H800 sharing 1 TB."""


def node_problem(**kw) -> PlanningProblem:
    args = dict(fwd_ms=(10.0,) * 2, fwd_grad_ms=(12.0,) * 2, bwd_ms=(20.0,) * 2,
                weight_bytes=(GB,) * 2, grad_bytes=(GB,) * 2, internal_bytes=(GB,) * 2,
                boundary_bytes=(GB // 10,) * 3, params_per_block=(10**9,) * 2, ends_params=0,
                h2d_bytes_per_s=40e9, d2h_bytes_per_s=40e9, duplex_bytes_per_s=80e9,
                nvme_read_bytes_per_s=6e9, nvme_write_bytes_per_s=8e9, hbm_bytes=80 * GB,
                dram_bytes=1000 * GB, nvme_bytes=14_000 * GB, host_bytes_per_param=12.0,
                host_bytes_per_param_q8=6.0, tokens_per_micro_batch=1000)
    args.update(kw)
    return PlanningProblem(**args)


def eight_blocks() -> PlanningProblem:
    """`node_problem` with 8 equal blocks: each of 8 ranks owns one block's moments (1/8)."""
    return node_problem(fwd_ms=(10.0,) * 8, fwd_grad_ms=(12.0,) * 8, bwd_ms=(20.0,) * 8,
                        weight_bytes=(GB,) * 8, grad_bytes=(GB,) * 8, internal_bytes=(GB,) * 8,
                        boundary_bytes=(GB // 10,) * 9, params_per_block=(10**9,) * 8)


def test_eight_ranks_with_two_gpus_per_switch_get_an_eighth_of_dram_and_nvme_half_the_link():
    topo = Topology(nproc_per_node=8, gpus_per_node=8, gpus_per_pcie_switch=2,
                    nvme_devices_per_node=2)
    p = rank_problem(eight_blocks(), topo)
    assert p.dram_bytes == 125 * GB and p.nvme_bytes == 1750 * GB
    assert p.nvme_read_bytes_per_s == 6e9 / 8 and p.nvme_write_bytes_per_s == 1e9
    assert (p.h2d_bytes_per_s, p.d2h_bytes_per_s, p.duplex_bytes_per_s) == (20e9, 20e9, 40e9)
    # shared bf16 master: 2/8 + 2 + 8/8 = 3.25 B/param; 8-bit moments: 2/8 + 2 + 2/8 = 2.5
    assert p.host_bytes_per_param == 3.25 and p.host_bytes_per_param_q8 == 2.5
    assert p.provenance["dist"]["world_size"] == 8 and p.provenance["dist"]["shared_masters"]


def test_eight_ranks_without_shared_masters_hold_a_master_each():
    topo = Topology(nproc_per_node=8, gpus_per_node=8, shared_masters=False)
    p = rank_problem(eight_blocks(), topo)
    # bf16 master: 2 + 2 + 8/8 = 5 B/param; 8-bit moments: 2 + 2 + 2/8 = 4.25
    assert p.host_bytes_per_param == 5.0 and p.host_bytes_per_param_q8 == 4.25


def test_owners_take_the_largest_group_first_and_the_planner_charges_the_largest_share():
    sizes = {"block0": 2, "block1": 2, "block2": 2, "block3": 2, "ends": 6}
    # largest first: ends -> r0 (6), block0..2 -> r1 (2, 4, 6), block3 -> r0 (tie at 6: r0)
    assert assign_owners(sizes, 2) == {"block0": 1, "block1": 1, "block2": 1, "block3": 0,
                                       "ends": 0}
    assert largest_owner_share(sizes, 2) == 8 / 14  # in group order it would be 10 / 14
    # two equal blocks over 8 ranks: one rank owns half of the moments, not an eighth
    p = rank_problem(node_problem(), Topology(nproc_per_node=8, gpus_per_node=8))
    assert p.host_bytes_per_param == 2 / 8 + 2 + 8 / 2


def test_one_rank_problem_is_the_node_problem():
    node = node_problem()
    p = rank_problem(node, Topology())
    assert (p.dram_bytes, p.h2d_bytes_per_s, p.host_bytes_per_param) == (
        node.dram_bytes, node.h2d_bytes_per_s, node.host_bytes_per_param)


def test_fp32_master_per_rank_bytes_shared_over_the_node_moments_over_the_job():
    # fp32 row 16 = 4 master + 4 grad + 8 moments
    one_node = dict(moments=8.0, local_ranks=4, world_size=4)
    assert host_bytes_per_param_rank(16.0, **one_node, shared_masters=False) == 4 + 4 + 2
    assert host_bytes_per_param_rank(16.0, **one_node, shared_masters=True) == 1 + 4 + 2
    # two nodes of 4: the master is shared by the node's 4, the moments by all 8
    two_nodes = dict(moments=8.0, local_ranks=4, world_size=8)
    assert host_bytes_per_param_rank(16.0, **two_nodes, shared_masters=True) == 1 + 4 + 1
    assert host_bytes_per_param_rank(16.0, **two_nodes, shared_masters=False) == 4 + 4 + 1
    # one rank: nothing to share, the whole 16
    assert host_bytes_per_param_rank(16.0, moments=8.0, local_ranks=1, world_size=1,
                                     shared_masters=True) == 16.0


def test_seed_bf16_row_per_rank_bytes_match_the_module_docstring_table():
    # 12 = 2 master + 2 grad + 8 moments; shared 2/N + 2 + 8/N, unshared 2 + 2 + 8/N
    for n, shared, unshared in ((1, 12.0, 12.0), (2, 7.0, 8.0), (4, 4.5, 6.0), (8, 3.25, 5.0)):
        kw = dict(moments=8.0, local_ranks=n, world_size=n)
        assert host_bytes_per_param_rank(12.0, **kw, shared_masters=True) == shared
        assert host_bytes_per_param_rank(12.0, **kw, shared_masters=False) == unshared


def test_ring_allreduce_of_one_gparam_over_four_unshared_ranks_moves_six_gb():
    # 2 * 3/4 * 4 B * 1e9 = 6e9 bytes at 10 GB/s = 600 ms
    topo = Topology(nproc_per_node=4, gpus_per_node=4, allreduce_bytes_per_s=10e9,
                    shared_masters=False)
    assert allreduce_ms(10**9, topo) == pytest.approx(600.0)


def test_shared_masters_on_one_node_pay_only_the_reduce():
    # reduce 3/4 * 4 B * 1e9 = 3e9 bytes + broadcast (1-1)/1 = 0, at 10 GB/s = 300 ms
    topo = Topology(nproc_per_node=4, gpus_per_node=4, allreduce_bytes_per_s=10e9)
    assert allreduce_ms(10**9, topo) == pytest.approx(300.0)


def test_shared_masters_on_two_nodes_broadcast_only_across_nodes():
    # W = 8: reduce 7/8 * 4e9 = 3.5e9 B + broadcast 1/2 * 4e9 = 2e9 B = 5.5e9 B at 10 GB/s
    two = dict(nproc_per_node=4, nnodes=2, gpus_per_node=4, allreduce_bytes_per_s=10e9)
    assert allreduce_ms(10**9, Topology(**two)) == pytest.approx(550.0)
    # unshared: 2 * 7/8 * 4e9 = 7e9 B = 700 ms
    assert allreduce_ms(10**9, Topology(**two, shared_masters=False)) == pytest.approx(700.0)


class _W:
    def __init__(self, name, time_ms):
        self.name, self.time_ms = name, time_ms


class _Plan:
    windows = [_W("f0", 10), _W("f1", 10), _W("turn", 5), _W("b1", 100), _W("b0", 100)]


def test_exposed_allreduce_is_what_runs_past_the_backward_by_hand():
    # 2 unshared ranks, 1e9 params per block: 2 * 1/2 * 4e9 B / 20 GB/s = 200 ms per block.
    # b1 ends at 125 ms: reduce 125..325; b0 ends at 225: reduce 325..525; backward ends 225
    topo = Topology(nproc_per_node=2, gpus_per_node=2, allreduce_bytes_per_s=20e9,
                    shared_masters=False)
    assert exposed_allreduce_ms(_Plan(), node_problem(), topo) == pytest.approx(300.0)
    # shared masters, one node: 1/2 * 4e9 B / 20 GB/s = 100 ms per block: b1 125..225,
    # b0 225..325; 100 ms past the backward
    shared = Topology(nproc_per_node=2, gpus_per_node=2, allreduce_bytes_per_s=20e9)
    assert exposed_allreduce_ms(_Plan(), node_problem(), shared) == pytest.approx(100.0)
    assert exposed_allreduce_ms(_Plan(), node_problem(), Topology()) == 0.0


def test_more_ranks_than_gpus_in_the_node_names_the_key():
    with pytest.raises(ValueError, match="hardware.gpus_per_node"):
        Topology(nproc_per_node=4, gpus_per_node=2)


def test_scaling_table_marks_rank_counts_whose_states_exceed_the_dram_share():
    # unshared, 2e9 params x (4 + 8/N) B against 40 GB / N: N=1 24 GB < 40 GB fits,
    # N=2 16 GB < 20 GB fits, N=4 12 GB > 10 GB: no plan
    node = node_problem(dram_bytes=40 * GB, host_bytes_per_param=12.0)
    topo = Topology(nproc_per_node=1, gpus_per_node=4, allreduce_bytes_per_s=1e12,
                    shared_masters=False)
    rows = scaling_table(node, topo, PlannerOptions(policy="megatrain", megatrain_k=1),
                         counts=(1, 2, 4))
    assert [r.step_ms is not None for r in rows] == [True, True, False]
    assert "DRAM" in rows[2].note
    assert rows[1].tokens_per_s > rows[0].tokens_per_s


@pytest.fixture(scope="module")
def seed_node(repo_root, shared_dir):
    """(node-level problem, config) of the seed on the 8 x H800, 1 TB node."""
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config

    cfg = load_config(repo_root / SEED, SEED_NODE)
    return problem_from_config(cfg), cfg


def seed_topology(cfg, *overrides):
    from lazytrain.config import apply_overrides
    from lazytrain.planner.build import hardware_from_config

    cfg = apply_overrides(cfg, list(overrides))
    return topology_from_config(cfg, hardware_from_config(cfg))


def test_seed_on_eight_h800_sharing_1tb_has_a_plan_at_every_rank_count_with_shared_masters(
        seed_node):
    # 8 ranks: 26.90e9 x (2/8 + 2 + 8/8) = 87.4 GB of states < 125 GB per rank
    problem, cfg = seed_node
    topo = seed_topology(cfg)
    assert topo.shared_masters and topo.nproc_per_node == 8 and topo.gpus_per_pcie_switch == 2
    rows = scaling_table(problem, topo, PlannerOptions(policy="heuristic"))
    assert [r.ranks for r in rows] == [1, 2, 4, 8]
    assert all(r.step_ms is not None for r in rows), [r.note for r in rows]
    assert rows[3].dram_budget_bytes == 125 * GB
    assert rows[3].dram_per_rank_bytes <= 125 * GB


def test_seed_on_eight_h800_has_no_plan_at_eight_ranks_without_shared_masters(seed_node):
    # 8 ranks: 26.90e9 x (2 + 2 + 8/8) = 134.5 GB of states alone > 125 GB per rank
    problem, cfg = seed_node
    topo = seed_topology(cfg, "dist.shared_masters=false")
    assert not topo.shared_masters
    (row,) = scaling_table(problem, topo, PlannerOptions(policy="heuristic"), counts=(8,))
    assert row.step_ms is None and "DRAM" in row.note
