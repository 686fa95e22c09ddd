"""GPU validation of LazyTrain's CUDA path: is it correct, is it overlapped, what MFU, and does
the plan predict it? One call, under 5 minutes on an H200, one JSON.

Run (no install; PYTHONPATH=src, or the script finds src/ itself):

    PYTHONPATH=src python benchmarks/gpu_validate.py --out gpu_validate.json
    PYTHONPATH=src python benchmarks/gpu_validate.py --quick --only ordering,gradients

stdout gets one JSON line: {"out", "ok", "correct", "overlapped", "mfu"} (`answers`); the file
--out holds it as "answers" beside every section's figures.

- **correct?** ordering, gradients and trainer all pass (`CORRECT_SECTIONS`);
- **overlapped?** the mfu run's plan windows (else the overlap section's): compute busy, copy
  busy, exposed ms split by cause (each copy stream, and "host": the GPU idle with no copy
  running, i.e. waiting on the host); yes when exposed <= OVERLAPPED_EXPOSED_MAX of the span;
- **what MFU, and does the plan predict it?** the mfu section: model TFLOPS against the H200's
  989.4 dense BF16 TFLOPS and against the measured GEMM peak, the plan's predicted step and
  per-window times beside the measured ones (`PREDICTS_WITHIN`).

Sections (each a function below; each writes its figures and `ok` into the JSON):
- environment: versions, device, CPU threads, locked-memory limit, MemAvailable, cgroup
  memory.max, solver packages, and whether the planner imports without loading one;
- ceilings: pinned H2D / D2H / duplex GB/s at block and boundary sizes, alone and under a
  running bf16 GEMM; the bf16 GEMM peak; host fp32 -> bf16 conversion and fp32 accumulation
  GB/s (the engine's two host loops); `cudaHostAlloc` seconds per GiB;
- ordering: `torch.cuda._sleep` stretches the producer stream so the consumer lags the host;
  one micro-test per ordering rule through `CudaDevice`, each run as the runtime orders it
  (must give exact data) and without the rule (shows whether the stress exposes the race);
  then whole-engine stress: sleeps injected on the compute stream before every window, or on
  the copy stream before every copy (by wrapping the engine's `_timed_window` and the device's
  `copy` here, never in product code); gradients must equal the unstressed run's;
- gradients: a mid-size Llama (hidden 1024, 4-6 layers, seq 1024, random init) under a plan
  matrix (all hbm, all dram, nvme in a temp dir, recompute segments, keep-internals, mixed,
  save levels L1/L2 with internals in HBM and DRAM: `levels_plan_of`)
  with grad_accum 2: fp32 engine vs plain HF autograd on the GPU; bf16 engine error vs the
  fp32 reference within 1.5x HF's own bf16 error; 3 AdamW steps vs torch.optim.AdamW; every
  fp32 plan run twice (a race shows as drift between runs);
- trainer: the Trainer path (`train.loop.train`: instrumented, budget-checked engine, grad
  clipping, checkpoints) on CUDA with the tiny Llama: 4 steps straight; 2 steps resumed to 4
  (same weights); an NVMe plan whose write fails in step 2 (the step fails, the step-1
  checkpoint stays) resumed to 4 steps;
- mfu: Llama-3-8B widths cut to 8 layers (`MFU_SHAPE`), seq 8192, bf16 compute, fp32 masters,
  AdamW with clipping; block, embed and head times measured on this GPU, host conversion and
  accumulation rates measured on the runtime's own worker threads
  (`profile.bench_rates.host_rates`), link rates from the ceilings; all fed into the planner
  (`planner.policy.plan`, policy milp: the heuristic when no solver is installed); one warm-up
  and MFU_STEADY_STEPS timed steps, then one profiled step for the per-window figures;
- overlap: hidden 4096, 6-8 layers, seq 4096, bf16, micro-batch 1, a plan with dram tiers,
  recompute and keep built from measured block costs and link rates; per window from a
  `torch.profiler` trace: compute-busy ms, copy-busy ms per stream, overlapped fraction,
  exposed ms by cause, against the plan's predicted window; model TFLOPS vs the measured GEMM
  peak; `torch.cuda.max_memory_allocated` vs the plan's predicted peak HBM. Only with
  `--only overlap` (`DEFAULT_SECTIONS`): the mfu run answers the same question at 8B widths,
  and both together do not fit 5 minutes.

Hand-built plans come from `lazytrain.planner.evaluate` (`decisions_from_tiers` + `build_plan`);
the mfu plan from the planner itself, which needs no MILP solver either (the validation machine
may have neither HiGHS nor SCIP).
Imports only torch, transformers, the standard library and lazytrain; installs nothing.

A global time budget (`--budget-s`, default 270 s) keeps the run under 5 minutes on an H200:
a section that cannot start in the time left is recorded as skipped (a failure), and a
watchdog writes the JSON and exits if a section hangs. Every section catches its own errors;
the JSON is rewritten (atomically) after each one. Exit code: 0 every selected section passed;
1 a section failed, was skipped, or no CUDA device is present (the environment section is
still written); 2 bad usage; 3 the watchdog stopped a hung section (the JSON names it). On a
CPU-only machine `--help` works and a run writes the environment section and exits 1 with a
one-line reason.

The overlap section also reports the device API ledger's HBM peak against the allocator's, the
heuristic planner's pick for the measured problem, and totals over the windows; the fp32
matrix also runs the mixed plan with attention dropout (RNG replay in recompute).

One file on purpose (one command to copy onto a GPU machine, longer than the style guide's
400 lines for that reason); sections are independent functions.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import platform
import resource
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
try:
    import lazytrain  # noqa: F401
except ImportError:  # run from a checkout without PYTHONPATH=src
    sys.path.insert(0, str(ROOT / "src"))
    import lazytrain  # noqa: F401

from lazytrain.units import GB  # noqa: E402

GIB = 2**30
SECTION_ORDER = ("environment", "ceilings", "ordering", "gradients", "trainer", "mfu", "overlap")
DEFAULT_SECTIONS = SECTION_ORDER[:-1]
"""What a plain call runs: everything but overlap, whose hand-made plan at a 7B-like shape the
mfu run's planned windows answer "overlapped?" for (`--only overlap` runs it)."""
MIN_START_S = {"environment": 0, "ceilings": 15, "ordering": 15, "gradients": 25, "trainer": 20,
               "mfu": 60, "overlap": 40}
"""Seconds of budget a section needs to start (full run); --quick halves them."""
WATCHDOG_GRACE_S = 20
"""Seconds past the budget before the watchdog writes the JSON and exits (a hung section)."""

FP32_GRAD_TOL = 1e-4
"""fp32 engine vs HF autograd on the GPU: max |diff| / max |reference grad| (cuBLAS and SDPA
pick the same kernels for both; chunked loss and host accumulation change the summation order,
~1e-6 in practice; a stale or overwritten buffer gives O(1))."""
DRIFT_TOL = 1e-6
"""Two identical fp32 runs: max |diff| / max |grad| (deterministic algorithms on; a race gives
O(1); the bound is relaxed to 4x HF's own run-to-run drift if HF drifts more)."""
BF16_RATIO_TOL = 1.5
"""bf16 engine error vs the fp32 reference <= this x HF's own bf16 error (relative L2)."""
ADAM_EPS = 1e-6
"""AdamW eps of the 3-step comparison. Adam divides by sqrt(v) + eps, so near-zero gradients
amplify fp32 noise by up to 1/eps; 1e-6 bounds that at ~0.1 lr per step for 1e-7 noise."""
ADAM_TOL = 1e-2
"""3 AdamW steps: ||p_engine - p_torch|| / ||p_torch - p_initial|| (global L2)."""
STRESS_TOL = 1e-6
"""Whole-engine stress: max |stressed - unstressed| / max |grad| (same order of operations)."""

GRAD_SHAPE = dict(hidden=1024, layers=6, seq=1024, intermediate=2816, heads=16, kv_heads=8,
                  batch=2)
"""The gradient section's Llama (--quick: 4 layers, micro-batch 1)."""
STRESS_SHAPE = dict(hidden=1024, layers=4, seq=512, intermediate=2816, heads=16, kv_heads=8,
                    batch=2)
"""The whole-engine stress model of the ordering section."""
OVERLAP_SHAPE = dict(hidden=4096, layers=8, seq=4096, intermediate=11008, heads=32, kv_heads=8,
                     batch=1)
"""The overlap section's shape, Llama-7B-like widths with GQA (--quick: 6 layers); it also sizes
the ceilings' block and boundary copies."""
REF_DEVICE = "cuda"
"""Where the HF reference runs."""


# ---------------------------------------------------------------------------------------------
# Runner: budget, JSON, watchdog


