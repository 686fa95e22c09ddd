"""Data parallelism on CPU with gloo: N ranks equal one process over the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from dist_helpers import PLANS, dp_worker, free_port, reference_params, tiny_adapter
from lazytrain.dist.parallel import local_share
from lazytrain.dist.process_group import DistContext
from lazytrain.dist.sharding import assign_owners

STEPS, WORLD = 3, 2


@pytest.mark.slow
@pytest.mark.parametrize("plan_name,clip", [("all_hbm", 0.0), ("mixed_tiers", 0.05)],
                         ids=["all_hbm-no_clip", "mixed_tiers-clipped"])
def test_two_ranks_equal_one_process_after_three_steps(plan_name, clip, tmp_path):
    tiny_adapter()  # import transformers here, before the fork
    # fork: the children inherit the imported torch/transformers (a spawn re-imports them, ~10 s)
    mp.start_processes(dp_worker, args=(WORLD, free_port(), str(tmp_path), plan_name, STEPS,
                                        clip), nprocs=WORLD, join=True, start_method="fork")
    reference = reference_params(plan_name, steps=STEPS, world=WORLD, clip=clip,
                                 nvme_dir=tmp_path / "nvme_ref")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for shard in ranks:  # every rank holds the same, updated masters
        assert shard["params"].keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(shard["params"][name], ref, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"{n}: {m}")
    # ZeRO-1: the ranks' Adam moments together are one full set (2 x 4 B per parameter)
    numel = sum(v.numel() for v in reference.values())
    assert sum(s["moment_bytes"] for s in ranks) == 8 * numel
    assert all(0 < s["moment_bytes"] < 8 * numel for s in ranks)


def test_owners_balance_group_sizes_greedily_in_group_order():
    # sizes 5, 3, 3, 1 over 2 ranks: 5->r0, 3->r1, 3->r1 (3 < 5), 1->r0 (5 < 6)
    owners = assign_owners({"block0": 5, "block1": 3, "block2": 3, "ends": 1}, 2)
    assert owners == {"block0": 0, "block1": 1, "block2": 1, "ends": 0}


def test_rank_one_of_two_takes_the_second_half_of_the_step():
    ctx = DistContext(rank=1, world_size=2)
    assert local_share(list("abcd"), ctx=ctx, grad_accum=2) == ["c", "d"]
    with pytest.raises(ValueError, match="2 x 2 micro-batches"):
        local_share(list("abc"), ctx=ctx, grad_accum=2)


def test_plans_of_the_equivalence_test_cover_recompute_offload_and_keep():
    tiers, keep = PLANS["mixed_tiers"]
    assert {"recompute", "dram", "nvme", "hbm"} <= set(tiers) and keep
