"""Host memory and step time of data-parallel ranks: one shared master copy per node against a
private copy per rank (`lazytrain.dist.shared_masters`).

Run:  python benchmarks/dp_memory.py [--ranks 2] [--layers 6] [--hidden 512] [--vocab 16000]
          [--seq 128] [--batch 2] [--steps 4]

For each mode (private, shared) it forks `--ranks` gloo ranks on this host that build the same
Llama, train `--steps` steps on random tokens with an all-in-HBM plan, and report per rank:
- PSS after the last step (kB, /proc/self/smaps_rollup "Pss": pages shared by k processes count
  1/k to each, so a shared master shows up as master/N per rank);
- the bytes of the master, gradient and Adam tensors this rank holds, from the tensors;
- the median step time of the steps after the first.
Prints one table with both modes side by side and the ratios shared/private. Expected from the
layout (P parameters, fp32): the master's share of PSS goes from 4 P to 4 P / N. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pss_kb() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def _adapter(args, **where):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lazytrain.models import adapter_from_model

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    return adapter_from_model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), **where)


def _plan(adapter, args):
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord
    from lazytrain.planner.problem import PlanningProblem

    L = adapter.num_blocks
    A = args.batch * args.seq * args.hidden * 4
    P = adapter.params.blocks[0].numel
    problem = PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L, weight_bytes=(4 * P,) * L,
        grad_bytes=(4 * P,) * L, internal_bytes=(4 * A,) * L, boundary_bytes=(A,) * (L + 1),
        params_per_block=(P,) * L, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
        duplex_bytes_per_s=1.5e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
        hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12,
        provenance={"model": "bench", "model_config_sha256": adapter.hf_config_sha256,
                    "seq_len": args.seq, "micro_batch": args.batch, "dtype": "fp32"})
    decisions = decisions_from_tiers(problem, ("hbm",) * (L + 1))
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


def _worker(rank, world, port, out_dir, shared, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from lazytrain.dist import shared_masters
    from lazytrain.dist.parallel import build_engine
    from lazytrain.dist.process_group import barrier, init_from_env, shutdown
    from lazytrain.dist.sharding import owned_moment_bytes

    ctx = init_from_env(backend="gloo", device="cpu", timeout_s=300)
    where = shared_masters.node_store(ctx, shm_dir="/dev/shm") if shared else {}
    adapter = _adapter(args, **where)
    barrier(ctx)
    engine = build_engine(adapter, _plan(adapter, args), ctx=ctx, lr=1e-4, device="cpu",
                          nvme_dir=os.path.join(out_dir, f"nvme{rank}"), shared_masters=shared)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        t0 = time.perf_counter()
        engine.step([{"input_ids": ids, "labels": ids.clone()}])
        engine.optimizer.wait_all()
        times.append(time.perf_counter() - t0)
    barrier(ctx)
    params = adapter.params
    row = {"pss_kb": _pss_kb(), "step_s": statistics.median(times[1:] or times),
           "master_bytes": sum(g.master.numel() * g.master.element_size() for g in params.groups),
           "grad_bytes": sum(g.grad.numel() * g.grad.element_size() for g in params.groups),
           "moment_bytes": owned_moment_bytes(engine.optimizer),
           "params": params.total_numel()}
    torch.save(row, os.path.join(out_dir, f"{'shared' if shared else 'private'}{rank}.pt"))
    barrier(ctx)
    engine.close()
    shutdown(ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    _adapter(args)  # import transformers before forking
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for shared in (False, True):
            mp.start_processes(_worker, args=(args.ranks, _free_port(), out, shared, args),
                               nprocs=args.ranks, join=True, start_method="fork")
            name = "shared" if shared else "private"
            rows[name] = [torch.load(os.path.join(out, f"{name}{r}.pt"))
                          for r in range(args.ranks)]
    P = rows["private"][0]["params"]
    print(f"{args.ranks} ranks on one host, {P / 1e6:.1f} M params (fp32 master "
          f"{4 * P / 1e6:.0f} MB), {args.steps} steps")
    print("mode     rank  PSS MB  master MB (mapped)  grad MB  Adam MB  step s")
    for name, ranks in rows.items():
        for r, row in enumerate(ranks):
            print(f"{name:<8} {r:>4}  {row['pss_kb'] / 1e3:6.0f}  {row['master_bytes'] / 1e6:18.0f}  "
                  f"{row['grad_bytes'] / 1e6:7.0f}  {row['moment_bytes'] / 1e6:7.0f}  "
                  f"{row['step_s']:6.3f}")
    pss = {n: sum(r["pss_kb"] for r in rs) / 1e3 for n, rs in rows.items()}
    step = {n: statistics.median(r["step_s"] for r in rs) for n, rs in rows.items()}
    saved = pss["private"] - pss["shared"]
    expected = 4 * P * (args.ranks - 1) / 1e6
    print(f"PSS of all ranks: private {pss['private']:.0f} MB, shared {pss['shared']:.0f} MB "
          f"(ratio {pss['shared'] / pss['private']:.3f}); saved {saved:.0f} MB, layout "
          f"predicts 4 P (N-1) = {expected:.0f} MB")
    print(f"median step time shared/private: {step['shared'] / step['private']:.3f}")


if __name__ == "__main__":
    main()
