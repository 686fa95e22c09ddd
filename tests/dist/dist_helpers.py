"""Builders for the data-parallel tests: a free local port, a tiny Llama adapter, hand-made plans,
global batches, and the worker that one spawned rank runs."""

from __future__ import annotations

import os
import socket

import torch

VOCAB, HIDDEN, BATCH, SEQ, LAYERS = 96, 64, 2, 12, 3


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous port of one test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_adapter(seed: int = 0, **where):
    """A 3-layer hidden-64 fp32 Llama adapter, identical on every rank for the same seed
    (`where`: `masters`, `fills_masters` of `adapter_from_model`)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lazytrain.models import adapter_from_model

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(seed)
    return adapter_from_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                              **where)


def tiny_plan(adapter, tiers, keep=()):
    """A validated plan for `tiers` (len L+1) on a hand-made problem matching the tensors."""
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord
    from lazytrain.planner.problem import PlanningProblem

    L = adapter.num_blocks
    A = BATCH * SEQ * HIDDEN * 4
    P = adapter.params.blocks[0].numel * 4
    problem = PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L, weight_bytes=(P,) * L,
        grad_bytes=(P,) * L, internal_bytes=(4 * A,) * L, boundary_bytes=(A,) * (L + 1),
        params_per_block=(P // 4,) * L, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
        duplex_bytes_per_s=1.5e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
        hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12,
        provenance={"model": "tiny", "model_config_sha256": adapter.hf_config_sha256,
                    "seq_len": SEQ, "micro_batch": BATCH, "dtype": "fp32"})
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep))
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


PLANS = {
    # every boundary in HBM, no recompute
    "all_hbm": (("hbm",) * (LAYERS + 1), ()),
    # boundary 0 recomputed (re-embedded), 1 offloaded to DRAM, 2 to NVMe, block 2 kept
    "mixed_tiers": (("recompute", "dram", "nvme", "hbm"), (2,)),
}
"""Plan name -> (tiers of boundaries 0..L, keep-internals blocks)."""


def global_batches(steps: int, per_step: int, *, seed: int = 1) -> list[list[dict]]:
    """`steps` lists of `per_step` micro-batches [BATCH, SEQ] with masked prompt and padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(per_step):
            ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
            labels = ids.clone()
            labels[:, :3] = -100
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            ids[-1, -4:] = 0
            labels[-1, -4:] = -100
            mask[-1, -4:] = 0
            step.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
        out.append(step)
    return out


def engine_kwargs(nvme_dir, *, clip: float, grad_accum: int, device: str = "cpu") -> dict:
    from lazytrain.runtime.backends import make_device

    return dict(device=make_device(device), nvme_dir=nvme_dir, lr=3e-3, weight_decay=0.01,
                clip_grad_norm=clip, grad_accum=grad_accum, seed=0, io_threads=1)


def reference_params(plan_name: str, *, steps: int, world: int, clip: float, nvme_dir,
                     master_dtype: str = "fp32"):
    """One process, grad_accum = world: the parameters after `steps` steps (the reference).

    Runs with one intra-op thread, as the ranks do (`dp_worker`): the reductions then sum in
    the same order whatever thread count an earlier test left, so the comparison does not
    depend on which tests ran before."""
    from lazytrain.runtime.build import make_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    adapter = tiny_adapter(master_dtype=master_dtype)
    plan = tiny_plan(adapter, *PLANS[plan_name])
    engine = make_engine(adapter, plan, **engine_kwargs(nvme_dir, clip=clip, grad_accum=world))
    try:
        for batches in global_batches(steps, world):
            engine.step(batches)
        return {k: v.clone() for k, v in engine.named_masters().items()}
    finally:
        engine.close()
        torch.set_num_threads(threads)


PROBE = 12345.0
"""PROBE + node index is written by each node's local rank 0 into its ends master after
training (sharing probe)."""


