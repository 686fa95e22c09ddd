"""Predicted vs measured step time on this CPU, without and with calibration, for six plan kinds.

Run:  nice python benchmarks/predict_accuracy.py [--layers 6 --hidden 256 --seq 128 --batch 4]

A small random Llama (config.json only, random init) is planned twice: "uncalibrated" with the
analytic `cpu` preset, "calibrated" with a profile measured here by
`profile.profiler.measure_profile(quick=True)` (the calibration mode). For each plan kind the
same tier assignment is built against both problems (transfers scheduled by the evaluator) and
both plans run through the engine with the trainer's flags (instrumented, budgets on):
all-recompute (boundaries 0 and L only), recompute-heavy (every third boundary), mixed tiers
(hbm / dram / nvme / recompute), NVMe-heavy (every boundary but L on NVMe), DRAM-offload-heavy
(every boundary but L in DRAM) and all-HBM with every block's internals kept (the default job's
kind). Measured = median engine step time after warm-up steps; predicted = the plan's
`predicted.step_ms` (the fluid evaluator, CPU contention model). Target |error| <= 15% with
calibration. Not part of CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def make_model_dir(root: Path, *, layers: int, hidden: int, vocab: int = 2048) -> Path:
    """config.json of a random Llama (no weights: the loader initialises from the seed)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024,
                      tie_word_embeddings=False)
    root.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(root)
    return root


def setup_run(root: Path, *, layers: int, hidden: int, seq: int, batch: int,
              repeats: int = 5, quick: bool = False):
    """(cfg planning with the profile measured here, adapter, profile dict); the profile's
    wall seconds are in `profile["measurements"]["profile_s"]`."""
    from lazytrain.config import load_config
    from lazytrain.profile.profiler import measure_profile
    from lazytrain.spec.model import ModelSpec
    from lazytrain.train import model_source

    model_dir = make_model_dir(root / "model", layers=layers, hidden=hidden)
    overrides = [f"model.config_path={model_dir / 'config.json'}", f"data.seq_len={seq}",
                 f"train.micro_batch={batch}", "runtime.device=cpu", "hardware.preset=cpu",
                 f"train.run_dir={root / 'run'}", "train.clip_grad_norm=1.0"]
    cfg = load_config(None, overrides)
    adapter = model_source.load_adapter(model_source.resolve_model_source(cfg.model.config_path),
                                 compute_dtype="fp32", master_dtype="fp32", seed=0)
    spec = ModelSpec.from_hf_config(adapter.config.to_dict())
    t0 = time.perf_counter()
    prof = measure_profile(adapter, [b.kind for b in spec.blocks], micro_batch=batch,
                           seq_len=seq, compute_dtype="fp32", device="cpu",
                           nvme_dir=root / "profile-nvme", repeats=repeats, quick=quick,
                           model_config_sha256=spec.config_sha256)
    prof["measurements"]["profile_s"] = time.perf_counter() - t0
    (root / "profile.json").write_text(json.dumps(prof, indent=1))
    cfg = load_config(None, overrides + [f"hardware.profile_path={root / 'profile.json'}"])
    return cfg, adapter, prof


def without_profile(cfg):
    """`cfg` planning with the analytic preset instead of its profile (uncalibrated)."""
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, profile_path=""))


def tier_mixes(L: int) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """kind -> (tiers of boundaries 0..L, kept blocks)."""
    mixed = ["hbm", "recompute", "dram", "nvme", "recompute", "hbm"]
    return {
        "all-recompute": (("hbm",) + ("recompute",) * (L - 1) + ("hbm",), ()),
        "recompute-heavy": (tuple("hbm" if i % 3 == 0 else "recompute" for i in range(L))
                            + ("hbm",), ()),
        "mixed tiers": (tuple(mixed[i % 6] for i in range(L)) + ("hbm",), ()),
        "nvme-heavy": (("nvme",) * L + ("hbm",), ()),
        "dram-offload-heavy": (("dram",) * L + ("hbm",), ()),
        "all-hbm keep": (("hbm",) * (L + 1), tuple(range(L))),
    }