class Budget:
    """Seconds left of the global time budget."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@dataclasses.dataclass
class Ctx:
    """What every section gets: options, the device API, a temp dir, figures shared between
    sections (GEMM peak, link rates) and the budget."""

    args: argparse.Namespace
    budget: Budget
    tmp: Path
    dev: object = None
    shared: dict = dataclasses.field(default_factory=dict)

    @property
    def quick(self) -> bool:
        return self.args.quick


def log(msg: str) -> None:
    print(f"[gpu_validate] {msg}", file=sys.stderr, flush=True)


def write_json(path: Path, data: dict) -> None:
    """Atomic write: temp file in the same directory, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str, allow_nan=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run_section(name: str, fn, ctx: Ctx) -> dict:
    """Run one section; its exception becomes a failed result (with the traceback)."""
    t0 = time.perf_counter()
    try:
        out = fn(ctx)
        out.setdefault("ok", True)
        out["status"] = "pass" if out["ok"] else "fail"
    except Exception as exc:  # every section reports; the script goes on to the next one
        out = {"ok": False, "status": "error", "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()}
    finally:
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def start_watchdog(ctx: Ctx, results: dict, out: Path) -> threading.Timer:
    """After budget + grace: mark the running section timed out, write the JSON, exit 3."""
    def fire() -> None:
        running = results.get("running")
        if running:
            results["sections"][running] = {
                "ok": False, "status": "timeout",
                "error": f"still running after {ctx.budget.elapsed():.0f} s"}
        results["ok"] = False
        results["error"] = f"watchdog: time budget exceeded in section {running}"
        with contextlib.suppress(Exception):
            write_json(out, results)
        log(results["error"])
        os._exit(3)
    timer = threading.Timer(ctx.args.budget_s + WATCHDOG_GRACE_S, fire)
    timer.daemon = True
    timer.start()
    return timer


# ---------------------------------------------------------------------------------------------
# Shared builders


def llama_config(*, hidden: int, layers: int, seq: int, intermediate: int, heads: int,
                 kv_heads: int, vocab: int = 32000, dropout: float = 0.0, batch: int = 1):
    """A random-init Llama config (no downloads); `batch` is accepted and ignored so a shape
    dict can be passed whole."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=seq,
                       attention_dropout=dropout, pad_token_id=0, tie_word_embeddings=False)


def model_pair(config, *, seed: int):
    """(HF reference on the GPU, adapter) with identical fp32 weights (a copied state_dict)."""
    from transformers import AutoModelForCausalLM
    from lazytrain.models import adapter_from_model
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.train()
    return ref.to(REF_DEVICE), adapter_from_model(twin)


def make_batches(n: int, *, batch: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """n micro-batches [batch, seq] on the host; labels ignore a 16-token prompt, the last row
    is right-padded by a quarter with an attention mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, :16] = -100
        mask = torch.ones(batch, seq, dtype=torch.long)
        pad = seq // 4
        ids[-1, -pad:], labels[-1, -pad:], mask[-1, -pad:] = 0, -100, 0
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def hf_grads(ref, batches: list[dict]) -> dict[str, torch.Tensor]:
    """Plain HF autograd over the micro-batches (loss normalised by all label tokens), as fp32
    host tensors."""
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    ref.zero_grad(set_to_none=True)
    for b in batches:
        out = ref(**{k: v.to(REF_DEVICE) for k, v in b.items()}, use_cache=False,
                  num_items_in_batch=torch.tensor(n, device=REF_DEVICE))
        out.loss.backward()
    return {name: p.grad.float().cpu() for name, p in ref.named_parameters()}


def hand_problem(adapter, *, batch: int, seq: int, act_bytes: int, grad_accum: int):
    """A planning problem whose boundary bytes are the real tensors' and whose provenance
    matches the adapter and the batch shape (costs are placeholders: only the plan's structure
    matters for a correctness run)."""
    from lazytrain.planner.problem import PlanningProblem
    L = adapter.num_blocks
    A = batch * seq * adapter.config.hidden_size * act_bytes
    P = adapter.params.blocks[0].numel * 4
    return PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L, weight_bytes=(P,) * L,
        grad_bytes=(P,) * L, internal_bytes=(8 * A,) * L, boundary_bytes=(A,) * (L + 1),
        params_per_block=(P // 4,) * L, h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10,
        duplex_bytes_per_s=3e10, nvme_read_bytes_per_s=2e9, nvme_write_bytes_per_s=2e9,
        hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12, grad_accum=grad_accum,
        provenance={"model": "gpu-validate", "model_config_sha256": adapter.hf_config_sha256,
                    "seq_len": seq, "micro_batch": batch, "grad_accum": grad_accum})


def plan_of(problem, tiers, keep=()):
    """A validated Plan for `tiers` (len L+1) with a legal transfer schedule (no solver)."""
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep))
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


def levels_plan_of(problem, L: int):
    """The gradient matrix's save-levels plan: boundaries recomputed in segments of 2, blocks
    at L2 / L1 alternately with their internals in DRAM (d2h whole in f{j+1}, h2d whole in
    b{j+1}) or HBM, the last block in HBM (no legal DRAM pair). The problem's saved bytes are
    placeholders (only the plan's structure matters for a correctness run)."""
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.heuristics import megatrain_tiers
    from lazytrain.planner.plan import InternalTransfer, SolveRecord
    A = problem.boundary_bytes[0]
    problem = dataclasses.replace(problem, saved_bytes=((4 * A, 8 * A),) * L,
                                  reforward_ms=(1.0,) * L, reforward_l1_ms=(0.6,) * L)
    levels = tuple(("L2", "L1")[j % 2] for j in range(L))
    saved_tiers = tuple(("dram", "dram", "hbm")[j % 3] for j in range(L - 1)) + ("hbm",)
    d = decisions_from_tiers(problem, tuple(megatrain_tiers(L, 2)), save_levels=levels,
                             saved_tiers=("hbm",) * L)
    moves = tuple(InternalTransfer(block=j, kind=kind, window=f"{w}{j + 1}", fraction=1.0)
                  for j in range(L - 1) if saved_tiers[j] == "dram"
                  for kind, w in (("d2h", "f"), ("h2d", "b")))
    d = dataclasses.replace(d, saved_tiers=saved_tiers, internal_transfers=moves)
    return build_plan(problem, d, solver=SolveRecord(backend="manual"))


def plan_matrix(L: int) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """name -> (tiers, keep_internals) of the gradient matrix for L blocks."""
    from lazytrain.planner.heuristics import megatrain_tiers
    H, D, N, R = "hbm", "dram", "nvme", "recompute"
    mixed = [R] + [(D, N, H, R)[(i - 1) % 4] for i in range(1, L)] + [H]
    keep_mixed = tuple(j for j in range(L) if mixed[j + 1] == H)
    return {"all_hbm": ([H] * (L + 1), ()), "all_dram": ([D] * L + [H], ()),
            "nvme": ([N] * L + [H], ()), "recompute": (list(megatrain_tiers(L, 2)), ()),
            "keep": ([D] * L + [H], (L - 2, L - 1)), "mixed": (mixed, keep_mixed),
            "levels": (list(megatrain_tiers(L, 2)), ())}  # save levels: `levels_plan_of`


def grad_error(mine: dict, ref: dict) -> dict:
    """max |diff| / max |ref| and relative L2 over all parameters, plus the worst tensor."""
    scale = max(float(r.abs().max()) for r in ref.values())
    worst, worst_name, num, den = 0.0, None, 0.0, 0.0
    for name, r in ref.items():
        d = mine[name].float() - r
        m = float(d.abs().max())
        if m > worst:
            worst, worst_name = m, name
        num += float(d.double().pow(2).sum())
        den += float(r.double().pow(2).sum())
    return {"max_rel": worst / scale if scale else math.inf, "l2_rel": math.sqrt(num / den)
            if den else math.inf, "worst": worst_name, "scale": scale,
            "bitwise": all(torch.equal(mine[n].float(), r) for n, r in ref.items())}


def engine_grads(adapter, plan, ctx: Ctx, batches, *, dtype: str = "fp32", grad_accum: int = 2,
                 wrap=None) -> dict[str, torch.Tensor]:
    """The engine's accumulated gradients (fp32 host copies) for one compute_gradients call.
    `wrap(engine)` may instrument the engine before the run (stress modes) and returns the
    function that undoes it."""
    from lazytrain.runtime.build import make_engine
    engine = make_engine(adapter, plan, device=ctx.dev, nvme_dir=ctx.tmp / "nvme",
                         compute_dtype=dtype, grad_accum=grad_accum, seed=0)
    undo = wrap(engine) if wrap is not None else None
    try:
        engine.compute_gradients(batches)
        return {k: v.float().clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
        if undo is not None:
            undo()


def cuda_ms(dev, fn, *, repeats: int, warmup: int = 1) -> float:
    """Mean ms of fn() on the compute stream (timing events through the device API)."""
    with dev.compute_scope():
        for _ in range(warmup):
            fn()
        start = dev.timing_event()
        for _ in range(repeats):
            fn()
        return dev.elapsed_ms(start, dev.timing_event()) / repeats


# ---------------------------------------------------------------------------------------------
# Sections


def environment(ctx: Ctx) -> dict:
    """Versions, device, threads, memory limits, solver packages, solver-free planner import."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = lambda v: "unlimited" if v == resource.RLIM_INFINITY else v  # noqa: E731
    out = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "transformers": transformers.__version__, "lazytrain": lazytrain.__version__,
           "cuda_available": torch.cuda.is_available(),
           "intra_op_threads": torch.get_num_threads(),
           "inter_op_threads": torch.get_num_interop_threads(), "cpu_count": os.cpu_count(),
           "cpus_usable": len(os.sched_getaffinity(0)),
           "memlock_limit_bytes": {"soft": lim(soft), "hard": lim(hard)},
           "mem_available_bytes": _meminfo("MemAvailable"), "cgroup_memory_max": _cgroup_max(),
           "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS",
                                                  "PYTORCH_CUDA_ALLOC_CONF",
                                                  "CUDA_VISIBLE_DEVICES")},
           "packages": {m: importlib.util.find_spec(m) is not None
                        for m in ("highspy", "pyscipopt", "bitsandbytes", "safetensors")}}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                         "total_memory_bytes": p.total_memory,
                         "multiprocessors": p.multi_processor_count,
                         "count": torch.cuda.device_count(),
                         "cudnn": torch.backends.cudnn.version()}
    for module in ("lazytrain.planner.heuristics", "lazytrain.planner.policy"):
        importlib.import_module(module)
    # the policy module imports the solver adapters, which load a solver package only when
    # they solve: without one the planner plans by the heuristic (planner/policy.py)
    solvers = [m for m in ("highspy", "pyscipopt") if m in sys.modules]
    out["planner_without_solver"] = {"heuristics_and_policy_import": True,
                                     "solver_modules_loaded": solvers}
    out["ok"] = not solvers
    return out


def _meminfo(key: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_max() -> int | str | None:
    """cgroup v2 memory.max (or v1 limit_in_bytes): bytes, "max", or None when absent."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError):
            text = Path(path).read_text().strip()
            return text if text == "max" else int(text)
    return None


def overlap_shape(quick: bool) -> dict:
    """OVERLAP_SHAPE, with 6 layers under --quick."""
    return {**OVERLAP_SHAPE, "layers": 6 if quick else OVERLAP_SHAPE["layers"]}


def block_weight_bytes(s: dict) -> int:
    """bf16 bytes of one Llama block of shape `s` (q, k, v, o, gate/up/down, two norms)."""
    H, I, hd = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    return 2 * (2 * H * H + 2 * H * s["kv_heads"] * hd + 3 * H * I + 2 * H)


def gemm_tflops(dev, n: int, iters: int) -> float:
    """bf16 [n, n] @ [n, n] TFLOPS on the compute stream."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(dev, lambda: a @ b, repeats=iters, warmup=3)
    return 2 * n**3 / (ms / 1e3) / 1e12


def copy_gbps(dev, nbytes: int, *, repeats: int, gemm_n: int | None = None) -> dict:
    """H2D, D2H and duplex GB/s of pinned `nbytes` copies on two copy streams (host wall clock
    around host-synchronised copies); with `gemm_n`, a bf16 GEMM burst runs on the compute
    stream throughout, and its TFLOPS while the copies run are reported too."""
    host_src, host_dst = dev.pinned_empty(nbytes), dev.pinned_empty(nbytes)
    host_src.fill_(1)
    d_dst, d_src = dev.empty(nbytes, torch.uint8), dev.empty(nbytes, torch.uint8).fill_(1)
    s_h2d, s_d2h = dev.stream("validate_h2d"), dev.stream("validate_d2h")
    a = b = None
    if gemm_n:
        a = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)
    dev.synchronize()
    out = {}
    for kind in ("h2d", "d2h", "duplex"):
        legs = ([(d_dst, host_src, s_h2d)] * (kind != "d2h")
                + [(host_dst, d_src, s_d2h)] * (kind != "h2d"))
        for dst, src, s in legs:  # warm-up
            dev.host_wait(dev.copy(dst, src, stream=s))
        gemm_start = gemm_end = None
        with dev.compute_scope():
            if gemm_n:  # enough GEMMs to outlast the copies (~2 ms each at 8192 on an H200)
                gemm_start = dev.timing_event()
                for _ in range(max(20, repeats * nbytes // (1 << 25))):
                    a @ b
                gemm_end = dev.timing_event()
            t0 = time.perf_counter()
            events = [dev.copy(dst, src, stream=s) for _ in range(repeats) for dst, src, s in legs]
            for e in events:
                dev.host_wait(e)
            secs = time.perf_counter() - t0
        out[f"{kind}_gb_per_s"] = len(legs) * repeats * nbytes / secs / GB
        if gemm_n:
            gemm_ms = dev.elapsed_ms(gemm_start, gemm_end)
            count = max(20, repeats * nbytes // (1 << 25))
            out[f"gemm_tflops_during_{kind}"] = 2 * gemm_n**3 * count / (gemm_ms / 1e3) / 1e12
            out[f"gemm_outlasted_{kind}"] = gemm_ms / 1e3 >= secs
    return out


def host_loops_gbps(numel: int, dev, *, repeats: int) -> dict:
    """The engine's host loops: fp32 master -> bf16 pinned staging (`DeviceWeights.load`) and
    fp32 gradient accumulation from a pinned buffer (`ParamGroup.accumulate_grad`), GB/s of fp32
    bytes read, with torch's current intra-op threads."""
    master = torch.full((numel,), 1.2345, dtype=torch.float32)
    staging = dev.pinned_empty(numel * 2).view(torch.bfloat16)
    landing = dev.pinned_empty(numel * 4).view(torch.float32).fill_(0.5)
    acc = torch.zeros(numel, dtype=torch.float32)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return numel * 4 / min(times) / GB
    return {"fp32_to_bf16_gb_per_s": best(lambda: staging.copy_(master)),
            "fp32_accumulate_gb_per_s": best(lambda: acc.add_(landing)),
            "numel": numel, "threads": torch.get_num_threads()}


def host_alloc_s_per_gib(dev, gibs: tuple[int, ...]) -> dict:
    """Seconds per GiB of fresh pinned allocations: torch's host allocator (cudaHostAlloc;
    sizes are powers of two and held until the end, so none is served from its cache) and the
    device API's `pinned_empty` (the runtime's own path), with whether it page-locked the
    memory."""
    held, out = [], {"cuda_host_alloc": {}, "device_api_pinned_empty": {}}
    for g in gibs:
        t0 = time.perf_counter()
        held.append(torch.empty(g * GIB, dtype=torch.uint8, pin_memory=True))
        out["cuda_host_alloc"][f"{g}_gib_s_per_gib"] = (time.perf_counter() - t0) / g
    for g in gibs:
        t0 = time.perf_counter()
        t = dev.pinned_empty(g * GIB, name="gpu_validate pinned timing")
        out["device_api_pinned_empty"][f"{g}_gib_s_per_gib"] = (time.perf_counter() - t0) / g
        out["device_api_pinned_empty"]["is_pinned"] = bool(t.is_pinned())
        held.append(t)
    del held
    return out


def ceilings(ctx: Ctx) -> dict:
    """Link, GEMM and host-loop ceilings (the numbers the planner's cost model needs)."""
    dev, q = ctx.dev, ctx.quick
    # first, before any pinned buffer exists that torch's host allocator could hand back
    pinned_alloc = host_alloc_s_per_gib(dev, (1,) if q else (1, 2))
    shape = overlap_shape(q)
    sizes = {"boundary": shape["batch"] * shape["seq"] * shape["hidden"] * 2,
             "block": block_weight_bytes(shape)}
    peak = max(gemm_tflops(dev, n, 10 if q else 30) for n in ((8192,) if q else (4096, 8192)))
    ctx.shared["gemm_peak_tflops"] = peak
    out = {"bf16_gemm_peak_tflops": peak, "copy_bytes": sizes, "copies": {}}
    reps = {"boundary": 8 if q else 20, "block": 3 if q else 6}
    for name, nbytes in sizes.items():
        out["copies"][name] = {"alone": copy_gbps(dev, nbytes, repeats=reps[name]),
                               "under_gemm": copy_gbps(dev, nbytes, repeats=reps[name],
                                                       gemm_n=8192)}
    ctx.shared["copy_gbps"] = out["copies"]["block"]["alone"]
    out["host_loops"] = host_loops_gbps(sizes["block"] // 2 // (4 if q else 1), dev,
                                        repeats=2 if q else 3)
    out["pinned_alloc"] = pinned_alloc
    from lazytrain.spec.hardware import get_hardware
    hw = get_hardware("h200")
    out["preset_h200"] = {"h2d_gb_per_s": hw.h2d_bytes_per_s / GB,
                          "d2h_gb_per_s": hw.d2h_bytes_per_s / GB,
                          "duplex_gb_per_s": hw.duplex_bytes_per_s / GB}
    alone = out["copies"]["block"]["alone"]
    out["checks"] = {"links_over_1_gb_per_s": min(alone.values()) > 1.0,
                     "gemm_over_10_tflops": peak > 10.0,
                     # unpinned buffers would make every runtime copy synchronous
                     "device_api_buffers_pinned": pinned_alloc["device_api_pinned_empty"]
                     ["is_pinned"]}
    out["ok"] = all(out["checks"].values())
    return out


# --- ordering ---------------------------------------------------------------------------------


def sleep_cycles_per_ms(dev) -> float:
    """Clock cycles of `torch.cuda._sleep` per ms on this GPU (measured)."""
    cycles = 20_000_000
    ms = cuda_ms(dev, lambda: torch.cuda._sleep(cycles), repeats=3, warmup=1)
    return cycles / ms


def _on(stream):
    """Make a device API stream current (to queue a `_sleep` on it)."""
    return torch.cuda.stream(stream.raw)


def rule_copy_waits_for_producer(dev, lag: int, ordered: bool, n: int) -> dict:
    """A D2H copy of a tensor the compute stream is still producing waits for that stream."""
    d2h = dev.stream("d2h")
    host = dev.pinned_empty(n * 4).view(torch.float32).fill_(0.0)
    with dev.compute_scope():
        x = dev.empty(n, torch.float32).fill_(1.0)
        torch.cuda._sleep(lag)  # the producer lags the host
        x.fill_(2.0)
        if ordered:
            dev.wait_stream(d2h, dev.compute)
        dev.host_wait(dev.copy(host, x, stream=d2h))
        dev.synchronize()
    return {"exact": bool((host == 2.0).all())}


def rule_alloc_then_copy_stream(dev, lag: int, ordered: bool, n: int) -> dict:
    """A buffer allocated on compute (maybe memory that queued compute work still writes) and
    first written on a copy stream: the copy waits for the compute stream (wait_stream)."""
    h2d = dev.stream("h2d")
    src = dev.pinned_empty(n * 4).view(torch.float32).fill_(3.0)
    with dev.compute_scope():
        old = dev.empty(n, torch.float32)
        torch.cuda._sleep(lag)
        old.fill_(4.0)  # queued, still to run on the memory freed next
        ptr = old.data_ptr()
        del old
        buf = dev.empty(n, torch.float32)
        reused = buf.data_ptr() == ptr
        if ordered:
            dev.wait_stream(h2d, dev.compute)
        dev.wait_event(dev.compute, dev.copy(buf, src, stream=h2d))
        seen = buf.clone()
        dev.synchronize()
    return {"exact": bool((seen == 3.0).all()), "allocator_reused_block": reused}


def rule_record_stream(dev, lag: int, ordered: bool, n: int) -> dict:
    """A device tensor freed on compute while a lagging copy stream still reads it: with
    record_stream the allocator does not hand its memory to the next compute allocation."""
    d2h = dev.stream("d2h")
    host = dev.pinned_empty(n * 4).view(torch.float32).fill_(0.0)
    with dev.compute_scope():
        t = dev.empty(n, torch.float32).fill_(5.0)
        dev.wait_stream(d2h, dev.compute)
        with _on(d2h):
            torch.cuda._sleep(lag)  # the copy stream lags
        event = dev.copy(host, t, stream=d2h)
        if ordered:
            dev.record_stream(t, d2h)
        ptr = t.data_ptr()
        del t
        u = dev.empty(n, torch.float32)
        reused = u.data_ptr() == ptr
        u.fill_(6.0)
        dev.host_wait(event)
        dev.synchronize()
    return {"exact": bool((host == 5.0).all()), "allocator_reused_block": reused}


def rule_host_write_after_h2d(dev, lag: int, ordered: bool, n: int) -> dict:
    """The host rewrites a pinned staging buffer only after its H2D copy completed."""
    h2d = dev.stream("h2d")
    staging = dev.pinned_empty(n * 4).view(torch.float32).fill_(7.0)
    with dev.compute_scope():
        d = dev.empty(n, torch.float32)
        dev.wait_stream(h2d, dev.compute)
        with _on(h2d):
            torch.cuda._sleep(lag)
        event = dev.copy(d, staging, stream=h2d)
        if ordered:
            dev.host_wait(event)
        staging.fill_(8.0)  # the next load's bytes
        dev.wait_event(dev.compute, event)
        seen = d.clone()
        dev.synchronize()
    return {"exact": bool((seen == 7.0).all())}


def rule_host_read_after_d2h(dev, lag: int, ordered: bool, n: int) -> dict:
    """The host reads a D2H destination only after the copy's event completed."""
    d2h = dev.stream("d2h")
    host = dev.pinned_empty(n * 4).view(torch.float32).fill_(0.0)
    with dev.compute_scope():
        x = dev.empty(n, torch.float32)
        torch.cuda._sleep(lag)
        x.fill_(9.0)
        dev.wait_stream(d2h, dev.compute)
        event = dev.copy(host, x, stream=d2h)
        if ordered:
            dev.host_wait(event)
        seen = host.clone()  # the host's read (gradient accumulation)
        dev.synchronize()
    return {"exact": bool((seen == 9.0).all())}


ORDERING_RULES = {"copy_waits_for_producer": rule_copy_waits_for_producer,
                  "alloc_on_compute_then_copy_stream": rule_alloc_then_copy_stream,
                  "record_stream_keeps_memory": rule_record_stream,
                  "host_write_after_h2d_sync": rule_host_write_after_h2d,
                  "host_read_after_d2h_event": rule_host_read_after_d2h}


def stress_compute(cycles: int):
    """Wrap an engine so every window starts with a `_sleep` on the compute stream."""
    def wrap(engine):
        original = engine._timed_window

        @contextlib.contextmanager
        def lagging(name: str):
            torch.cuda._sleep(cycles)  # the compute stream is current inside the step
            with original(name):
                yield
        engine._timed_window = lagging
        return lambda: None  # the engine is closed afterwards
    return wrap


def stress_copies(cycles: int):
    """Wrap an engine's device so every copy's stream sleeps first (copies land late)."""
    def wrap(engine):
        dev = engine.dev
        original = dev.copy

        def lagging(dst, src, *, stream):
            with _on(stream):
                torch.cuda._sleep(cycles)
            return original(dst, src, stream=stream)
        dev.copy = lagging  # the device is shared with later runs: undone afterwards
        return lambda: delattr(dev, "copy")
    return wrap


def ordering(ctx: Ctx) -> dict:
    """Rule micro-tests under a lagging producer, then whole-engine stress."""
    dev, q = ctx.dev, ctx.quick
    per_ms = sleep_cycles_per_ms(dev)
    lag = int(per_ms * (10 if q else 25))
    n = 1 << 22  # 16 MiB fp32 buffers
    out = {"sleep_cycles_per_ms": per_ms, "lag_ms": lag / per_ms, "rules": {}}
    for name, rule in ORDERING_RULES.items():
        ordered = rule(dev, lag, True, n)
        unordered = rule(dev, lag, False, n)
        out["rules"][name] = {"ordered": ordered, "ok": ordered["exact"],
                              "race_seen_without_rule": not unordered["exact"]}
    # whole engine: a small mixed plan (dram, nvme, recompute, keep) with grad_accum 2
    shape = STRESS_SHAPE
    config = llama_config(**shape)
    ref, adapter = model_pair(config, seed=1)
    batches = make_batches(2, batch=shape["batch"], seq=shape["seq"], vocab=config.vocab_size,
                           seed=2)
    tiers, keep = plan_matrix(shape["layers"])["mixed"]
    plan = plan_of(hand_problem(adapter, batch=shape["batch"], seq=shape["seq"], act_bytes=4,
                                grad_accum=2), tiers, keep)
    with deterministic():
        base = engine_grads(adapter, plan, ctx, batches)
        vs_hf = grad_error(base, hf_grads(ref, batches))
        window_lag = int(per_ms * (1 if q else 2))
        engine_out = {"plan": {"tiers": tiers, "keep": list(keep)}, "unstressed_vs_hf": vs_hf,
                      "lag_ms_per_window_or_copy": window_lag / per_ms}
        for mode, wrap in (("compute_lag", stress_compute(window_lag)),
                           ("copy_lag", stress_copies(window_lag))):
            err = grad_error(engine_grads(adapter, plan, ctx, batches, wrap=wrap), base)
            engine_out[mode] = {**err, "ok": err["max_rel"] <= STRESS_TOL}
    engine_out["ok"] = (vs_hf["max_rel"] <= FP32_GRAD_TOL and engine_out["compute_lag"]["ok"]
                        and engine_out["copy_lag"]["ok"])
    out["engine_stress"] = engine_out
    out["ok"] = all(r["ok"] for r in out["rules"].values()) and engine_out["ok"]
    return out


@contextlib.contextmanager
def deterministic():
    """Deterministic algorithms where torch has them (warn elsewhere), restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


# --- gradients --------------------------------------------------------------------------------


def gradients(ctx: Ctx) -> dict:
    """fp32 plan matrix vs HF (twice: drift), bf16 vs HF's bf16 error, 3 AdamW steps."""
    q = ctx.quick
    shape = {**GRAD_SHAPE, **({"layers": 4, "batch": 1} if q else {})}
    batch = shape["batch"]
    config = llama_config(**shape)
    ref, adapter = model_pair(config, seed=3)
    batches = make_batches(2, batch=batch, seq=shape["seq"], vocab=config.vocab_size, seed=4)
    problem = hand_problem(adapter, batch=batch, seq=shape["seq"], act_bytes=4, grad_accum=2)
    problem_bf16 = hand_problem(adapter, batch=batch, seq=shape["seq"], act_bytes=2,
                                grad_accum=2)
    out = {"shape": {**shape, "grad_accum": 2}, "fp32": {}, "bf16": {}}
    with deterministic():
        want = hf_grads(ref, batches)
        hf_drift = grad_error(hf_grads(ref, batches), want)["max_rel"]
        out["hf_run_to_run_drift"] = hf_drift
        drift_tol = max(DRIFT_TOL, 4 * hf_drift)
        for name, (tiers, keep) in plan_matrix(shape["layers"]).items():
            if ctx.budget.left() < 20:
                out["fp32"][name] = {"ok": False, "error": "time budget"}
                continue
            plan = (levels_plan_of(problem, shape["layers"]) if name == "levels"
                    else plan_of(problem, tiers, keep))
            first = engine_grads(adapter, plan, ctx, batches)
            second = engine_grads(adapter, plan, ctx, batches)
            err, drift = grad_error(first, want), grad_error(second, first)
            out["fp32"][name] = {
                "tiers": tiers, "keep": list(keep), "vs_hf": err,
                "drift_max_rel": drift["max_rel"], "drift_bitwise": drift["bitwise"],
                "ok": err["max_rel"] <= FP32_GRAD_TOL and drift["max_rel"] <= drift_tol}
        if ctx.budget.left() > 20:
            out["fp32"]["mixed_dropout"] = dropout_case(ctx, shape, drift_tol)
        hf16 = copy.deepcopy(ref).to(torch.bfloat16)
        hf16_err = grad_error(hf_grads(hf16, batches), want)
        del hf16
        out["hf_bf16_vs_fp32"] = hf16_err
        for name in ("all_hbm", "mixed"):
            tiers, keep = plan_matrix(shape["layers"])[name]
            err = grad_error(engine_grads(adapter, plan_of(problem_bf16, tiers, keep), ctx,
                                          batches, dtype="bf16"), want)
            ratio = err["l2_rel"] / hf16_err["l2_rel"]
            out["bf16"][name] = {"vs_fp32": err, "ratio_to_hf_bf16": ratio,
                                 "ok": ratio <= BF16_RATIO_TOL}
    del ref, adapter
    out["adamw"] = adamw_steps(ctx, config, shape, batch)
    out["ok"] = (all(r["ok"] for r in out["fp32"].values())
                 and all(r["ok"] for r in out["bf16"].values()) and out["adamw"]["ok"])
    return out


def dropout_case(ctx: Ctx, shape: dict, drift_tol: float) -> dict:
    """The mixed plan with attention dropout 0.1: the engine replays each block's RNG state in
    recompute and re-forward, so its masks (and gradients) equal HF's under the same seed."""
    config = llama_config(**shape, dropout=0.1)
    ref, adapter = model_pair(config, seed=7)
    batches = make_batches(2, batch=shape["batch"], seq=shape["seq"], vocab=config.vocab_size,
                           seed=8)
    tiers, keep = plan_matrix(shape["layers"])["mixed"]
    plan = plan_of(hand_problem(adapter, batch=shape["batch"], seq=shape["seq"], act_bytes=4,
                                grad_accum=2), tiers, keep)
    torch.manual_seed(0)  # as the engine's constructor (seed=0) does
    want = hf_grads(ref, batches)
    first = engine_grads(adapter, plan, ctx, batches)
    second = engine_grads(adapter, plan, ctx, batches)
    err, drift = grad_error(first, want), grad_error(second, first)
    return {"tiers": tiers, "keep": list(keep), "attention_dropout": 0.1, "vs_hf": err,
            "drift_max_rel": drift["max_rel"], "drift_bitwise": drift["bitwise"],
            "ok": err["max_rel"] <= FP32_GRAD_TOL and drift["max_rel"] <= drift_tol}


def adamw_steps(ctx: Ctx, config, shape: dict, batch: int, steps: int = 3) -> dict:
    """`steps` engine AdamW steps (mixed plan, grad_accum 2) vs torch.optim.AdamW on HF."""
    from lazytrain.runtime.build import make_engine
    lr, wd = 1e-3, 0.01
    ref, adapter = model_pair(config, seed=5)
    initial = {n: p.detach().cpu().clone() for n, p in ref.named_parameters()}
    tiers, keep = plan_matrix(shape["layers"])["mixed"]
    plan = plan_of(hand_problem(adapter, batch=batch, seq=shape["seq"], act_bytes=4,
                                grad_accum=2), tiers, keep)
    engine = make_engine(adapter, plan, device=ctx.dev, nvme_dir=ctx.tmp / "nvme", grad_accum=2,
                         lr=lr, eps=ADAM_EPS, weight_decay=wd)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=ADAM_EPS, weight_decay=wd)
    try:
        for step in range(steps):
            batches = make_batches(2, batch=batch, seq=shape["seq"], vocab=config.vocab_size,
                                   seed=20 + step)
            engine.step(batches)
            hf_grads(ref, batches)
            opt.step()
        mine = engine.named_parameters_fp32()
        num = den = 0.0
        worst = 0.0
        for name, p in ref.named_parameters():
            r = p.detach().float().cpu()
            d = mine[name].float() - r
            num += float(d.double().pow(2).sum())
            den += float((r - initial[name]).double().pow(2).sum())
            worst = max(worst, float(d.abs().max()))
    finally:
        engine.close()
    rel = math.sqrt(num / den) if den else math.inf
    return {"steps": steps, "lr": lr, "eps": ADAM_EPS, "update_rel_l2_error": rel,
            "max_abs_error_over_lr": worst / lr, "ok": rel <= ADAM_TOL}