def dp_worker(rank: int, world: int, port: int, out_dir: str, plan_name: str, steps: int,
              clip: float, shared: bool = False, per_node: int | None = None,
              master_dtype: str = "fp32", device: str = "cpu") -> None:
    """One rank of the data-parallel run (torch.multiprocessing.start_processes target).

    `per_node` ranks per "node" (default: all on one), node by node as torchrun numbers them;
    `shared`: the node's ranks share one master copy (`lazytrain.dist.shared_masters`, files in
    OUT_DIR/shm). Saves OUT_DIR/rankR.pt: the final masters, the Adam bytes this rank holds and,
    and the value of ends.master[0] this rank reads after its node's local rank 0 wrote
    `PROBE` + node index there."""
    torch.set_num_threads(1)
    per_node = per_node or world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                      LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
    from lazytrain.dist import shared_masters
    from lazytrain.dist.parallel import build_engine, local_share
    from lazytrain.dist.process_group import barrier, init_from_env, shutdown
    from lazytrain.dist.sharding import owned_moment_bytes

    ctx = init_from_env(backend="gloo", device="cpu", timeout_s=60)
    where = {"master_dtype": master_dtype}
    if shared:
        where.update(shared_masters.node_store(ctx, shm_dir=os.path.join(out_dir, "shm")))
    adapter = tiny_adapter(**where)
    barrier(ctx)
    plan = tiny_plan(adapter, *PLANS[plan_name])
    kw = engine_kwargs(os.path.join(out_dir, f"nvme{rank}"), clip=clip, grad_accum=1,
                       device=device)
    lr = kw.pop("lr")
    engine = build_engine(adapter, plan, ctx=ctx, lr=lr, shared_masters=shared, **kw)
    try:
        for batches in global_batches(steps, world):
            engine.step(local_share(batches, ctx=ctx, grad_accum=1))
        params = {k: v.clone() for k, v in engine.named_masters().items()}
        barrier(ctx)  # every rank has its copy of the final masters before the probe
        if ctx.local_rank == 0:
            adapter.params.ends.master[0] = PROBE + ctx.node_rank
        barrier(ctx)
        torch.save({"params": params, "moment_bytes": owned_moment_bytes(engine.optimizer),
                    "probe": float(adapter.params.ends.master[0])},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        engine.close()
        shutdown(ctx)


def tiny_model_dir(root):
    """A 2-block tied Llama (random weights) + a BPE tokenizer trained on the arithmetic data."""
    from lazytrain.data.synthetic import arithmetic_dataset
    from tiny_models import tiny_model_dir as build

    train, _ = arithmetic_dataset(num_train=200, num_eval=0, seed=7)
    texts = [m.content for ex in train for m in ex.messages] + ["Question: Answer: ####"]
    return build(root, texts, layers=2)


def run_overrides(model_dir, run_dir, *extra: str) -> list[str]:
    """Config overrides of a tiny CPU data-parallel run (no evaluation, MegaTrain K=1 plan)."""
    return [f"model.config_path={model_dir}", f"train.run_dir={run_dir}", "data.seq_len=96",
            "data.num_eval=0", "train.micro_batch=2", "train.steps=4", "train.lr=3e-3",
            "train.warmup_steps=1", "planner.policy=megatrain", "planner.megatrain_k=1",
            "runtime.device=cpu", "runtime.threads=1", "runtime.io_threads=1",
            "dist.timeout_s=20", *extra]


def train_worker(rank: int, world: int, port: int, overrides: list[str], resume: bool,
                 sigterm_at: int, sigkill_at: int, error_dir: str, plan_path: str = "",
                 read_delay_ms: float = 0.0) -> None:
    """One rank calling `lazytrain.train.loop.train` as torchrun would start it (env://).

    `sigterm_at` / `sigkill_at` > 0: rank 1 sends itself SIGTERM / SIGKILL after that step.
    `plan_path`: train with this plan; `read_delay_ms` > 0: every NVMe checkpoint read of every
    rank sleeps that long (`FaultInjector.delay_reads`).
    Any exception is written to `error_dir/rank{rank}.txt` and re-raised (exit code 1).
    """
    import signal

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from lazytrain.config import load_config
    from lazytrain.train.loop import TrainHooks, train

    def on_step_end(step, stats):
        if rank == 1 and step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if rank == 1 and step == sigkill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    from lazytrain.planner.plan import Plan
    from lazytrain.runtime.nvme import FaultInjector

    faults = None
    if read_delay_ms:
        faults = FaultInjector()
        faults.delay_reads(read_delay_ms)
    try:
        train(load_config(None, overrides), resume=resume, progress=False,
              plan=Plan.load(plan_path) if plan_path else None,
              hooks=TrainHooks(on_step_end=on_step_end, fault_hook=faults), log=lambda msg: None)
    except BaseException as exc:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as fh:
            fh.write(f"{type(exc).__name__}: {exc}")
        raise


def launch(overrides, *, world: int = 2, resume: bool = False, sigterm_at: int = 0,
           sigkill_at: int = 0, error_dir: str = "", timeout_s: float = 60.0,
           plan_path: str = "", read_delay_ms: float = 0.0) -> list[int]:
    """Fork `world` ranks of `train_worker`; returns their exit codes (-9: killed)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # inherit the imported modules (a spawn re-imports: ~10 s)
    port = free_port()
    procs = [ctx.Process(target=train_worker, args=(r, world, port, list(overrides), resume,
                                                    sigterm_at, sigkill_at, error_dir,
                                                    plan_path, read_delay_ms))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    codes = []
    for p in procs:
        if p.is_alive():  # never expected: the test fails on the returned None
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes
