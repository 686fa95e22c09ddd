"""Data parallelism on CPU with gloo: N ranks equal one process over the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from dist_helpers import PLANS, PROBE, dp_worker, free_port, reference_params, tiny_adapter
from lazytrain.dist.parallel import local_share
from lazytrain.dist.process_group import DistContext
from lazytrain.dist.sharding import assign_owners

STEPS, WORLD = 3, 2


def _run_ranks(tmp_path, *, world: int, plan_name: str, clip: float, shared: bool,
               per_node: int | None = None, master_dtype: str = "fp32",
               device: str = "cpu") -> list[dict]:
    tiny_adapter()  # import transformers here, before the fork
    (tmp_path / "shm").mkdir()
    # fork: the children inherit the imported torch/transformers (a spawn re-imports them, ~10 s)
    mp.start_processes(dp_worker, args=(world, free_port(), str(tmp_path), plan_name, STEPS,
                                        clip, shared, per_node, master_dtype, device),
                       nprocs=world, join=True, start_method="fork")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _assert_equal_to_one_process(ranks, *, plan_name, clip, tmp_path, atol=1e-7) -> None:
    reference = reference_params(plan_name, steps=STEPS, world=len(ranks), clip=clip,
                                 nvme_dir=tmp_path / "nvme_ref")
    for shard in ranks:  # every rank holds the same, updated masters
        assert shard["params"].keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(shard["params"][name], ref, rtol=1e-5, atol=atol,
                                       msg=lambda m, n=name: f"{n}: {m}")
    # ZeRO-1: the ranks' Adam moments together are one full set (2 x 4 B per parameter)
    numel = sum(v.numel() for v in reference.values())
    assert sum(s["moment_bytes"] for s in ranks) == 8 * numel
    assert all(0 < s["moment_bytes"] < 8 * numel for s in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("plan_name,clip,shared",
                         [("all_hbm", 0.0, True), ("mixed_tiers", 0.05, True),
                          ("mixed_tiers", 0.05, False)],
                         ids=["all_hbm-no_clip-shared", "mixed_tiers-clipped-shared",
                              "mixed_tiers-clipped-private"])
def test_two_ranks_equal_one_process_after_three_steps(plan_name, clip, shared, tmp_path):
    ranks = _run_ranks(tmp_path, world=WORLD, plan_name=plan_name, clip=clip, shared=shared)
    _assert_equal_to_one_process(ranks, plan_name=plan_name, clip=clip, tmp_path=tmp_path)
    # shared: rank 1 reads what rank 0 wrote into the one copy; private: its own copy
    assert [s["probe"] == PROBE for s in ranks] == [True, shared]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu-checked", "cpu-threaded"])
def test_two_ranks_under_the_ordering_checkers_equal_one_process(device, tmp_path):
    """Each rank's engine runs under the checker (zero violations, or the rank raises) and the
    result still equals one process on the cpu backend."""
    ranks = _run_ranks(tmp_path, world=WORLD, plan_name="mixed_tiers", clip=0.05, shared=True,
                       device=device)
    _assert_equal_to_one_process(ranks, plan_name="mixed_tiers", clip=0.05, tmp_path=tmp_path)


@pytest.mark.slow
def test_two_nodes_of_two_ranks_share_one_copy_per_node_and_equal_one_process(tmp_path):
    """4 ranks as 2 "nodes" x 2: in-place updates inside a node, broadcasts across nodes."""
    ranks = _run_ranks(tmp_path, world=4, plan_name="mixed_tiers", clip=0.05, shared=True,
                       per_node=2)
    # 4 ranks sum their gradients in gloo's reduction order, one process in micro-batch order:
    # fp32 addition is not associative, and 3 Adam steps amplify the last-bit differences of
    # near-zero gradients (g / sqrt(v)) to ~2e-7 on weights of ~0.1 (a few ulp)
    _assert_equal_to_one_process(ranks, plan_name="mixed_tiers", clip=0.05, tmp_path=tmp_path,
                                 atol=5e-7)
    # node 0's copy is ranks 0 and 1's, node 1's is ranks 2 and 3's: the probe written by
    # each node's local rank 0 is seen by its node only (two copies, not one, not four)
    assert [s["probe"] for s in ranks] == [PROBE, PROBE, PROBE + 1, PROBE + 1]
    # every node's file was unlinked once mapped: nothing is left in the shm directory
    assert list((tmp_path / "shm").iterdir()) == []


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


@pytest.mark.slow
def test_two_ranks_with_bf16_masters_track_one_process_within_bf16_rounding(tmp_path):
    """bf16 masters and gradients (12 B/param): the ranks' bf16 gradients are summed by gloo in
    bf16, one process adds its micro-batches into one bf16 accumulator, so the two round
    differently: after 3 AdamW steps the mean difference must stay under 2% of the mean
    distance the weights moved (a run that skipped the reduction would be off by about that
    whole distance)."""
    ranks = _run_ranks(tmp_path, world=WORLD, plan_name="mixed_tiers", clip=0.05, shared=True,
                       master_dtype="bf16")
    reference = reference_params("mixed_tiers", steps=STEPS, world=WORLD, clip=0.05,
                                 nvme_dir=tmp_path / "nvme_ref", master_dtype="bf16")
    start = tiny_adapter(master_dtype="bf16").params.named_master()
    moved = torch.cat([(ref.float() - start[n].float()).abs().flatten()
                       for n, ref in reference.items()])
    diff = torch.cat([(ranks[0]["params"][n].float() - ref.float()).abs().flatten()
                      for n, ref in reference.items()])
    # Adam moves every weight by about lr per step, so a gradient element near zero whose sign
    # the rounding flips moves the other way (max diff ~ 2 lr): compare the mean instead
    assert float(diff.mean()) < 0.02 * float(moved.mean()), (diff.mean(), moved.mean())
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
    assert all(t.dtype == torch.bfloat16 for t in ranks[0]["params"].values())


def test_a_shard_saved_in_fp32_loads_into_a_block_now_8bit_and_back():
    """Resume under another plan's q8_blocks (re-planning rewrote plan.json): the owner's
    shard converts like one process does, instead of failing on missing keys."""
    pytest.importorskip("bitsandbytes", reason="8-bit optimizer states need the q8 extra")
    from lazytrain.dist.reducer import GradReducer
    from lazytrain.dist.sharding import ShardedOptimizer, group_owners
    from lazytrain.runtime import optim8bit

    params = tiny_adapter().params
    owners = group_owners(params, 1)

    def optimizer():
        return ShardedOptimizer(params, reducer=GradReducer(params, owners=owners, rank=0),
                                owners=owners, rank=0, lr=1e-3)

    saver = optimizer()
    g = torch.Generator().manual_seed(0)
    for group in params.groups:
        group.grad.copy_(torch.randn(group.numel, generator=g))
        saver.submit(group, lr=1e-3)
    state = saver.state_dict()
    saver.close()
    m_saved = state["block0"]["state"][0]["exp_avg"].clone()

    loader = optimizer()
    loader.set_q8_blocks([0])
    loader.load_state_dict(state)
    assert loader.q8 == {"block0"}
    m, _, step = optim8bit.moments_from_q8(loader.optims["block0"])
    assert step == 1
    # 8-bit block-wise quantization: errors up to ~1% of the block maximum
    torch.testing.assert_close(m, m_saved, rtol=0, atol=0.02 * float(m_saved.abs().max()))
    loader.close()


@pytest.mark.slow
def test_the_checker_catches_an_update_that_does_not_wait_for_its_gloo_reduction(tmp_path,
                                                                               monkeypatch):
    """Removing the optimizer's wait for the asynchronous gradient reduce (gloo's own thread
    writes the accumulator) is an ordering violation on that rank, not a silent wrong step."""
    from lazytrain.dist import sharding

    update = sharding.ShardedOptimizer._update

    def update_without_waiting(self, group, lr, grad_scale):
        wait, self.reducer.wait = self.reducer.wait, lambda g: None
        try:
            return update(self, group, lr, grad_scale)
        finally:
            self.reducer.wait = wait

    monkeypatch.setattr(sharding.ShardedOptimizer, "_update", update_without_waiting)
    with pytest.raises(Exception) as info:  # a rank fails: start_processes raises
        _run_ranks(tmp_path, world=WORLD, plan_name="all_hbm", clip=0.0, shared=True,
                   device="cpu-checked")
    assert "OrderingViolation" in str(info.value) and "gloo reduce" in str(info.value)