# --- overlap ----------------------------------------------------------------------------------


def overlap_tiers(L: int) -> tuple[list[str], tuple[int, ...]]:
    """hbm at 0 and L, odd boundaries below L-2 recomputed, the rest dram; block L-1 kept."""
    tiers = ["hbm" if i in (0, L) else "recompute" if i % 2 and i < L - 2 else "dram"
             for i in range(L + 1)]
    return tiers, (L - 1,)


def measured_problem(adapter, config, shape: dict, ctx: Ctx):
    """The planner's problem for this model with block, embed and head times measured on this
    GPU (the engine's own block code) and measured link rates; memory from the planner's model
    (`planner.build`)."""
    from lazytrain.config import config_from_dict
    from lazytrain.planner.build import build_problem
    from lazytrain.contract import HEAD_CHUNK_TOKENS
    from lazytrain.profile.bench_blocks import BlockBench, block_kind_times, time_ms
    from lazytrain.profile.bench_rates import copy_rates
    from lazytrain.spec.costs import analytic_costs
    from lazytrain.spec.hardware import get_hardware
    from lazytrain.spec.model import ModelSpec
    bench = BlockBench(adapter, micro_batch=shape["batch"], seq_len=shape["seq"], dtype="bf16",
                       device=ctx.dev.torch_device)
    times = block_kind_times(bench, ["block"] * adapter.num_blocks, repeats=3, warmup=1)["block"]
    embed_ms = time_ms(bench.embed, device=bench.device, repeats=3, warmup=1)
    head_ms = time_ms(bench.head, device=bench.device, repeats=3, warmup=1)
    del bench
    torch.cuda.empty_cache()
    rates = ctx.shared.get("copy_gbps")
    if rates is None:
        raw = copy_rates(block_weight_bytes(shape), device=ctx.dev.torch_device, repeats=3)
        rates = {f"{k}_gb_per_s": v / GB for k, v in raw.items()}
    model = ModelSpec.from_hf_config(config.to_dict(), name="gpu-validate-overlap")
    hw = get_hardware("h200", {
        "hbm_gb": torch.cuda.get_device_properties(0).total_memory / GB,
        "dram_gb": (_meminfo("MemAvailable") or 64 * GIB) / GB,
        "h2d_gb_per_s": rates["h2d_gb_per_s"], "d2h_gb_per_s": rates["d2h_gb_per_s"],
        "duplex_gb_per_s": rates["duplex_gb_per_s"]})
    cfg = config_from_dict({"data": {"seq_len": shape["seq"]},
                            "train": {"micro_batch": shape["batch"], "grad_accum": 1,
                                      "compute_dtype": "bf16"}})
    costs = analytic_costs(model, hw, seq_len=shape["seq"], micro_batch=shape["batch"],
                           compute_dtype="bf16", head_chunk_tokens=HEAD_CHUNK_TOKENS)
    blocks = tuple(dataclasses.replace(c, fwd_ms=times["fwd_ms"], fwd_grad_ms=times["fwd_grad_ms"],
                                       bwd_ms=times["bwd_ms"]) for c in costs.blocks)
    costs = dataclasses.replace(costs, blocks=blocks, embed_ms=embed_ms, head_ms=head_ms,
                                source="gpu_validate measured")
    problem = build_problem(model, hw, cfg, costs=costs)
    measured = {"block": times, "embed_ms": embed_ms, "head_ms": head_ms, "links": rates}
    return problem, measured


