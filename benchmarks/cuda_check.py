"""CUDA check of the engine: gradients vs HF autograd on the GPU, link bandwidth, overlap.

Run:  python benchmarks/cuda_check.py [--layers 8] [--hidden 1024] [--seq 512] [--batch 4]

On a machine without a CUDA device it prints why and exits 0 (nothing to check). Otherwise:
1. gradient checks (fp32, tiny Llama, several plan kinds incl. dram/nvme tiers, keep-internals,
   dropout): the engine on CUDA vs plain HF autograd on CUDA, max abs diff relative to the
   gradient scale (threshold 1e-4: cuBLAS/SDPA kernels differ from the CPU's);
2. achieved H2D and D2H GB/s of 256 MB pinned copies on separate streams;
3. an overlap check on a bigger bf16 model under a MegaTrain k=4 plan: per-block compute time
   (forward F, forward-with-grad + backward FB, measured alone with CUDA events), and per window
   the measured time, the compute it contains and the exposed time (measured - compute); also
   `torch.cuda.max_memory_allocated`. Exposed time near 0 in the f windows means the next
   block's weight load hid behind compute.
Not part of CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

GB = 1e9


def gradient_checks(tmp: Path) -> bool:
    from engine_helpers import micro_batches, model_pair, plan_for, reference_grads, tiny_config
    from lazytrain.runtime.engine import Engine
    R, H, D, N = "recompute", "hbm", "dram", "nvme"
    cases = {"all_hbm": ([H] * 5, (), 0.0), "all_dram": ([D] * 4 + [H], (), 0.0),
             "mixed": ([R, D, H, N, H], (), 0.0), "keep+nvme": ([N, R, R, D, H], (2, 3), 0.0),
             "dropout": ([R, R, R, R, H], (), 0.3)}
    ok = True
    for name, (tiers, keep, dropout) in cases.items():
        ref, adapter = model_pair(tiny_config("llama", dropout=dropout))
        ref.cuda()
        engine = Engine(adapter, plan_for(adapter, tiers, keep), device="cuda", nvme_dir=tmp)
        batches = micro_batches(1)
        torch.manual_seed(7)
        torch.cuda.manual_seed(7)
        engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
        engine.close()
        torch.manual_seed(7)
        torch.cuda.manual_seed(7)
        _, ref_grads = reference_grads(ref, [{k: v.cuda() for k, v in b.items()} for b in batches])
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        worst = max(float((grads[k] - g.cpu()).abs().max()) for k, g in ref_grads.items())
        passed = worst <= 1e-4 * scale
        ok &= passed
        print(f"  grads {name:<10} max|diff| / scale = {worst / scale:.2e}  "
              f"{'ok' if passed else 'FAIL'}")
    return ok


def link_bandwidth(nbytes: int = 256 * 2**20) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for dst, src in ((dev, host), (host, dev)):
        stream = torch.cuda.Stream()
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        out.append(4 * nbytes / (start.elapsed_time(end) / 1e3) / GB)
    return out[0], out[1]


def block_times_ms(adapter, args) -> tuple[float, float]:
    """(F, FB) of block 0 in bf16 with weights already on the device, ms (CUDA events)."""
    group = adapter.params.blocks[0]
    flat = group.master.to("cuda", torch.bfloat16)
    h = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="cuda")
    kwargs = adapter.block_kwargs(ids, h)[0]

    def fwd():
        with torch.no_grad():
            adapter.forward_block(0, h, group.views(flat), kwargs)

    def fwd_bwd():
        x, w = h.detach().requires_grad_(), flat.detach().requires_grad_()
        out = adapter.forward_block(0, x, group.views(w), kwargs)
        torch.autograd.grad(out, (x, w), torch.ones_like(out))

    res = []
    for fn in (fwd, fwd_bwd):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        res.append(start.elapsed_time(end) / 5)
    return res[0], res[1]


def overlap_check(args, tmp: Path) -> None:
    from transformers import LlamaConfig
    from engine_cpu import make_problem
    from lazytrain.models import load_adapter_from_config
    from lazytrain.planner.heuristics import megatrain_plan
    from lazytrain.runtime.engine import Engine
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq)
    adapter = load_adapter_from_config(config, seed=0)
    args.vocab = 32000
    plan = megatrain_plan(make_problem(adapter, args), k=4)
    F, FB = block_times_ms(adapter, args)
    engine = Engine(adapter, plan, device="cuda", nvme_dir=tmp, compute_dtype="bf16")
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, 32000, (args.batch, args.seq))
    for _ in range(3):
        stats = engine.step([{"input_ids": ids, "labels": ids}])
    engine.close()
    print(f"  per-block compute (bf16): F = {F:.2f} ms, F_grad + B = {FB:.2f} ms")
    print(f"  {'window':<8}{'measured ms':>12}{'compute ms':>12}{'exposed ms':>12}")
    segs = {e - 1: (s, e) for s, e in plan.segments()}
    for name, ms in stats.window_ms.items():
        if name.startswith("f"):
            comp = F
        elif name.startswith("b"):
            j = int(name[1:])
            s, e = segs.get(j, (j, j))
            comp = FB + (F * (e - 1 - s) if j in segs else 0.0)
        else:
            print(f"  {name:<8}{ms:>12.2f}{'-':>12}{'-':>12}")
            continue
        print(f"  {name:<8}{ms:>12.2f}{comp:>12.2f}{max(0.0, ms - comp):>12.2f}")
    print(f"  max_memory_allocated = {torch.cuda.max_memory_allocated() / GB:.2f} GB; "
          f"step {stats.step_s:.3f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False; this torch "
              f"is {torch.__version__}); nothing to check. Run it on a GPU machine.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(f"device: {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as tmp:
        ok = gradient_checks(Path(tmp))
        h2d, d2h = link_bandwidth()
        print(f"  H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s (pinned, 256 MiB x 4)")
        overlap_check(args, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
