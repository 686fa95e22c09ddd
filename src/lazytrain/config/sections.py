"""The config sections: one frozen dataclass per YAML section, composed by `RunConfig`.

Owns every key's name, type, default and documentation (the docstring under each field, which
`field_docs` reads and docs/config.md is generated from) and each section's range checks
(`__post_init__`). The defaults are the embedded default job: fine-tune SmolLM2-135M-Instruct
on the built-in arithmetic data, on this CPU, in <= 5 minutes on 2 cores.

Sizes are GB (1e9 bytes, as in the vendor datasheets) and bandwidths GB/s; the spec layer converts them
to int bytes and bytes/s. Knows nothing about YAML files, overrides or aliases (`load.py`,
`coerce.py`); imports neither torch nor a solver.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Literal

from lazytrain.config.checks import check, check_finite
from lazytrain.config.dpo import DPOConfig
from lazytrain.config.grpo import GrpoConfig
from lazytrain.contract import HEAD_CHUNK_TOKENS

Dtype = Literal["bf16", "fp32"]


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """`model:` which network is trained or planned."""

    config_path: str = "smollm2-135m-instruct"
    """HF `config.json` file, HF model directory, or a built-in name (`smollm2-135m-instruct`,
    the default job's model). Relative paths resolve against the YAML file's directory first
    (module docstring)."""
    name: str = ""
    """Label in reports and plan provenance; empty: derived from the config file name."""
    dtype: Dtype = "fp32"
    """Dtype of the HF weights a checkpoint exports (`model.safetensors`; the masters keep
    `train.master_dtype`, and a narrower export also saves them as they are, for `--resume`).
    fp32 by default: the default job runs on CPU in fp32; real-scale configs use bf16, the
    released checkpoints' dtype."""

    def __post_init__(self) -> None:
        check(bool(self.config_path), "model.config_path", "a non-empty path or name",
               self.config_path)


HARDWARE_OVERRIDE_RANGE = (1e-3, 1e6)
"""Plausible range of the `hardware:` overrides: bandwidths in [1e-3, 1e6] GB/s, peak in
[1e-3, 1e6] TFLOP/s, capacities (hbm/dram/nvme) at most 1e6 GB (1 PB). Outside it the figures
are typos, and the planner's LP (costs in ms, bytes in the 1e9..1e12 range) loses all numeric
precision: 1e-300 GB/s makes HiGHS end with status error. 1e-3 GB/s (1 MB/s) and 1 GFLOP/s are
far below any real link or chip; 1e6 GB/s and 1 EFLOP/s far above. The same ranges as
`lazytrain.spec.hardware.SPEC_RANGES`, which checks preset and file specs in bytes."""


@dataclass(kw_only=True, frozen=True, slots=True)
class HardwareConfig:
    """`hardware:` a preset (or a saved spec file) plus optional overrides of its figures."""

    preset: str = "cpu"
    """Preset name (`lazytrain.spec.hardware.PRESETS`: h100-sxm, h100-pcie, h800-sxm, h800-pcie,
    h200, a100-80gb, rtx-3090, rtx-4090, h800-paper, cpu) or a JSON/YAML hardware file. Default
    cpu: the embedded default job runs on this CPU."""
    hbm_gb: float | None = None
    """Override: device memory, GB. None keeps the preset's value."""
    dram_gb: float | None = None
    """Override: host DRAM budget for the trainer, GB. None keeps the preset's value."""
    nvme_gb: float | None = None
    """Override: NVMe scratch budget for checkpoints, GB (0 disables the nvme tier)."""
    h2d_gb_per_s: float | None = None
    """Override: host-to-device bandwidth, GB/s. Every bandwidth and `peak_tflops` override
    must lie in [1e-3, 1e6], every capacity in (0, 1e6] GB (`HARDWARE_OVERRIDE_RANGE`)."""
    d2h_gb_per_s: float | None = None
    """Override: device-to-host bandwidth, GB/s."""
    duplex_gb_per_s: float | None = None
    """Override: cap on H2D + D2H running at once, GB/s."""
    nvme_read_gb_per_s: float | None = None
    """Override: NVMe read bandwidth through the engine's path, GB/s."""
    nvme_write_gb_per_s: float | None = None
    """Override: NVMe write bandwidth, GB/s."""
    peak_tflops: float | None = None
    """Override: peak matmul throughput in the compute dtype, TFLOP/s."""
    matmul_efficiency: float | None = None
    """Override: achieved fraction of peak for block matmuls, in [1e-3, 1]."""
    hbm_reserve_fraction: float = 0.05
    """Fraction of device memory held back from the plan (CUDA context, allocator
    fragmentation), in [0, 0.5). 5%: about 4 GB of 80 GB, the usual context + cache slack."""
    profile_path: str = ""
    """Measured profile (JSON, `lazytrain profile` writes it; schema in `lazytrain.spec.costs`):
    its per-block-kind times and bandwidths replace the analytic ones. Empty: analytic costs."""
    gpus_per_node: int | None = None
    """Override: GPUs in one node, >= 1 (the node's DRAM, NVMe and links are shared by the ranks
    on it; `lazytrain.planner.topology`). None keeps the preset's value (1)."""
    gpus_per_pcie_switch: int | None = None
    """Override: GPUs behind one PCIe switch, >= 1 (they share its uplink to the host). None
    keeps the preset's value (1: every GPU has its own x16 root port)."""
    nvme_devices_per_node: int | None = None
    """Override: NVMe drives in the node, >= 1 (informational: `nvme_*_gb_per_s` are the
    node's totals over these drives). None keeps the preset's value."""
    allow_implausible: bool = False
    """Accept figures outside their plausible range (HBM 1 MB..2 TB per GPU, DRAM 16 MB..64 TB,
    NVMe 0..1 PB, bandwidths 0.001 GB/s..10 TB/s, peak 1 GFLOP/s..100 PFLOP/s; table in
    docs/execution_model.md). False: such a figure is refused in one line naming the key and the
    likely unit mistake (`hbm_gb: 80000` is MB typed as GB); `--allow-implausible` sets it."""

    def __post_init__(self) -> None:
        check_finite(self, "hardware")
        check(bool(self.preset), "hardware.preset", "a preset name or a file path", self.preset)
        lo, hi = HARDWARE_OVERRIDE_RANGE
        for key in ("hbm_gb", "dram_gb"):
            value = getattr(self, key)
            check(value is None or 0 < value <= hi, f"hardware.{key}",
                   f"in (0, {hi:g}] GB (or null)", value)
        check(self.nvme_gb is None or 0 <= self.nvme_gb <= hi, "hardware.nvme_gb",
               f"in [0, {hi:g}] GB (or null)", self.nvme_gb)
        for key in ("h2d_gb_per_s", "d2h_gb_per_s", "duplex_gb_per_s", "nvme_read_gb_per_s",
                    "nvme_write_gb_per_s", "peak_tflops"):
            value = getattr(self, key)
            unit = "TFLOP/s" if key == "peak_tflops" else "GB/s"
            check(value is None or lo <= value <= hi, f"hardware.{key}",
                   f"in [{lo:g}, {hi:g}] {unit} (or null)", value)
        eff = self.matmul_efficiency
        check(eff is None or lo <= eff <= 1, "hardware.matmul_efficiency",
               f"in [{lo:g}, 1] (or null)", eff)
        check(0 <= self.hbm_reserve_fraction < 0.5, "hardware.hbm_reserve_fraction",
               "in [0, 0.5)", self.hbm_reserve_fraction)
        for key in ("gpus_per_node", "gpus_per_pcie_switch", "nvme_devices_per_node"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"hardware.{key}", ">= 1 (or null)", value)


DataFormat = Literal["auto", "alpaca", "sharegpt", "messages", "gsm8k", "metamathqa",
                     "prompt_completion", "text", "arithmetic"]


@dataclass(kw_only=True, frozen=True, slots=True)
class MixSource:
    """One entry of `data.mix`: a dataset and its share of the training samples."""

    path: str = ""
    """As `data.path`: a file, folder, Hub id or `embedded:arithmetic` (no registry entry)."""
    weight: float = 1.0
    """Share of the mixed training samples, > 0 (normalized over the entries)."""
    format: DataFormat = "auto"
    """As `data.format`, for this entry."""
    subset: str = ""
    """As `data.subset`, for this entry."""
    split: str = "train"
    """As `data.split`, for this entry."""

    def __post_init__(self) -> None:
        check(bool(self.path), "data.mix.path", "a file, folder, Hub id or embedded:<name>",
              self.path)
        check(math.isfinite(self.weight) and self.weight > 0, "data.mix.weight",
              "a finite number > 0", self.weight)


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    """`data:` what is trained on and how samples become fixed-length sequences."""

    path: str = "embedded:arithmetic"
    """Dataset: a local JSON/JSONL/Parquet/Arrow/CSV file or a folder of them, a Hugging Face
    Hub id (`openai/gsm8k`; read with `datasets.load_dataset` into its cache,
    `HF_DATASETS_OFFLINE=1` uses the cache only), a registry entry name (with `registry_path`),
    or `embedded:arithmetic`: the project's own generated arithmetic word problems (no
    download; the default job)."""
    subset: str = ""
    """Configuration of a Hub dataset (`load_dataset`'s name, e.g. `main` for openai/gsm8k);
    empty: the dataset's default."""
    split: str = "train"
    """Split of `path` to train on, with `datasets` slicing (`train`, `train[:2000]`); a single
    local file is one split called train."""
    eval_split: str = ""
    """Split to hold out for evaluation (e.g. `test`): read from `eval_path`, or from `path`
    when `eval_path` is empty; empty: the last `num_eval` training samples (or `eval_path`'s
    train split)."""
    format: DataFormat = "auto"
    """Sample schema; `auto` detects it from the dataset's column names (`lazytrain.data.formats`:
    prompt_completion and text are TRL's; text is plain text, trained whole, no template)."""
    chat_template: str = ""
    """Chat template the conversations are rendered with: `chatml`, `llama3`, `qwen`, or a path
    to a Jinja file; empty: the tokenizer's own, and chatml when it has none (said in one line).
    The template used is saved with the checkpoint's tokenizer (`lazytrain.data.templates`)."""
    registry_path: str = ""
    """LlamaFactory-style `dataset_info.json`; when set, `path` names an entry in it
    (`lazytrain.data.registry`: file_name, formatting alpaca|sharegpt, columns, tags)."""
    dataset_dir: str = ""
    """Folder the registry entries' `file_name`s resolve against (LlamaFactory's
    `dataset_dir`); empty: the registry file's folder."""
    seq_len: int = 112
    """Tokens per sequence (padded or packed to this length), >= 8. 112: the longest embedded
    arithmetic sample is 108 tokens with SmolLM2's chat template (measured on 2,048 generated
    problems), so more is only padding, and short rows keep the default job's 30 steps inside
    5 minutes on 2 cores."""
    packing: bool = False
    """Pack several samples per sequence (per-sequence position ids, no cross-attention;
    `lazytrain.data.packing`). Refused for models with linear-attention or Mamba layers."""
    eval_path: str = ""
    """Held-out evaluation data (same kinds as `path`); empty: `path`'s `eval_split`, or the
    last `num_eval` samples of `path` are held out."""
    num_eval: int = 16
    """Held-out prompts evaluated before and after training, >= 0 (16: fits the 5-minute job)."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a sample longer than `seq_len` (counted in the run summary)."""
    mix: tuple[MixSource, ...] = ()
    """Datasets mixed by weight, in place of `path` (and its format, subset, split): a list of
    mappings {path, weight, format, subset, split}. The mixed training set holds as many
    samples as the entries together; entry i gives round(weight_i / sum of weights x that
    total) of them, in an order shuffled by `train.seed`, repeating its samples when it has
    fewer and taking a subset when it has more (`lazytrain.data.sources.mix_examples`).
    Held-out examples: `eval_path` if set, else the last `num_eval` of the first entry (taken
    before mixing). Empty: train on `path` alone."""

    def __post_init__(self) -> None:
        check(bool(self.path), "data.path", "a file, registry name or embedded:<name>",
               self.path)
        check(self.seq_len >= 8, "data.seq_len", ">= 8", self.seq_len)
        check(self.num_eval >= 0, "data.num_eval", ">= 0", self.num_eval)


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    """`train:` the optimisation: batch shape, schedule, precision, run directory."""

    method: Literal["sft", "dpo", "grpo"] = "sft"
    """The objective: sft (next-token cross entropy on the trained tokens), dpo (preference
    pairs, `dpo.*`; the data holds prompt/chosen/rejected records) or grpo (`grpo.*`). The head
    computes every objective over the targets' log-probs chunk by chunk
    (`runtime.objectives`)."""
    micro_batch: int = 4
    """Sequences per micro-batch, >= 1 (4: the default job's 5-minute budget); with
    `method: dpo`, preference pairs (each pair is two rows: the plan counts 2 x micro_batch)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step, >= 1."""
    steps: int = 30
    """Optimizer steps, >= 1. 30 x (4 x 112 tokens) at ~4 s per fp32 step on 2 cores fits the
    5-minute default job with evaluation; the format is learned in about 10 steps, and the
    held-out exact match climbs over the next 20 (benchmarks/default_job.py)."""
    epochs: float = 0.0
    """Passes over the training data, >= 0 (fractions allowed); > 0 replaces `train.steps` by
    the steps that draw that many passes (`data.batching.steps_for_epochs`), the data order
    reshuffled each epoch from `seed`; 0: train `steps` steps. HF name: num_train_epochs."""
    lr: float = 1e-4
    """Peak learning rate, > 0 (1e-4: a common full fine-tuning rate for small models)."""
    warmup_steps: int = 2
    """Linear warmup steps from 0 to `lr`, >= 0."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """LR schedule after warmup."""
    min_lr_ratio: float = 0.1
    """Final LR of the cosine schedule as a fraction of `lr`, in [0, 1]."""
    clip_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (then each block steps as soon as its
    gradients arrive)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, >= 0 (0: the usual fine-tuning default)."""
    adam_beta1: float = 0.9
    """AdamW beta1, in [0, 1)."""
    adam_beta2: float = 0.999
    """AdamW beta2, in [0, 1) (torch's default)."""
    adam_eps: float = 1e-8
    """AdamW epsilon, > 0 (torch's default)."""
    seed: int = 0
    """Seed for initialisation, data order and dropout; the same seed repeats a run."""
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, summary.json, checkpoints and the resolved config."""
    eval_every: int = 0
    """Also evaluate every N steps, >= 0 (a log line, an `"event": "eval"` record in
    metrics.jsonl, eval/* tracker scalars); 0: only before and after training."""
    checkpoint_every_steps: int = 0
    """Also save a checkpoint every N steps, >= 0; 0: off (only the wall-clock rule below, the
    end of the run, SIGTERM and Ctrl-C save). Old name: `train.save_every`."""
    checkpoint_every_min: float = 30.0
    """Save a checkpoint when this many minutes of wall time have passed since the run started
    or last saved, checked after every step, >= 0; 0: off. 30: a week-long job loses at most
    half an hour to a crash, while a 27B checkpoint (hundreds of GB) is written a few times an
    hour at most."""
    keep_checkpoints: int = 1
    """Valid checkpoints kept in `<run_dir>/checkpoints`, >= 1; older ones are deleted once a
    newer one is complete. 1: a checkpoint of a large model is hundreds of GB; keep more to
    go back to an earlier step (`--resume` continues from the newest)."""
    master_dtype: Dtype = "fp32"
    """Host master weights and gradients: fp32 (16 B/param with fp32 Adam moments) or bf16
    (MegaTrain-style, 12 B/param). fp32 by default: exact, and small models fit."""
    compute_dtype: Dtype = "fp32"
    """Dtype of the streamed weights, activations and device compute. fp32 on CPU (bf16 matmul
    is very slow on AVX2); bf16 on GPUs."""
    report_to: tuple[Literal["tensorboard", "wandb", "none"], ...] = ()
    """Experiment trackers that receive the per-step metrics besides `metrics.jsonl` (HF
    TrainingArguments' name): tensorboard (event files in `<run_dir>/tensorboard`), wandb
    (offline unless WANDB_MODE says otherwise). A list or one name; empty or [none]: only
    metrics.jsonl. Each needs its extra: `pip install lazytrain[tensorboard]` / `[wandb]`."""

    def __post_init__(self) -> None:
        check_finite(self, "train")
        for key in ("micro_batch", "grad_accum", "steps", "keep_checkpoints"):
            check(getattr(self, key) >= 1, f"train.{key}", ">= 1", getattr(self, key))
        for key in ("warmup_steps", "eval_every", "checkpoint_every_steps"):
            check(getattr(self, key) >= 0, f"train.{key}", ">= 0", getattr(self, key))
        check(self.lr > 0, "train.lr", "> 0", self.lr)
        check(self.epochs >= 0, "train.epochs", ">= 0 (0 = use train.steps)", self.epochs)
        check(self.checkpoint_every_min >= 0, "train.checkpoint_every_min", ">= 0 (0 = off)",
               self.checkpoint_every_min)
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        check(self.clip_grad_norm >= 0, "train.clip_grad_norm", ">= 0 (0 = off)",
               self.clip_grad_norm)
        check(self.weight_decay >= 0, "train.weight_decay", ">= 0", self.weight_decay)
        for key in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, key) < 1, f"train.{key}", "in [0, 1)", getattr(self, key))
        check(self.adam_eps > 0, "train.adam_eps", "> 0", self.adam_eps)
        check(bool(self.run_dir), "train.run_dir", "a non-empty directory", self.run_dir)
        check("none" not in self.report_to or len(self.report_to) == 1, "train.report_to",
               "[none] alone or a list of trackers without none", list(self.report_to))


@dataclass(kw_only=True, frozen=True, slots=True)
class PlannerConfig:
    """`planner:` how the activation placement plan is chosen."""

    policy: Literal["milp", "heuristic", "megatrain", "ideal"] = "milp"
    """milp (LazyTrain), heuristic (uniform-K + greedy + local search), megatrain (every
    `megatrain_k`-th boundary in HBM, the rest recomputed) or ideal (infinite-HBM bound)."""
    backend: Literal["auto", "scip", "highs"] = "auto"
    """MILP solver. auto: HiGHS up to 64 blocks, SCIP above, as benchmarks/planner.py measured
    (planner/solvers.py AUTO_HIGHS_MAX_BLOCKS has the numbers)."""
    time_limit_s: float = 10.0
    """Solver wall-clock limit, s, > 0; the incumbent is returned on time-out (10 s: a
    64-block problem's solve target)."""
    gap: float = 0.005
    """Relative optimality gap at which the solver stops, in [0, 1) (0.5%: the solve target)."""
    least_wear: bool = True
    """After the step-time solve, solve once more for the plan within `least_wear_slack` of its
    step that writes the fewest bytes to NVMe, then moves the fewest activation bytes over the
    host link (planner/wear.py; policy milp). On: when windows are compute-bound many plans tie
    and the first solve may pick one that writes tens of GB per step to NVMe, wearing the drive
    for no speed. Costs single-boundary moves checked by the evaluator (0.3 s of CPU at 64
    blocks) and a solve of 5% of `time_limit_s`."""
    least_wear_slack: float = 0.001
    """Relative step time the least-wear solve may give up, in [0, 0.05] (0.1%: below the
    0.5% solver gap, so the plan stays as fast as the gap promises; 0 keeps exact ties only)."""
    k_max: int = 16
    """Longest segment (blocks between consecutive materialized boundaries), >= 1. 16 bounds
    the MILP to O(16 L) segment variables; a longer segment recomputes >= 16 blocks, which
    costs more than offloading a boundary on every preset."""
    megatrain_k: int = 4
    """K of the MegaTrain rule (policy megatrain and the comparison baseline), >= 1."""
    drain_windows: int = 4
    """H_d: windows a D2H offload may spread over from the boundary's production, >= 1."""
    prefetch_windows: int = 4
    """H_p: windows before use in which an H2D prefetch may run, >= 1."""
    nvme_lead_windows: int = 4
    """H_n: extra windows of lead for NVMe writes and reads, >= 0."""
    allow_keep: bool = True
    """Offer keep-internals (no re-forward for a block whose graph and weights stay in HBM) and
    resident weights (no backward weight load for a block whose weights stay in HBM)."""
    allow_q8: bool = False
    """Offer per-block 8-bit Adam moments (bitsandbytes AdamW8bit, runtime/optim8bit.py) to
    relieve DRAM. Opt-in: the CPU 8-bit update is ~10x slower than fused fp32 AdamW on this
    machine kind; the planner charges that extra time to the step (the profile's measured
    figure, else PlanningProblem.q8_update_ms_per_gparam's default) plus a small tie-breaker
    penalty (PlanningProblem.q8_penalty_ms_per_gparam), so enable it when DRAM, not time, is
    the limit."""
    save_levels: bool = True
    """Offer per-block save levels L1/L2 (a block keeps its token mixer's saved tensors, or
    all of them, from its forward for its backward, in HBM or DRAM, instead of re-forwarding;
    docs/execution_model.md "Save levels"). Off: the problem has no `saved_bytes` and every
    block re-forwards (L0), as before levels existed."""
    threads: int = 1
    """Solver threads, >= 1 (1: deterministic plans)."""
    seed: int = 0
    """Solver random seed (same input, same plan)."""
    deterministic: bool = False
    """Make the plan a function of the input alone: the solvers stop on node limits and the
    heuristic start on a step budget, both sized from `time_limit_s` (planner/policy.py
    DETERMINISTIC_NODES_PER_S, HEURISTIC_STEPS_PER_S), instead of on wall-clock limits, and
    the plan records no solve time, so the same config writes the same plan JSON on a busy
    machine and a quiet one. Off by default: a node limit does not bound the solve's wall
    time, and a time limit does."""
    replan_every_steps: int = 0
    """Online re-planning: compare measured windows with the plan every N steps, >= 0; 0: off
    (the plan is fixed for the run). `lazytrain.train.replan`."""
    drift_threshold: float = 0.15
    """Relative drift of a channel's bandwidth (or of compute) that counts, > 0 (0.15: the
    issue's default; measured / planned outside [0.85, 1.15])."""
    drift_patience_steps: int = 2
    """Consecutive drifting checks before re-solving, >= 1 (2: one noisy step never re-plans)."""

    def __post_init__(self) -> None:
        check_finite(self, "planner")
        check(self.time_limit_s > 0, "planner.time_limit_s", "> 0", self.time_limit_s)
        check(self.replan_every_steps >= 0, "planner.replan_every_steps", ">= 0 (0 = off)",
               self.replan_every_steps)
        check(self.drift_threshold > 0, "planner.drift_threshold", "> 0", self.drift_threshold)
        check(self.drift_patience_steps >= 1, "planner.drift_patience_steps", ">= 1",
               self.drift_patience_steps)
        check(0 <= self.gap < 1, "planner.gap", "in [0, 1)", self.gap)
        check(0 <= self.least_wear_slack <= 0.05, "planner.least_wear_slack", "in [0, 0.05]",
              self.least_wear_slack)
        for key in ("k_max", "megatrain_k", "drain_windows", "prefetch_windows", "threads"):
            check(getattr(self, key) >= 1, f"planner.{key}", ">= 1", getattr(self, key))
        check(self.nvme_lead_windows >= 0, "planner.nvme_lead_windows", ">= 0",
               self.nvme_lead_windows)


@dataclass(kw_only=True, frozen=True, slots=True)
class RuntimeConfig:
    """`runtime:` where and how the streaming engine runs."""

    device: Literal["auto", "cpu", "cuda", "cpu-checked", "cpu-threaded"] = "auto"
    """The device API backend, chosen once at start-up. auto: cuda when available, else cpu.
    cpu-checked: the cpu numerics plus a happens-before checker that raises on the first
    unordered access (slower; for CI and debugging). cpu-threaded: copy streams on delayed
    worker threads with poisoned buffers (a missing wait corrupts gradients visibly)."""
    nvme_dir: str = ""
    """Directory for nvme-tier checkpoint files; empty: `<run_dir>/nvme` (a warning is printed
    when it is on tmpfs)."""
    io_threads: int = 2
    """Worker threads for NVMe reads/writes, >= 1."""
    nvme_timeout_s: float = 300.0
    """Longest wait for the NVMe tier's requests of one window, s, >= 0; past it the step fails
    with NvmeTimeoutError naming the file (a stuck drive) instead of hanging forever. 0: wait
    forever. 300: far above a window's transfers (GBs at GB/s)."""
    threads: int = 0
    """torch intra-op threads, >= 0; 0: torch's default (all cores)."""
    head_chunk_tokens: int = HEAD_CHUNK_TOKENS
    """Tokens per chunk of the LM head + loss, >= 1: one chunk's logits, fp32 log-softmax and
    their gradients (12 B per logit) are the head's HBM workspace, beside the head weight's
    [vocab, hidden] gradient (1024 x 248320 x 12 B = 3.05 GB for Qwen3.5-27B)."""
    calibrate: Literal["auto", "off"] = "auto"
    """Where an unprofiled plan for this machine gets its costs. auto: with
    `hardware.profile_path` empty and the plan for this machine (preset cpu on the CPU, or this
    GPU's preset), the cached calibration of this machine (`lazytrain.profile.calibrate`);
    `lazytrain train` measures one on a miss (a few seconds), `lazytrain plan` reads it.
    off: analytic costs of the preset. The environment variable LAZYTRAIN_CALIBRATE=off
    overrides auto (the test suite sets it). auto by default: the analytic cpu preset is off by
    2x on the default job."""
    calibration_dir: str = ""
    """Directory of the calibration cache; empty: $XDG_CACHE_HOME/lazytrain/calibration, else
    ~/.cache/lazytrain/calibration (one JSON file per machine, model, batch shape and dtypes)."""

    def __post_init__(self) -> None:
        check(self.io_threads >= 1, "runtime.io_threads", ">= 1", self.io_threads)
        check(math.isfinite(self.nvme_timeout_s) and self.nvme_timeout_s >= 0,
               "runtime.nvme_timeout_s", ">= 0 (0 = no timeout)", self.nvme_timeout_s)
        check(self.threads >= 0, "runtime.threads", ">= 0", self.threads)
        check(self.head_chunk_tokens >= 1, "runtime.head_chunk_tokens", ">= 1",
               self.head_chunk_tokens)


@dataclass(kw_only=True, frozen=True, slots=True)
class DistConfig:
    """`dist:` data parallelism over torch.distributed (torchrun sets the ranks)."""

    nproc_per_node: int = 1
    """Ranks (GPUs) per node the plan is made for, >= 1: each rank's plan gets 1/N of the
    node's DRAM and NVMe and a share of its PCIe switch (`lazytrain.planner.topology`); training
    under torchrun checks it against LOCAL_WORLD_SIZE. 1: one GPU, the whole node."""
    nnodes: int = 1
    """Nodes in the job, >= 1 (each has its own DRAM and NVMe): Adam moments are sharded over
    nproc_per_node x nnodes ranks and masters cross nodes by broadcast
    (`lazytrain.planner.topology`); training under torchrun sets it from the launch."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Default process group backend: auto is nccl with runtime.device=cuda, gloo on CPU.
    Gradients and masters live in host DRAM and are reduced over gloo groups either way."""
    timeout_s: float = 300.0
    """Collective timeout, s, > 0: when a rank dies the others raise within this time instead
    of hanging (300 s: longer than any step, evaluation or checkpoint of the shipped jobs)."""
    allreduce_gb_per_s: float = 10.0
    """Bus bandwidth of the per-block gradient reduction + master broadcast path per rank,
    GB/s, > 0 (the reduce's (W-1)/W x G bytes and the master broadcast's, across nodes only
    with shared masters, go through it; `lazytrain.planner.topology`). 10: gloo over shared
    memory on one host, a rough figure to replace with a measured one."""
    shared_masters: bool = True
    """One master copy per node (`train.master_dtype`), in shared memory mapped by every local rank
    (`lazytrain.dist.shared_masters`), instead of one copy per rank: each block's owner updates
    it in place and the other local ranks read it. False: every rank holds its own copy and the
    owner broadcasts each update (N x the master bytes per node)."""
    shm_dir: str = "/dev/shm"
    """Directory (a tmpfs) of the node's shared master file when `shared_masters` is on; the
    file is unlinked as soon as every local rank has mapped it, so nothing is left behind."""

    def __post_init__(self) -> None:
        check_finite(self, "dist")
        check(bool(self.shm_dir), "dist.shm_dir", "a directory", self.shm_dir)
        check(self.nproc_per_node >= 1, "dist.nproc_per_node", ">= 1", self.nproc_per_node)
        check(self.nnodes >= 1, "dist.nnodes", ">= 1", self.nnodes)
        check(self.timeout_s > 0, "dist.timeout_s", "> 0", self.timeout_s)
        check(self.allreduce_gb_per_s > 0, "dist.allreduce_gb_per_s", "> 0",
               self.allreduce_gb_per_s)


@dataclass(kw_only=True, frozen=True, slots=True)
class RunConfig:
    """A whole run: one field per YAML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The `model:` section."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """The `hardware:` section."""
    data: DataConfig = field(default_factory=DataConfig)
    """The `data:` section."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The `train:` section."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The `planner:` section."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """The `runtime:` section."""
    dist: DistConfig = field(default_factory=DistConfig)
    """The `dist:` section (data parallelism)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The `dpo:` section (`config/dpo.py`; read with `train.method: dpo`)."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """The `grpo:` section (`config/grpo.py`; read with `train.method: grpo`)."""

    def to_dict(self) -> dict:
        """Plain nested dict (YAML/JSON-serialisable), `{section: {key: value}}`; tuple fields
        become lists (YAML's safe dumper has no tuples)."""
        return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in body.items()}
                for name, body in dataclasses.asdict(self).items()}


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "hardware": HardwareConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "planner": PlannerConfig,
    "runtime": RuntimeConfig,
    "dist": DistConfig,
    "dpo": DPOConfig,
    "grpo": GrpoConfig,
}
"""Section name -> dataclass, in YAML order."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (empty string if none).

    Used by the test that every field is documented and by CLI help.
    """
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                doc = nxt.value.value.strip()
            docs[node.target.id] = doc
    return docs