def busy_union(intervals: list[tuple[float, float]], lo: float, hi: float
               ) -> list[tuple[float, float]]:
    """Disjoint sorted union of `intervals` clipped to [lo, hi]."""
    out: list[list[float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(union: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _arg(event: dict, key: str):
    """A trace event's args[key] (None when absent)."""
    return (event.get("args") or {}).get(key)


def _compute_spans(windows, ops, launch_ts, compute) -> list[tuple[float, float] | None]:
    """Per window (host order): (first start, last end) of the compute-stream ops it launched,
    us; None for a window that launched none."""
    starts = [w[0] for w in windows]
    spans: list = [None] * len(windows)
    for e in ops:
        if _arg(e, "stream") != compute:
            continue
        ts = launch_ts.get(_arg(e, "correlation"), -1.0)
        k = bisect.bisect_right(starts, ts) - 1
        if k < 0 or ts > windows[k][1]:
            continue  # launched outside every window
        a, b = e["ts"], e["ts"] + e.get("dur", 0)
        spans[k] = (a, b) if spans[k] is None else (min(spans[k][0], a), max(spans[k][1], b))
    return spans


def _window_row(name: str, lo: float, hi: float, by_stream: dict, compute, label) -> dict:
    """Busy figures of one window spanning [lo, hi] us on the GPU."""
    comp = busy_union(by_stream[compute], lo, hi)
    copies = {s: busy_union(iv, lo, hi) for s, iv in by_stream.items() if s != compute}
    any_copy = busy_union([iv for u in copies.values() for iv in u], lo, hi)
    copy_us = _length(any_copy)
    idle = complement(comp, lo, hi)  # the compute stream idle: the exposed time
    return {"name": name, "span_ms": (hi - lo) / 1e3, "compute_busy_ms": _length(comp) / 1e3,
            "copy_busy_ms": {label(s): _length(u) / 1e3 for s, u in copies.items()
                             if _length(u) > 0},
            "overlapped_fraction": _intersect(any_copy, comp) / copy_us if copy_us else None,
            "exposed_ms": (hi - lo - _length(comp)) / 1e3,
            "exposed_ms_by_cause": exposed_by_cause(idle, {label(s): u for s, u in
                                                           copies.items()})}


def complement(union: list[tuple[float, float]], lo: float, hi: float
               ) -> list[tuple[float, float]]:
    """[lo, hi] less a disjoint sorted union (`busy_union`), as disjoint sorted intervals."""
    out, at = [], lo
    for a, b in union:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if hi > at:
        out.append((at, hi))
    return out


def exposed_by_cause(idle: list[tuple[float, float]],
                     copies: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """The compute stream's idle time (us intervals) by what the GPU did meanwhile, ms: each
    copy stream gets the idle time it was busy in (where several copied at once, their shares
    of that time in proportion to their own busy time there, so the causes add up to the idle
    time), and "host" the idle time with no copy running either: the GPU waited on the host
    (a host wait before the window's work was queued, or launch gaps)."""
    busy = {name: _intersect(u, idle) for name, u in copies.items()}
    any_copy = _intersect(busy_union([iv for u in copies.values() for iv in u],
                                     idle[0][0], idle[-1][1]) if idle else [], idle)
    total = sum(busy.values())
    out = {name: b * any_copy / total / 1e3 for name, b in busy.items() if b > 0}
    out["host"] = (_length(idle) - any_copy) / 1e3
    return out


def window_overlap(trace: list[dict], *, prefix: str = "lt_window:",
                   markers: dict[int, str] | None = None) -> dict:
    """Per window busy times from a Chrome trace of `torch.profiler` (times in us -> ms).

    GPU work (kernels, memcpys, memsets: args.stream, args.correlation) is attributed to the
    window whose host range (`record_function(prefix + name)`, a user_annotation) contains its
    launch (the runtime call with the same correlation id). The compute stream is the one with
    the most kernel time. A window spans, on the GPU, from the end of the previous window's last
    compute op to the end of its own last compute op. Within that span: compute_busy_ms (union
    of compute-stream ops), copy_busy_ms per other stream, overlapped_fraction (copy time on any
    stream that coincides with compute, over all copy time), exposed_ms (span - compute busy:
    the compute stream idle, waiting for copies or the host). `markers` maps the byte count of
    a marker memcpy to the name of the stream it ran on (streams are named by it; others keep
    their id).

    Returns:
        {"compute_stream": id, "stream_names": {id: name}, "windows": [{name, span_ms,
        compute_busy_ms, copy_busy_ms {stream: ms}, overlapped_fraction (None without copies),
        exposed_ms}, ...]} in host order.
    """
    windows = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(prefix):])
                     for e in trace if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and e.get("name", "").startswith(prefix))
    launch_ts = {_arg(e, "correlation"): e["ts"] for e in trace
                 if e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and _arg(e, "correlation") is not None}
    ops = [e for e in trace
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernel_us: dict = {}
    by_stream: dict = {}
    for e in ops:
        s = _arg(e, "stream")
        by_stream.setdefault(s, []).append((e["ts"], e["ts"] + e.get("dur", 0)))
        if e["cat"] == "kernel":
            kernel_us[s] = kernel_us.get(s, 0.0) + e.get("dur", 0)
    if not windows or not kernel_us:
        return {"compute_stream": None, "windows": []}
    compute = max(kernel_us, key=kernel_us.get)
    names = {compute: "compute"}
    for e in ops:
        name = (markers or {}).get(_arg(e, "bytes")) if e["cat"] == "gpu_memcpy" else None
        if name is not None:
            names.setdefault(_arg(e, "stream"), name)
    label = lambda s: names.get(s, str(s))  # noqa: E731
    rows, prev_end = [], None
    for (_, _, name), span in zip(windows, _compute_spans(windows, ops, launch_ts, compute)):
        if span is None:
            continue
        lo = prev_end if prev_end is not None else span[0]
        prev_end = span[1]
        rows.append(_window_row(name, lo, span[1], by_stream, compute, label))
    return {"compute_stream": str(compute), "stream_names": {str(k): v for k, v in names.items()},
            "windows": rows}


ENGINE_STREAMS = ("h2d", "d2h", "ckpt_h2d", "ckpt_d2h")
"""The runtime's copy streams (runtime/streams.py, runtime/activations.py)."""
MARKER_BYTES = 4096 * 7 + 1
"""Marker copy k has MARKER_BYTES + k bytes (a size no engine copy has): names stream k."""


def profiled_run(engine, batches, trace_path: Path) -> dict[int, str]:
    """One compute_gradients under torch.profiler with a record_function per window (wrapping
    the engine's `_timed_window` here, not in product code), then one marker copy per engine
    stream; writes the Chrome trace and returns marker bytes -> stream name."""
    from torch.profiler import ProfilerActivity, profile, record_function
    original = engine._timed_window

    @contextlib.contextmanager
    def marked(name: str):
        with record_function(f"lt_window:{name}"), original(name):
            yield
    engine._timed_window = marked
    try:
        dev = engine.dev
        host = dev.pinned_empty(MARKER_BYTES + len(ENGINE_STREAMS))
        target = dev.empty(MARKER_BYTES + len(ENGINE_STREAMS), torch.uint8)
        dev.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.compute_gradients(batches)
            dev.synchronize()
            for k, name in enumerate(ENGINE_STREAMS):
                dev.host_wait(dev.copy(target[:MARKER_BYTES + k], host[:MARKER_BYTES + k],
                                       stream=dev.stream(name)))
        prof.export_chrome_trace(str(trace_path))
    finally:
        engine._timed_window = original
    return {MARKER_BYTES + k: name for k, name in enumerate(ENGINE_STREAMS)}


def window_totals(rows: list[dict]) -> dict:
    """Sums over the plan's windows (those with a prediction): span, compute busy, exposed and
    predicted ms, the exposed ms by cause (copy streams, "host") and the copy-time-weighted
    overlapped fraction."""
    rows = [r for r in rows if "predicted" in r]
    copy = [sum(r["copy_busy_ms"].values()) for r in rows]
    overlapped = sum(c * (r["overlapped_fraction"] or 0.0) for c, r in zip(copy, rows))
    causes: dict[str, float] = {}
    for r in rows:
        for cause, ms in (r.get("exposed_ms_by_cause") or {}).items():
            causes[cause] = causes.get(cause, 0.0) + ms
    return {"span_ms": sum(r["span_ms"] for r in rows),
            "exposed_ms_by_cause": causes,
            "compute_busy_ms": sum(r["compute_busy_ms"] for r in rows),
            "exposed_ms": sum(r["exposed_ms"] for r in rows),
            "predicted_ms": sum(r["predicted"]["time_ms"] for r in rows),
            "predicted_exposed_ms": sum(r["predicted"]["exposed_ms"] for r in rows),
            "copy_busy_ms": sum(copy),
            "overlapped_fraction": overlapped / sum(copy) if sum(copy) else None}


def fresh_thread_intra_op_threads() -> int:
    """torch.get_num_threads() in a new thread: what a worker started now (the optimizer's,
    NVMe I/O) gets, since each thread takes the process-wide setting at its first use."""
    out: list[int] = []
    worker = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    return out[0]


def ledger_figures(dev) -> dict:
    """The device API's ledger after a step (runtime/ledger.py): peak HBM and pinned bytes it
    booked and the owners at the HBM peak; on CUDA it books the runtime's own allocations, not
    the compute stream's workspace, so its peak stays at or below the allocator's."""
    try:
        window, owners = dev.ledger.peak_owners("hbm")
        return {"peak_hbm_bytes": dev.ledger.peak_bytes("hbm"),
                "peak_pinned_bytes": dev.ledger.peak_bytes("pinned"),
                "hbm_peak_window": window, "hbm_peak_owners": owners}
    except AttributeError as exc:  # a runtime without the ledger: report, do not fail the rest
        return {"error": f"{type(exc).__name__}: {exc}"}


def build_overlap_model(config, dev):
    """The adapter of a random-init model; initialised on the GPU (seconds instead of a
    minute of CPU init for ~1.8e9 parameters), then moved into the host store."""
    from transformers import AutoModelForCausalLM
    from lazytrain.models import adapter_from_model
    torch.manual_seed(0)
    with torch.device(dev.torch_device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    adapter = adapter_from_model(model)
    torch.cuda.empty_cache()
    return adapter


def overlap_runs(engine, batches, ctx: Ctx) -> dict:
    """Warm-up, a timed compute_gradients (allocator peak, ledger, meter) and a profiled one;
    returns their figures and the per-window trace analysis."""
    engine.compute_gradients(batches)  # warm-up: kernels chosen, pinned pools filled
    ctx.dev.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine.compute_gradients(batches)
    ctx.dev.synchronize()
    out = {"step_s": time.perf_counter() - t0, "peak_alloc": torch.cuda.max_memory_allocated(),
           "ledger": ledger_figures(ctx.dev), "meter_ms": engine.meter.times_ms()}
    if ctx.budget.left() < 15:
        raise TimeoutError(f"time budget: {ctx.budget.left():.0f} s left before the profiled "
                           "step")
    trace_path = ctx.tmp / "overlap_trace.json"
    markers = profiled_run(engine, batches, trace_path)
    trace = json.loads(trace_path.read_text())
    out["trace"] = window_overlap(trace.get("traceEvents", trace), markers=markers)
    return out


def overlap(ctx: Ctx) -> dict:
    """Per-window overlap at a realistic shape, against the plan's prediction."""
    from lazytrain.planner.heuristics import heuristic_plan
    from lazytrain.runtime.build import make_engine
    shape = overlap_shape(ctx.quick)
    config = llama_config(**shape)
    threads_before = fresh_thread_intra_op_threads()
    adapter = build_overlap_model(config, ctx.dev)
    problem, measured = measured_problem(adapter, config, shape, ctx)
    tiers, keep = overlap_tiers(shape["layers"])
    plan = plan_of(problem, tiers, keep)
    engine = make_engine(adapter, plan, device=ctx.dev, nvme_dir=ctx.tmp / "nvme",
                         compute_dtype="bf16",
                         model_config_sha256=problem.provenance["model_config_sha256"])
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, config.vocab_size, (shape["batch"], shape["seq"]), generator=g)
    try:
        run = overlap_runs(engine, [{"input_ids": ids, "labels": ids.clone()}], ctx)
    finally:
        engine.close()
    rows, pred = run["trace"]["windows"], plan.predicted
    predicted = {w.name: w for w in plan.windows}
    for row in rows:
        w = predicted.get(row["name"])
        if w is not None:
            row["predicted"] = {"time_ms": w.time_ms, "compute_ms": w.compute_ms,
                                "exposed_ms": w.exposed_ms}
            row["meter_ms"] = run["meter_ms"].get(row["name"])
            row["measured_over_predicted"] = row["span_ms"] / w.time_ms if w.time_ms else None
    peak_tflops = ctx.shared.get("gemm_peak_tflops") or gemm_tflops(ctx.dev, 8192, 10)
    model_tflops = problem.model_flops_per_micro_batch / run["step_s"] / 1e12
    missing = sorted(set(predicted) - {r["name"] for r in rows})
    heuristic = heuristic_plan(problem, time_budget_s=1.0)  # what the planner would pick here
    out = {"shape": shape, "plan": {"tiers": tiers, "keep": list(keep)},
           "measured_costs": measured, "step_s": run["step_s"],
           "step_s_is": "wall time of one compute_gradients (forward + backward, no optimizer)",
           "predicted_step_ms": pred.step_ms,
           "step_measured_over_predicted": run["step_s"] * 1e3 / pred.step_ms,
           "model_tflops": model_tflops, "predicted_model_tflops": pred.model_tflops,
           "gemm_peak_tflops": peak_tflops, "model_tflops_over_peak": model_tflops / peak_tflops,
           "max_memory_allocated_bytes": run["peak_alloc"],
           "predicted_peak_hbm_bytes": pred.peak_hbm_bytes, "ledger": run["ledger"],
           "heuristic_plan": {"tiers": list(heuristic.tiers),
                              "keep": list(heuristic.keep_internals),
                              "predicted_step_ms": heuristic.predicted.step_ms},
           "stream_names": run["trace"].get("stream_names"), "totals": window_totals(rows),
           "windows": rows, "windows_missing_in_trace": missing,
           "fresh_thread_intra_op_threads": {"before_engine": threads_before,
                                             "after_engine": fresh_thread_intra_op_threads(),
                                             "main_thread": torch.get_num_threads()}}
    out["checks"] = {"every_plan_window_in_trace": not missing,
                     "peak_memory_within_prediction": run["peak_alloc"] <= pred.peak_hbm_bytes}
    if run["trace"]["compute_stream"] is None:
        out["error"] = ("the profiler trace has no GPU kernel events (CUPTI activity tracing "
                        "unavailable?)")
    if "peak_hbm_bytes" in run["ledger"]:  # the ledger books a subset of the allocator's bytes
        out["checks"]["ledger_peak_within_allocator_peak"] = (
            run["ledger"]["peak_hbm_bytes"] <= run["peak_alloc"])
    out["ok"] = all(out["checks"].values())
    return out


# --- trainer ----------------------------------------------------------------------------------

TRAINER_CONFIG = ROOT / "configs" / "tiny-llama-cpu.yaml"
"""The Trainer section's run: the tiny Llama on the embedded arithmetic data, on the GPU."""
TRAINER_DEVICE = "cuda"
"""`runtime.device` of the Trainer section's runs (the CPU tests run the section on "cpu")."""
TRAINER_TOL = 1e-5
"""Resumed vs uninterrupted final weights: max |diff| / max |weight| (same plan, same data; a
lost optimizer state or data position shows as O(lr))."""


def trainer_overrides(ctx: Ctx, *extra: str) -> list[str]:
    """Config overrides of the Trainer section's runs: CUDA, the h200 preset (any plan fits the
    tiny model), clipping on, grad_accum 2, heuristic policy (no solver needed), no eval, a
    constant LR (a 2-step run resumed to 4 steps then follows the 4-step run's LR)."""
    return [f"runtime.device={TRAINER_DEVICE}", "hardware.preset=h200", "data.num_eval=0",
            "train.grad_accum=2", "train.clip_grad_norm=1.0", "train.schedule=constant",
            "planner.policy=heuristic",
            f"runtime.nvme_dir={ctx.tmp / 'trainer-nvme'}", *extra]


def nvme_plan_of(cfg):
    """Every boundary below L on the NVMe tier (the failed step's plan: an NVMe write fails)."""
    from lazytrain.planner.build import problem_from_config
    problem = problem_from_config(cfg)
    L = problem.num_blocks
    return plan_of(problem, ["nvme"] * L + ["hbm"])


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's weights of a run directory."""
    from safetensors.torch import load_file
    from lazytrain.train import checkpoint as ckpt
    return load_file(str(ckpt.latest_checkpoint(run_dir).path / "model.safetensors"))


def weight_error(a: dict, b: dict) -> float:
    """max |a - b| / max |b| over every tensor (inf when the key sets differ)."""
    if a.keys() != b.keys():
        return math.inf
    scale = max(float(t.float().abs().max()) for t in b.values()) or 1.0
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b) / scale


def trainer(ctx: Ctx) -> dict:
    """The Trainer path on CUDA (instrumented, budget-checked engine, clipping): 4 steps
    straight; 2 steps then a resume to 4 (weights within TRAINER_TOL of the straight run); an
    NVMe plan whose write fails in step 2 (the step fails with one error, the run keeps its
    step-1 checkpoint) resumed to 4 steps."""
    from lazytrain.config import load_config
    from lazytrain.runtime.nvme import FaultInjector
    from lazytrain.train.loop import TrainHooks, train
    runs, out = ctx.tmp / "trainer", {}

    def run(name: str, *extra: str, **kw) -> dict:
        cfg = load_config(TRAINER_CONFIG, trainer_overrides(ctx, *extra))
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON
            return train(cfg, run_dir=runs / name, progress=False, **kw)
    straight = run("straight", "train.steps=4")
    run("resumed", "train.steps=2")
    resumed = run("resumed", "train.steps=4", resume=True)
    out["resume"] = {"steps": [straight["steps_completed"], resumed["steps_completed"]],
                     "max_rel_weight_diff": weight_error(final_weights(runs / "resumed"),
                                                         final_weights(runs / "straight"))}
    cfg = load_config(TRAINER_CONFIG, trainer_overrides(ctx, "train.steps=4",
                                                        "train.checkpoint_every_steps=1"))
    faults = FaultInjector()
    hooks = TrainHooks(fault_hook=faults, on_step_end=lambda step, _stats:
                       faults.fail_next_write() if step == 1 else None)
    try:
        run("failed", "train.steps=4", "train.checkpoint_every_steps=1", plan=nvme_plan_of(cfg),
            hooks=hooks)
        failed = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - the failure is the expected outcome
        failed = {"raised": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    after = run("failed", "train.steps=4", "train.checkpoint_every_steps=1", resume=True)
    failed["resumed_steps"] = after["steps_completed"]
    out["failed_step"] = failed
    out["checks"] = {"straight_and_resumed_reach_4_steps": out["resume"]["steps"] == [4, 4],
                     "resume_matches_straight": out["resume"]["max_rel_weight_diff"]
                     <= TRAINER_TOL,
                     "failed_step_raises": failed["raised"] is not None,
                     "failed_run_resumes_to_4_steps": failed["resumed_steps"] == 4}
    out["ok"] = all(out["checks"].values())
    return out


# --- mfu ---------------------------------------------------------------------------------------

MFU_SHAPE = dict(hidden=4096, layers=8, seq=8192, intermediate=14336, heads=32, kv_heads=8,
                 vocab=128256, batch=1)
"""Llama-3-8B's widths (hidden 4096, MLP 14336, 32 heads, 8 KV heads, vocabulary 128256) cut
to 8 layers, so that its host state (about 2.8e9 parameters at 16 B/param, 45 GB) fits the GPU
machine's 128 GiB; seq 8192, micro-batch 1 (--quick: seq 4096)."""
MFU_STEADY_STEPS = 3
"""Timed optimizer steps after one warm-up step."""
H200_BF16_TFLOPS = 989.4
"""H200 SXM dense BF16 peak, TFLOPS (NVIDIA's data sheet; the `h200` preset's figure)."""
PREDICTS_WITHIN = 0.2
"""The plan predicts the step when |measured / predicted - 1| <= this."""
OVERLAPPED_EXPOSED_MAX = 0.1
"""Overlapped: the plan's windows leave the compute stream idle for at most this share of
their span."""


def mfu_shape(quick: bool) -> dict:
    """MFU_SHAPE, with seq 4096 under --quick."""
    return {**MFU_SHAPE, "seq": 4096 if quick else MFU_SHAPE["seq"]}


def mfu_problem(shape: dict, *, links: dict | None = None, host: dict | None = None,
                block_times: dict | None = None, embed_ms: float | None = None,
                head_ms: float | None = None, hbm_gb: float | None = None,
                dram_gb: float | None = None):
    """The planning problem of the MFU run: the h200 preset with this machine's figures fed
    in: link rates (`copy_gbps` keys, GB/s), host rates as `profile.bench_rates.host_rates`
    returns them (measured on the runtime's worker threads, in the run's dtypes; the problem
    gets exactly these), block / embed / head ms; the analytic model for whatever is None.
    bf16 compute, fp32 masters, grad_accum 1."""
    from lazytrain.config import config_from_dict
    from lazytrain.contract import HEAD_CHUNK_TOKENS
    from lazytrain.planner.build import build_problem
    from lazytrain.spec.costs import analytic_costs, reference_host_rates
    from lazytrain.spec.hardware import get_hardware
    from lazytrain.spec.model import ModelSpec
    model = ModelSpec.from_hf_config(llama_config(**shape).to_dict(), name="gpu-validate-mfu")
    overrides = {"hbm_gb": hbm_gb, "dram_gb": dram_gb}
    if links:
        overrides.update({k: links[k] for k in ("h2d_gb_per_s", "d2h_gb_per_s",
                                                "duplex_gb_per_s")})
    hw = get_hardware("h200", overrides)
    if host:
        conv, acc = reference_host_rates(host["convert_gb_per_s"] * 1e9,
                                         host["accumulate_gb_per_s"] * 1e9,
                                         master_dtype=host["master_dtype"], compute_dtype="bf16")
        hw = dataclasses.replace(hw, host_convert_bytes_per_s=conv,
                                 host_accumulate_bytes_per_s=acc)
    cfg = config_from_dict({"data": {"seq_len": shape["seq"]},
                            "train": {"micro_batch": shape["batch"], "grad_accum": 1,
                                      "compute_dtype": "bf16", "master_dtype": "fp32"}})
    costs = analytic_costs(model, hw, seq_len=shape["seq"], micro_batch=shape["batch"],
                           compute_dtype="bf16", head_chunk_tokens=HEAD_CHUNK_TOKENS)
    if block_times:
        costs = dataclasses.replace(costs, blocks=tuple(
            dataclasses.replace(c, fwd_ms=block_times["fwd_ms"],
                                fwd_grad_ms=block_times["fwd_grad_ms"],
                                bwd_ms=block_times["bwd_ms"]) for c in costs.blocks))
    costs = dataclasses.replace(costs, embed_ms=costs.embed_ms if embed_ms is None else embed_ms,
                                head_ms=costs.head_ms if head_ms is None else head_ms)
    return build_problem(model, hw, cfg, costs=costs)


def mfu_plan(problem, *, time_limit_s: float):
    """The planner's own plan of the MFU problem (`planner.policy.plan`, policy milp: the
    heuristic's plan, with one line saying so, when no solver is installed)."""
    from lazytrain.planner.policy import PlannerOptions, plan
    return plan(problem, PlannerOptions(policy="milp", time_limit_s=time_limit_s,
                                        lp_bound=False))


def mfu_figures(problem, plan, *, step_s: float, gemm_peak_tflops: float | None,
                rows: list[dict] | None = None) -> dict:
    """MFU and the plan's prediction against a measured step of `step_s` seconds.

    Model TFLOPS = the problem's model FLOPs per step (`model_flops_per_micro_batch` x
    grad_accum: 6 N tokens plus attention) / step_s; MFU against H200_BF16_TFLOPS and against
    the measured GEMM peak; per window the predicted time and binding term (the evaluator)
    beside the measured GPU span (`window_overlap` rows, ms) and the exposed time by cause.
    """
    from lazytrain.planner.evaluate import evaluate
    flops = problem.model_flops_per_micro_batch * problem.grad_accum
    tflops = flops / step_s / 1e12
    pred = plan.predicted
    ev = evaluate(problem, plan)
    measured = {r["name"]: r for r in rows or ()}
    windows = []
    for w, binding in zip(plan.windows, ev.binding_by_window):
        row = measured.get(w.name) or {}
        span = row.get("span_ms")
        windows.append({"name": w.name, "predicted_ms": w.time_ms, "binding": binding,
                        "measured_ms": span,
                        "measured_over_predicted": span / w.time_ms if span and w.time_ms
                        else None, "exposed_ms_by_cause": row.get("exposed_ms_by_cause")})
    ratio = step_s * 1e3 / pred.step_ms
    return {"model_tflops": tflops, "mfu_vs_h200_bf16_peak": tflops / H200_BF16_TFLOPS,
            "gemm_peak_tflops": gemm_peak_tflops,
            "mfu_vs_measured_gemm_peak": tflops / gemm_peak_tflops if gemm_peak_tflops
            else None,
            "predicted_model_tflops": pred.model_tflops,
            "predicted_mfu_vs_h200_bf16_peak": pred.model_tflops / H200_BF16_TFLOPS,
            "measured_step_ms": step_s * 1e3, "predicted_step_ms": pred.step_ms,
            "measured_over_predicted": ratio, "plan_predicts_step": abs(ratio - 1)
            <= PREDICTS_WITHIN, "windows": windows}


def measure_mfu_costs(adapter, shape: dict, ctx: Ctx) -> dict:
    """Block, embed and head ms on this GPU (the engine's block code) and the host rates on
    the runtime's own worker threads (`profile.bench_rates.host_rates`)."""
    from lazytrain.profile.bench_blocks import BlockBench, block_kind_times, time_ms
    from lazytrain.profile.bench_rates import host_rates
    bench = BlockBench(adapter, micro_batch=shape["batch"], seq_len=shape["seq"], dtype="bf16",
                       device=ctx.dev.torch_device)
    out = {"block_times": block_kind_times(bench, ["block"] * adapter.num_blocks, repeats=3,
                                           warmup=1)["block"],
           "embed_ms": time_ms(bench.embed, device=bench.device, repeats=3, warmup=1),
           "head_ms": time_ms(bench.head, device=bench.device, repeats=3, warmup=1),
           "host": host_rates(bench, repeats=3)}
    del bench
    torch.cuda.empty_cache()
    return out


def mfu(ctx: Ctx) -> dict:
    """What MFU, and does the plan predict it: the MFU_SHAPE model planned by the planner from
    measured costs and host rates, MFU_STEADY_STEPS AdamW steps timed after a warm-up, one
    profiled step for the per-window figures (compute busy, copy busy, exposed by cause)."""
    from lazytrain.runtime.build import make_engine
    shape = mfu_shape(ctx.quick)
    config = llama_config(**shape)
    adapter = build_overlap_model(config, ctx.dev)
    measured = measure_mfu_costs(adapter, shape, ctx)
    links = ctx.shared.get("copy_gbps")
    if links is None:
        from lazytrain.profile.bench_rates import copy_rates
        raw = copy_rates(block_weight_bytes(shape), device=ctx.dev.torch_device, repeats=3)
        links = {f"{k}_gb_per_s": v / GB for k, v in raw.items()}
    problem = mfu_problem(shape, links=links, host=measured["host"],
                          block_times=measured["block_times"], embed_ms=measured["embed_ms"],
                          head_ms=measured["head_ms"],
                          hbm_gb=torch.cuda.get_device_properties(0).total_memory / GB,
                          dram_gb=(_meminfo("MemAvailable") or 64 * GIB) / GB)
    plan = mfu_plan(problem, time_limit_s=5.0 if ctx.quick else 10.0)
    engine = make_engine(adapter, plan, device=ctx.dev, nvme_dir=ctx.tmp / "mfu-nvme",
                         compute_dtype="bf16", lr=1e-5, clip_grad_norm=1.0, instrument=True,
                         budgets=True,
                         model_config_sha256=problem.provenance["model_config_sha256"])
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(1, config.vocab_size, (shape["batch"], shape["seq"]), generator=g)
    batches = [{"input_ids": ids, "labels": ids.clone()}]
    try:
        engine.step(batches)  # warm-up: kernels chosen, pinned pools filled
        ctx.dev.synchronize()
        t0 = time.perf_counter()
        for _ in range(MFU_STEADY_STEPS):  # each step's AdamW overlaps the next one's forward
            engine.step(batches)
        ctx.dev.synchronize()
        step_s = (time.perf_counter() - t0) / MFU_STEADY_STEPS
        markers = profiled_run(engine, batches, ctx.tmp / "mfu_trace.json")
        trace = json.loads((ctx.tmp / "mfu_trace.json").read_text())
        overlap_rows = window_overlap(trace.get("traceEvents", trace), markers=markers)
    finally:
        engine.close()
    rows = overlap_rows["windows"]
    predicted = {w.name: w for w in plan.windows}
    for row in rows:
        w = predicted.get(row["name"])
        if w is not None:
            row["predicted"] = {"time_ms": w.time_ms, "exposed_ms": w.exposed_ms}
    out = {"shape": shape, "measured": measured, "links": links,
           "planned_by": plan.solver.backend if plan.solver else None,
           "milp_unavailable": plan.provenance.get("milp_unavailable"),
           "plan": {"tiers": list(plan.tiers), "keep": list(plan.keep_internals),
                    "resident": list(plan.resident_weights)},
           "host_assumed": plan.provenance.get("host"),
           "step_s_is": f"mean wall time of {MFU_STEADY_STEPS} optimizer steps after a warm-up",
           **mfu_figures(problem, plan, step_s=step_s,
                         gemm_peak_tflops=ctx.shared.get("gemm_peak_tflops"), rows=rows),
           "totals": window_totals(rows)}
    out["checks"] = {"every_plan_window_in_trace": set(predicted) <= {r["name"] for r in rows},
                     "plan_predicts_step": out["plan_predicts_step"]}
    out["ok"] = all(out["checks"].values())
    return out


# --- the three answers --------------------------------------------------------------------------

CORRECT_SECTIONS = ("ordering", "gradients", "trainer")
"""The sections whose checks answer "correct?"."""


def answers(sections: dict) -> dict:
    """The three questions, answered from the section results: correct? (every check of
    CORRECT_SECTIONS passed), overlapped? (the mfu run's windows, else the overlap section's:
    compute busy, copy busy, exposed ms by cause; yes when the exposed time is at most
    OVERLAPPED_EXPOSED_MAX of the span) and what MFU, and does the plan predict it? (the mfu
    section). None where the section did not run or failed before its figures."""
    ran = {n: sections[n] for n in CORRECT_SECTIONS if n in sections}
    correct = {"answer": all(s.get("ok") for s in ran.values()) if ran else None,
               "sections": {n: bool(s.get("ok")) for n, s in ran.items()},
               "failed_checks": {n: [c for c, v in (s.get("checks") or {}).items() if not v]
                                 or s.get("error") for n, s in ran.items() if not s.get("ok")}}
    source = next((n for n in ("mfu", "overlap") if (sections.get(n) or {}).get("totals")), None)
    if source is None:
        overlapped = {"answer": None, "from": None}
    else:
        t = sections[source]["totals"]
        share = t["exposed_ms"] / t["span_ms"] if t["span_ms"] else None
        overlapped = {"answer": share is not None and share <= OVERLAPPED_EXPOSED_MAX,
                      "from": source, "span_ms": t["span_ms"],
                      "compute_busy_ms": t["compute_busy_ms"], "copy_busy_ms": t["copy_busy_ms"],
                      "exposed_ms": t["exposed_ms"], "exposed_share": share,
                      "exposed_ms_by_cause": t.get("exposed_ms_by_cause"),
                      "host_blocked_ms": (t.get("exposed_ms_by_cause") or {}).get("host")}
    m = sections.get("mfu") or {}
    if "model_tflops" not in m:
        mfu_answer = {"answer": None, "error": m.get("error") or m.get("status")}
    else:
        keys = ("model_tflops", "mfu_vs_h200_bf16_peak", "gemm_peak_tflops",
                "mfu_vs_measured_gemm_peak", "predicted_model_tflops",
                "predicted_mfu_vs_h200_bf16_peak", "measured_step_ms", "predicted_step_ms",
                "measured_over_predicted", "planned_by")
        mfu_answer = {"answer": m["mfu_vs_h200_bf16_peak"],
                      "plan_predicts_it": m["plan_predicts_step"], **{k: m.get(k) for k in keys}}
    return {"correct": correct, "overlapped": overlapped, "mfu": mfu_answer}


SECTIONS = {"environment": environment, "ceilings": ceilings, "ordering": ordering,
            "gradients": gradients, "trainer": trainer, "mfu": mfu, "overlap": overlap}


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_validate.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sections: " + ", ".join(SECTION_ORDER) + "\n\nexamples:\n"
        "  PYTHONPATH=src python benchmarks/gpu_validate.py --out gpu_validate.json\n"
        "  PYTHONPATH=src python benchmarks/gpu_validate.py --quick --only ordering,gradients")
    p.add_argument("--out", type=Path, default=Path("gpu_validate.json"),
                   help="JSON result file (written atomically after every section)")
    p.add_argument("--quick", action="store_true",
                   help="smaller shapes and fewer repeats (about half the time)")
    p.add_argument("--only", default=None,
                   help="comma-separated sections to run (environment always runs)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="global time budget, s (default 270: under 5 minutes with start-up "
                        "and the watchdog's grace)")
    p.add_argument("--tmp-dir", type=Path, default=None,
                   help="directory for the NVMe tier and the trace (default: a new temp dir)")
    args = p.parse_args(argv)
    if args.only is None:
        args.sections = list(DEFAULT_SECTIONS)
    else:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [s for s in wanted if s not in SECTIONS]
        if bad:
            p.error(f"--only: unknown section {bad[0]!r}; use any of {', '.join(SECTION_ORDER)}")
        args.sections = [s for s in SECTION_ORDER if s == "environment" or s in wanted]
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0; got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # cuBLAS reproducibility (the drift check) needs this before the first cuBLAS handle
    preset = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    results = {"script": "benchmarks/gpu_validate.py",
               "argv": sys.argv[1:] if argv is None else argv,
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "quick": args.quick, "budget_s": args.budget_s,
               "cublas_workspace_config_set_by_script": preset is None,
               "sections": {}, "running": None}
    with tempfile.TemporaryDirectory(prefix="gpu-validate-", dir=args.tmp_dir) as tmp:
        ctx = Ctx(args=args, budget=Budget(args.budget_s), tmp=Path(tmp))
        watchdog = start_watchdog(ctx, results, args.out)
        try:
            run_all(ctx, results, args.out)
        finally:
            watchdog.cancel()
    results.pop("running", None)
    results["elapsed_s"] = round(ctx.budget.elapsed(), 1)
    results["ok"] = results.get("error") is None and all(
        s["ok"] for s in results["sections"].values())
    results["answers"] = answers(results["sections"])
    write_json(args.out, results)
    print(json.dumps({"out": str(args.out), "ok": results["ok"], **results["answers"]}))
    failed = [n for n, s in results["sections"].items() if not s["ok"]]
    log(f"wrote {args.out}: " + ("all sections passed" if results["ok"] else
                                 f"FAILED: {', '.join(failed) or results.get('error')}"))
    return 0 if results["ok"] else 1


def run_all(ctx: Ctx, results: dict, out: Path) -> None:
    """Every selected section in order; without CUDA only the environment runs."""
    cuda = torch.cuda.is_available()
    if cuda:
        from lazytrain.runtime.backends import make_device
        ctx.dev = make_device("cuda")
    else:
        results["error"] = (f"no CUDA device: torch {torch.__version__} (CUDA "
                            f"{torch.version.cuda}) sees none; only the environment section ran")
        log(results["error"])
    for name in ctx.args.sections:
        need = MIN_START_S[name] / (2 if ctx.quick else 1)
        if name != "environment" and not cuda:
            results["sections"][name] = {"ok": False, "status": "skipped",
                                         "error": "no CUDA device"}
        elif ctx.budget.left() < need:
            results["sections"][name] = {"ok": False, "status": "skipped",
                                         "error": f"time budget: {ctx.budget.left():.0f} s left, "
                                                  f"the section needs {need:.0f} s to start"}
        else:
            log(f"{name} ({ctx.budget.left():.0f} s of budget left)")
            results["running"] = name
            results["sections"][name] = run_section(name, SECTIONS[name], ctx)
            results["running"] = None
            log(f"{name}: {results['sections'][name]['status']} "
                f"in {results['sections'][name]['seconds']} s")
        write_json(out, results)


if __name__ == "__main__":
    raise SystemExit(main())
