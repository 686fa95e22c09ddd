"""The checks that run before anything is planned or loaded: the data paths exist, the
sequence fits the model's positions, a resumed run keeps its batch shape and trains the model it
saved. Each refusal is one line naming the key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lazytrain.data import EMBEDDED_PREFIX, TEMPLATES
from lazytrain.spec.model import ModelSpec


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
