"""The engine's fixed costs per window and per step, measured on trivially small twins.

Owns the twins (2- and 4-block, hidden-64 random-init copies of the run's architecture, their
all-HBM plans) and the fit R(L) = a + (2L + 3) o of their residuals (engine step minus the
same windows' compute timed alone by `profile.bench_blocks.BlockBench`). `measure_profile` writes
o as the profile's `window_overhead_ms` and adds a to `step_const_ms`.

The twins' plans are assembled with `planner.evaluate.build_plan` (never the solver).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from lazytrain.models.adapter import ModelAdapter
from lazytrain.models.cut import cut_config
from lazytrain.models.hf_loader import load_adapter_from_config
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.profile.bench_blocks import BlockBench, block_kind_times, sample_batch, time_ms
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine_config import COMPUTE_DTYPES

TWIN_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
"""The trivially small twins of the run's model on which the engine's overheads are measured:
the run's architecture (config class, block kind) at hidden 64."""
TWIN_BLOCKS = (2, 4)
"""Block counts of the two twins: their difference in windows per step (2L + 3) separates the
per-window cost from the per-step one."""
TWIN_TOKENS = (1, 16)
"""(micro_batch, seq_len) of the twins' runs: tiny, so their windows are mostly overhead."""


def twin_adapter(adapter: ModelAdapter, *, blocks: int = 2) -> ModelAdapter:
    """A random-init `blocks`-block, hidden-64 model of the run's family (`TWIN_SHAPE`): the
    first layers' kinds (`models.cut.cut_config`; a model already cut to fewer layers repeats
    its kinds).

    Raises:
        ValueError: the family's config does not take the twin's shape (named).
    """
    cfg = cut_config(adapter.config, range(blocks), overrides=TWIN_SHAPE)
    master = adapter.params.blocks[0].master.dtype
    try:
        return load_adapter_from_config(cfg, master_dtype="bf16" if master == torch.bfloat16
                                        else "fp32", seed=0)
    except Exception as exc:  # noqa: BLE001 - any family-specific refusal, reported as one line
        raise ValueError(f"window overhead: a {blocks}-block twin of {type(cfg).__name__} "
                         f"could not be built ({exc})") from exc


def _twin_plan(adapter: ModelAdapter, *, micro_batch: int, seq_len: int, compute_dtype: str):
    """An all-HBM Plan for `adapter` (no keep, no transfers), as `lazytrain plan` writes them."""
    L = adapter.num_blocks
    P = adapter.params.max_block_numel() * torch.empty((), dtype=COMPUTE_DTYPES[compute_dtype]
                                                       ).element_size()
    A = micro_batch * seq_len * adapter.config.hidden_size * 4
    problem = PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.0,) * L, bwd_ms=(1.0,) * L, weight_bytes=(P,) * L,
        grad_bytes=(P,) * L, internal_bytes=(0,) * L, boundary_bytes=(A,) * (L + 1),
        params_per_block=(P,) * L, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
        duplex_bytes_per_s=1e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
        hbm_bytes=10**12, dram_bytes=10**12,
        provenance={"model": "twin", "model_config_sha256": adapter.hf_config_sha256,
                    "seq_len": seq_len, "micro_batch": micro_batch, "grad_accum": 1,
                    "dtype": compute_dtype})
    tiers = ("hbm",) * (L + 1)
    return build_plan(problem, decisions_from_tiers(problem, tiers),
                      solver=SolveRecord(backend="manual"))


def twin_residual_ms(twin: ModelAdapter, *, compute_dtype: str, device: torch.device,
                     nvme_dir: Path | str, io_threads: int = 2, steps: int = 5,
                     warmup: int = 2) -> dict[str, float]:
    """A twin's engine step minus its compute timed alone, ms (medians over `steps` steps).

    `Engine.step` with an all-HBM plan and the trainer's flags (instrumented, budgets on,
    gradient clipping), against embed + head + L (F + Fg + B) from `BlockBench` (the same
    functions, the same compute scope): the remainder is what the engine costs besides its
    work.

    Returns:
        {"step_ms", "compute_ms", "residual_ms", "windows" (2L + 3)}.
    """
    mb, seq = TWIN_TOKENS
    plan = _twin_plan(twin, micro_batch=mb, seq_len=seq, compute_dtype=compute_dtype)
    bench = BlockBench(twin, micro_batch=mb, seq_len=seq, dtype=compute_dtype, device=device)
    batch = sample_batch(twin.config.vocab_size, micro_batch=mb, seq_len=seq, device="cpu")
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    engine = make_engine(twin, plan, device=device.type, nvme_dir=nvme_dir,
                         compute_dtype=compute_dtype, io_threads=io_threads, instrument=True,
                         budgets=True, clip_grad_norm=1.0,
                         model_config_sha256=twin.hf_config_sha256)
    walls = []
    try:
        for n in range(warmup + max(1, steps)):
            stats = engine.step([batch])
            if n >= warmup:
                walls.append(stats.step_s * 1e3)
    finally:
        engine.close()
    t = block_kind_times(bench, ["twin"], repeats=steps, warmup=warmup)["twin"]
    compute = (time_ms(bench.embed, device=device, repeats=steps, warmup=warmup)
               + time_ms(bench.head, device=device, repeats=steps, warmup=warmup)
               + twin.num_blocks * (t["fwd_ms"] + t["fwd_grad_ms"] + t["bwd_ms"]))
    step = statistics.median(walls)
    return {"step_ms": step, "compute_ms": compute, "residual_ms": step - compute,
            "windows": 2 * twin.num_blocks + 3}


def window_overhead_ms(adapter: ModelAdapter, *, compute_dtype: str, device: torch.device,
                       nvme_dir: Path | str, io_threads: int = 2, steps: int = 5,
                       warmup: int = 2) -> dict:
    """The engine's fixed cost per window and per step, ms, from two trivially small twins.

    The residual of a twin (`twin_residual_ms`) is R(L) = a + (2L + 3) o: o per window (the
    meter, the ledger, the store's barrier, the instrument's records, the worker hand-offs)
    and a per step (loading the ends, the gradient norm, the step's records). The twins of
    `TWIN_BLOCKS` blocks give o = (R(4) - R(2)) / 4 and a = R(2) - 7 o, each clamped at 0.

    Returns:
        {"window_overhead_ms": o, "step_overhead_ms": a, "twins": {"L": twin_residual_ms}}.

    Raises:
        ValueError: the family has no twin (`twin_adapter`).
    """
    twins = {}
    for blocks in TWIN_BLOCKS:
        twins[blocks] = twin_residual_ms(
            twin_adapter(adapter, blocks=blocks), compute_dtype=compute_dtype, device=device,
            nvme_dir=Path(nvme_dir) / f"twin{blocks}", io_threads=io_threads, steps=steps,
            warmup=warmup)
    o, a = fit_overheads({b: t["residual_ms"] for b, t in twins.items()})
    return {"window_overhead_ms": o, "step_overhead_ms": a,
            "twins": {str(b): t for b, t in twins.items()}}  # JSON object keys


def fit_overheads(residual_ms: dict[int, float]) -> tuple[float, float]:
    """(o, a) of R(L) = a + (2L + 3) o through two (blocks, residual ms) points, both >= 0.

    o is the slope, clamped to [0, R(L1) / (2 L1 + 3)]: the upper end is the largest o for
    which the smaller twin's a is not negative (a slope past it means the bigger twin's
    residual was disturbed, and would charge the disturbance to every window); a is then
    R(L1) - (2 L1 + 3) o.

    Raises:
        ValueError: not exactly two distinct block counts.
    """
    if len(residual_ms) != 2:
        raise ValueError(f"fit_overheads needs two twins; got {sorted(residual_ms)}")
    (l1, r1), (l2, r2) = sorted(residual_ms.items())
    w1 = 2 * l1 + 3
    o = min(max(0.0, (r2 - r1) / (2 * (l2 - l1))), max(0.0, r1) / w1)
    return o, max(0.0, r1 - w1 * o)
