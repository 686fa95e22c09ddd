"""Per-rank problems of a shared node, the all-reduce term and the scaling table, by hand."""

from __future__ import annotations

import pytest

from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.topology import (Topology, allreduce_ms, exposed_allreduce_ms,
                                        host_bytes_per_param_rank, rank_problem, scaling_table)

GB = 10**9


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


def test_eight_ranks_with_two_gpus_per_switch_get_an_eighth_of_dram_and_nvme_half_the_link():
    topo = Topology(nproc_per_node=8, gpus_per_node=8, gpus_per_pcie_switch=2,
                    nvme_devices_per_node=2)
    p = rank_problem(node_problem(), topo)
    assert p.dram_bytes == 125 * GB and p.nvme_bytes == 1750 * GB
    assert p.nvme_read_bytes_per_s == 6e9 / 8 and p.nvme_write_bytes_per_s == 1e9
    assert (p.h2d_bytes_per_s, p.d2h_bytes_per_s, p.duplex_bytes_per_s) == (20e9, 20e9, 40e9)
    # bf16 master: 2 + 2 + 8/8 = 5 B/param; 8-bit moments: 2 + 2 + 2/8 = 4.25
    assert p.host_bytes_per_param == 5.0 and p.host_bytes_per_param_q8 == 4.25
    assert p.provenance["dist"]["world_size"] == 8


def test_one_rank_problem_is_the_node_problem():
    node = node_problem()
    p = rank_problem(node, Topology())
    assert (p.dram_bytes, p.h2d_bytes_per_s, p.host_bytes_per_param) == (
        node.dram_bytes, node.h2d_bytes_per_s, node.host_bytes_per_param)


def test_fp32_master_per_rank_bytes_shard_only_the_adam_moments():
    assert host_bytes_per_param_rank(16.0, moments=8.0, world_size=4) == 4 + 4 + 2


def test_ring_allreduce_of_one_gparam_over_four_ranks_moves_six_gb():
    # 2 * 3/4 * 4 B * 1e9 = 6e9 bytes at 10 GB/s = 600 ms
    topo = Topology(nproc_per_node=4, gpus_per_node=4, allreduce_bytes_per_s=10e9)
    assert allreduce_ms(10**9, topo) == pytest.approx(600.0)


class _W:
    def __init__(self, name, time_ms):
        self.name, self.time_ms = name, time_ms


class _Plan:
    windows = [_W("f0", 10), _W("f1", 10), _W("turn", 5), _W("b1", 100), _W("b0", 100)]


def test_exposed_allreduce_is_what_runs_past_the_backward_by_hand():
    # 2 ranks, 1e9 params per block: 2 * 1/2 * 4e9 B / 20 GB/s = 200 ms per block.
    # b1 ends at 125 ms: reduce 125..325; b0 ends at 225: reduce 325..525; backward ends 225
    topo = Topology(nproc_per_node=2, gpus_per_node=2, allreduce_bytes_per_s=20e9)
    assert exposed_allreduce_ms(_Plan(), node_problem(), topo) == pytest.approx(300.0)
    assert exposed_allreduce_ms(_Plan(), node_problem(), Topology()) == 0.0


def test_more_ranks_than_gpus_in_the_node_names_the_key():
    with pytest.raises(ValueError, match="hardware.gpus_per_node"):
        Topology(nproc_per_node=4, gpus_per_node=2)


def test_scaling_table_marks_rank_counts_whose_states_exceed_the_dram_share():
    # 2e9 params x (4 + 8/N) B: N=1 24 GB fits 40 GB, N=2 16 GB > 20 GB? no: 16 < 20 fits,
    # N=4 12 GB > 10 GB share: no plan
    node = node_problem(dram_bytes=40 * GB, host_bytes_per_param=12.0)
    topo = Topology(nproc_per_node=1, gpus_per_node=4, allreduce_bytes_per_s=1e12)
    rows = scaling_table(node, topo, policy="megatrain", megatrain_k=1, counts=(1, 2, 4))
    assert [r.step_ms is not None for r in rows] == [True, True, False]
    assert "DRAM" in rows[2].note
    assert rows[1].tokens_per_s > rows[0].tokens_per_s
