"""Cost of the per-window instrumentation (runtime/instrument.py): step time with and without.

Run:  python benchmarks/instrument_overhead.py [--layers 4] [--hidden 256] [--seq 128]
          [--batch 2] [--rounds 6] [--tiers mixed|recompute|nvme]

Two engines on the same plan and identical weights, one with `instrument=True`; steps are
interleaved (off/on, then on/off, ...) so both see the same machine load. Prints the median and
the best step time of each and the ratio on/off (goal: <= 1.02). The first round is warm-up.
On a loaded machine that ratio is dominated by noise, so the script also measures the
instrumentation's own cost directly: the timing events of one step (counted; every window's
two, two per block of the engine's thread, two per compute-stream wait), times the measured
cost of half a block (`on_block` + `on_wait` in a loop), plus the measured cost of
`take_records`, as a fraction of the step. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lazytrain.models import adapter_from_model
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.runtime.build import make_engine

TIERS = {
    "mixed": lambda L: ["recompute", "dram", "hbm", "nvme"] * (L // 4) + ["hbm"] * (L % 4 + 1),
    "recompute": lambda L: ["recompute"] * L + ["hbm"],
    "nvme": lambda L: ["nvme"] * L + ["hbm"],
}


def make_adapter(args):
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                      max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return adapter_from_model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


def make_plan(adapter, args):
    """Placeholder costs (the plan's structure matters here); real bytes and provenance."""
    L = adapter.num_blocks
    A = args.batch * args.seq * args.hidden * 4
    P = adapter.params.blocks[0].numel * 4
    problem = PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L, weight_bytes=(P,) * L,
        grad_bytes=(P,) * L, internal_bytes=(8 * A,) * L, boundary_bytes=(A,) * (L + 1),
        params_per_block=(P // 4,) * L, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10,
        duplex_bytes_per_s=1.5e10, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
        hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12, copies_overlap_compute=False,
        drain_windows=1, prefetch_windows=1, nvme_lead_windows=1,
        provenance={"model_config_sha256": adapter.hf_config_sha256, "seq_len": args.seq,
                    "micro_batch": args.batch})
    tiers = tuple(TIERS[args.tiers](L))
    return build_plan(problem, decisions_from_tiers(problem, tiers, ()),
                      solver=SolveRecord(backend="manual"))


def batch(args, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def direct_cost_ms(engine, args) -> float:
    """Instrument cost of one step, ms: its timing events (counted over one step; each costs
    about half of one engine-thread block, `on_block` + `on_wait`, timed in a loop) plus
    resolving the step's records."""
    dev, inst = engine.dev, engine.instrument
    events = {"n": 0}
    real = dev.timing_event

    def counting(stream=None):
        events["n"] += 1
        return real(stream)

    dev.timing_event = counting  # this object only; removed below
    try:
        engine.step([batch(args, 99)])
    finally:
        del dev.timing_event
    inst.begin_step()
    inst.begin_micro_batch(0)
    n = 20000
    with inst.window("probe"):
        t0 = time.perf_counter()
        for _ in range(n):
            inst.on_block()
            inst.on_wait("h2d", 0.0)
        per_block_s = (time.perf_counter() - t0) / n
    inst.begin_step()  # forget the probe
    inst.begin_micro_batch(0)
    for name in ["pre"] + [w.name for w in engine.plan.windows] + ["post"]:
        with inst.window(name):
            pass
    t0 = time.perf_counter()
    inst.take_records()
    records_s = time.perf_counter() - t0
    return (events["n"] / 2 * per_block_s + records_s) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tiers", choices=sorted(TIERS), default="mixed")
    args = ap.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        engines = {}
        for on in (False, True):
            adapter = make_adapter(args)
            engines[on] = make_engine(adapter, make_plan(adapter, args), device="cpu",
                                      nvme_dir=Path(tmp) / str(on), instrument=on)
        try:
            for r in range(args.rounds + 1):
                for on in ((False, True) if r % 2 else (True, False)):  # alternate order
                    t0 = time.perf_counter()
                    stats = engines[on].step([batch(args, r)])
                    engines[on].optimizer.wait_all()  # the update tail belongs to this step
                    if r:  # round 0 is warm-up
                        times[on].append(time.perf_counter() - t0)
                    assert bool(stats.windows) == on
            cost_ms = direct_cost_ms(engines[True], args)
        finally:
            for e in engines.values():
                e.close()
    med = {on: statistics.median(v) * 1e3 for on, v in times.items()}
    best = {on: min(v) * 1e3 for on, v in times.items()}
    print(f"plan {args.tiers}, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"batch {args.batch}, {args.rounds} rounds")
    print(f"step ms        off {med[False]:8.2f} (best {best[False]:8.2f})   "
          f"on {med[True]:8.2f} (best {best[True]:8.2f})")
    print(f"ratio on/off   median {med[True] / med[False]:.4f}   best "
          f"{best[True] / best[False]:.4f}   (goal <= 1.02)")
    print(f"direct cost    {cost_ms:.3f} ms per step = {cost_ms / best[False]:.4%} of the best "
          f"uninstrumented step")


if __name__ == "__main__":
    main()
