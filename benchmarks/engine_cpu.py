"""Engine step time on CPU vs plain HF training with activation checkpointing; NVMe tier vs dd.

Run:  python benchmarks/engine_cpu.py [--layers 4] [--hidden 256] [--seq 128] [--batch 2]
          [--steps 3] [--nvme-mb 64] [--nvme-dir DIR]

Prints, from one run on one machine (ratios only; absolute times depend on the load):
- best step time over interleaved rounds of plain HF training (activation checkpointing through
  `enable_activation_checkpointing`, fused AdamW) and of
  the engine under MegaTrain-style all-recompute plans (k=1: every boundary kept, every block
  re-forwarded, the same work as HF's checkpointing; k=4: every 4th boundary kept), and the
  ratio engine / HF (the engine issue's goal: <= 1.3x);
- a per-phase breakdown of the best step of each (`--breakdown`, default on): HF's forward,
  backward (with its re-forwards) and optimizer step timed apart; the engine's windows summed by
  phase (pre, forward f*, turn, backward b*, post) from its window meter, the time outside the
  windows (the optimizer tail it waits for), and from one instrumented step the host work
  (conversion, accumulation) and the exposed waits (the instrument's own overhead shows in
  that step's wall, printed beside it);
- the NVMe-tier write/read throughput of the checkpoint store vs a dd-style copy of the same
  bytes (`benchmarks/nvme_io.py`; goal >= 0.8).
Not part of CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lazytrain.models import adapter_from_model
from lazytrain.planner.heuristics import megatrain_plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.runtime.build import make_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvme_io import format_table, measure_nvme_path  # noqa: E402


def make_config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                       num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                       max_position_embeddings=args.seq)


def make_problem(adapter, args) -> PlanningProblem:
    """Costs are placeholders (the plan's structure is what matters here); the provenance and
    boundary bytes are the real ones."""
    L = adapter.num_blocks
    A = args.batch * args.seq * args.hidden * 4
    P = adapter.params.blocks[0].numel * 4
    return PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L, weight_bytes=(P,) * L,
        grad_bytes=(P,) * L, internal_bytes=(8 * A,) * L, boundary_bytes=(A,) * (L + 1),
        params_per_block=(P // 4,) * L, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10,
        duplex_bytes_per_s=1.5e10, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
        hbm_bytes=10**12, dram_bytes=10**12, copies_overlap_compute=False,
        provenance={"model_config_sha256": adapter.hf_config_sha256, "seq_len": args.seq,
                    "micro_batch": args.batch})


def batch(args, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def enable_activation_checkpointing(model) -> None:
    """HF's activation checkpointing: `activation_checkpointing_enable` where the installed
    transformers has it (it deprecates `gradient_checkpointing_enable`, removed in v6), else
    the older name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        enable = model.gradient_checkpointing_enable
    enable()


def time_hf(config, state, args) -> list[tuple[float, dict]]:
    """(step s, {phase: ms}) per timed step of plain HF training."""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state)
    enable_activation_checkpointing(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(**batch(args, step), use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        times.append((t3 - t0, {"forward (+ head)": (t1 - t0) * 1e3,
                                "backward (+ re-forward, head)": (t2 - t1) * 1e3,
                                "optimizer": (t3 - t2) * 1e3}))
    return times[1:]  # the first step warms up allocators


def engine_phases(window_ms: dict[str, float], step_s: float) -> dict[str, float]:
    """The engine's window times summed by phase, plus the time outside the windows, ms."""
    phases = {"pre": 0.0, "forward f*": 0.0, "turn (head)": 0.0, "backward b*": 0.0,
              "post": 0.0}
    for name, ms in window_ms.items():
        key = {"pre": "pre", "turn": "turn (head)", "post": "post"}.get(
            name, "forward f*" if name.startswith("f") else "backward b*")
        phases[key] += ms
    phases["outside windows (optimizer tail)"] = step_s * 1e3 - sum(window_ms.values())
    return phases


def time_engine(config, state, args, k: int, nvme_dir: Path, *,
                instrument: bool = False) -> list[tuple[float, dict]]:
    """(step s, {phase: ms}) per timed engine step; with `instrument`, also host_ms and the
    exposed wait per channel summed over the windows."""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state)
    adapter = adapter_from_model(model)
    plan = megatrain_plan(make_problem(adapter, args), k=min(k, args.layers))
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=nvme_dir, lr=1e-4,
                         instrument=instrument)
    times = []
    try:
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            stats = engine.step([batch(args, step)])
            engine.optimizer.wait_all()  # count the optimizer tail like HF's opt.step()
            step_s = time.perf_counter() - t0
            phases = engine_phases(stats.window_ms, step_s)
            if instrument:
                for record in stats.windows:
                    for w in record["windows"]:
                        phases["host work (workers)"] = (phases.get("host work (workers)", 0.0)
                                                         + w["host_ms"])
                        for channel, ms in w["wait_ms"].items():
                            key = f"waited on {channel}"
                            phases[key] = phases.get(key, 0.0) + ms
            times.append((step_s, phases))
    finally:
        engine.close()
    return times[1:]


def print_breakdown(best: dict[str, tuple[float, dict]], instrumented: tuple[float, dict]) -> None:
    """Per-phase ms of each run's best step, side by side."""
    print("\nper-phase breakdown of the best step, ms")
    for name, (t, phases) in best.items():
        print(f"  {name} (step {t * 1e3:.1f} ms)")
        for phase, ms in phases.items():
            print(f"    {phase:<36}{ms:>10.1f}")
    t, phases = instrumented
    print(f"  engine k=1, one instrumented step (step {t * 1e3:.1f} ms; the instrument's own "
          "overhead included)")
    for phase, ms in phases.items():
        print(f"    {phase:<36}{ms:>10.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nvme-mb", type=int, default=64, help="MB per NVMe transfer (0: skip)")
    p.add_argument("--nvme-dir", type=Path, default=None)
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the per-phase breakdown")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    config = make_config(args)
    state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    with tempfile.TemporaryDirectory(dir=args.nvme_dir or Path.cwd(), prefix="engine-bench-") as tmp:
        runs = {"HF + activation checkpointing": lambda: time_hf(config, state, args)}
        for k in (1, 4):
            runs[f"engine, megatrain plan k={k}"] = (
                lambda k=k: time_engine(config, state, args, k, Path(tmp)))
        best: dict[str, tuple[float, dict]] = {}
        for _ in range(args.rounds):  # interleaved rounds, best step: robust to a shared CPU
            for name, run in runs.items():
                best[name] = min([best.get(name, (float("inf"), {})), *run()],
                                 key=lambda r: r[0])
        hf = best["HF + activation checkpointing"][0]
        print(f"model: llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
              f"seq {args.seq}, batch {args.batch}, fp32, {torch.get_num_threads()} threads; "
              f"best step of {args.rounds} interleaved rounds x {args.steps} steps")
        print(f"{'run':<34}{'step s':>9}{'vs HF':>8}")
        for name, (t, _) in best.items():
            print(f"{name:<34}{t:>9.3f}{t / hf:>8.2f}")
        if args.breakdown:
            instrumented = min(time_engine(config, state, args, 1, Path(tmp), instrument=True),
                               key=lambda r: r[0])
            print_breakdown(best, instrumented)
        if args.nvme_mb:
            print(format_table(measure_nvme_path(Path(tmp) / "nvme", args.nvme_mb * 1_000_000)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