def plans(cfg) -> tuple[dict, object]:
    """(kind -> Plan of each tier mix on `cfg`'s problem, the problem)."""
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord

    problem = problem_from_config(cfg)
    return {name: build_plan(problem, decisions_from_tiers(problem, tiers, keep),
                             solver=SolveRecord(backend="manual"))
            for name, (tiers, keep) in tier_mixes(problem.num_blocks).items()}, problem


def batches(vocab: int, *, batch: int, seq: int, n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(),
                    "attention_mask": torch.ones_like(ids)})
    return out


def make_engine(adapter, plan, nvme_dir: Path, *, fault_hook=None, instrument: bool = True,
                budgets: bool = True):
    """The engine as the trainer builds it (instrumented, budgets on) unless told otherwise."""
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.build import make_engine

    store = ActivationStore(device=torch.device("cpu"), nvme_dir=nvme_dir, fault_hook=fault_hook,
                            hbm_limits={w.name: w.hbm_checkpoint_bytes for w in plan.windows})
    return make_engine(adapter, plan, device="cpu", compute_dtype="fp32",
                       lr=1e-5, clip_grad_norm=1.0, store=store, instrument=instrument,
                       budgets=budgets, model_config_sha256=plan.provenance["model_config_sha256"])


def measure_steps(engine, data: list[dict], *, warmup: int) -> list[float]:
    """Step times (ms) after `warmup` steps."""
    times = []
    for n, b in enumerate(data):
        stats = engine.step([b])
        if n >= warmup:
            times.append(stats.step_s * 1e3)
    return times


def run_plan(adapter, plan, nvme_dir: Path, data: list[dict], *, warmup: int) -> float:
    """Median measured step time of `plan`, ms."""
    engine = make_engine(adapter, plan, nvme_dir)
    try:
        return statistics.median(measure_steps(engine, data, warmup=warmup))
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="work dir (default: temp under cwd)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir or Path.cwd(), prefix="predict-") as tmp:
        root = Path(tmp)
        cal_cfg, adapter, prof = setup_run(root, layers=args.layers, hidden=args.hidden,
                                           seq=args.seq, batch=args.batch, quick=True)
        profile_s = prof["measurements"]["profile_s"]
        keys = ("block_kinds", "ends", "bandwidths", "host", "step_const_ms",
                "window_overhead_ms")
        print(f"quick profile ({profile_s:.1f} s): "
              f"{json.dumps({k: prof.get(k) for k in keys})}")
        uncal, cal = plans(without_profile(cal_cfg))[0], plans(cal_cfg)[0]
        data = batches(adapter.config.vocab_size, batch=args.batch, seq=args.seq,
                       n=args.steps + args.warmup)
        rows = [f"{'plan kind':<20}{'h/d/n/r':>9}{'uncal pred':>11}{'meas':>8}{'err':>8}"
                f"{'cal pred':>10}{'meas':>8}{'err':>8}"]
        for name in uncal:
            cells = []
            for plan in (uncal[name], cal[name]):
                meas = run_plan(adapter, plan, root / "nvme", data, warmup=args.warmup)
                pred = plan.predicted.step_ms
                cells.append(f"{pred:>10.1f}{meas:>8.1f}{(pred - meas) / meas:>+8.1%}")
            c = [cal[name].tiers.count(k) for k in ("hbm", "dram", "nvme", "recompute")]
            rows.append(f"{name:<20}{'/'.join(map(str, c)):>9} {cells[0]} {cells[1]}")
        print(f"{args.layers} blocks, hidden {args.hidden}, seq {args.seq} x batch {args.batch}, "
              f"fp32, {args.threads} torch thread(s), median of {args.steps} steps after "
              f"{args.warmup} warm-up; each plan kind planned uncalibrated (cpu preset) and "
              f"calibrated (quick profile), each plan run on the engine (ms per step)")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
