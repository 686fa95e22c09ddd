"""Training checkpoints: atomic directories that HF can load and `--resume` continues from.

Layout of `RUN_DIR/checkpoints/step-000012/`:

    config.json, model.safetensors (or shards + index)   HF-loadable fp32 weights
    tokenizer.json, tokenizer_config.json, ...           the tokenizer, so the dir is a model
    trainer_state.pt                                      optimizer + RNG (engine), data position,
                                                          step, LR schedule position
    COMPLETE                                              JSON marker, written last

Atomicity: everything is written into `checkpoints/.tmp-step-000012-<pid>/`, every file and the
directory are fsynced, the `COMPLETE` marker (listing every file with its size) is written and
fsynced last, then the directory is renamed to its final name and the parent fsynced. A
directory is valid only when its marker exists, parses, and every listed file has the listed
size; temp directories and directories without a marker (a crash, a kill, a full disk) are
never picked up, and are removed by the next successful save. The newest `KEEP_LAST` valid
checkpoints are kept (a checkpoint of SmolLM2-135M is about 1.6 GB: 4 B/param weights +
8 B/param Adam moments).

Knows nothing of the training loop; it receives the tensors and state dicts to write.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

MARKER = "COMPLETE"
"""Name of the marker file written last into a finished checkpoint directory."""
STATE_FILE = "trainer_state.pt"
"""torch.save'd dict: engine (optimizer, RNG), data, step, schedule."""
KEEP_LAST = 1
"""Valid checkpoints kept per run (older ones are deleted after a newer one is complete)."""
_NAME_RE = re.compile(r"^step-(\d{6,})$")


@dataclass(kw_only=True, frozen=True, slots=True)
class Checkpoint:
    """A valid checkpoint on disk."""

    path: Path
    """The checkpoint directory (an HF model directory)."""
    step: int
    """Optimizer steps completed when it was written."""

    def load_state(self) -> dict[str, Any]:
        """The trainer state dict (`trainer_state.pt`)."""
        return torch.load(self.path / STATE_FILE, map_location="cpu", weights_only=False)


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_valid(path: Path) -> bool:
    """True when `path` holds a marker that lists files which all exist with their sizes."""
    try:
        marker = json.loads((path / MARKER).read_text())
        return all((path / name).stat().st_size == size
                   for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Valid checkpoints of a run, oldest first (invalid or temp directories are skipped)."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = _NAME_RE.match(child.name)
            if m and child.is_dir() and is_valid(child):
                found.append(Checkpoint(path=child, step=int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest valid checkpoint of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | Path, *, step: int, weights: dict[str, torch.Tensor],
                    hf_config: Any, tokenizer: Any, state: dict[str, Any],
                    before_marker: Callable[[Path], None] | None = None) -> Checkpoint:
    """Write checkpoint `step` atomically (module docstring) and prune older ones.

    Args:
        run_dir: the run directory.
        step: optimizer steps completed.
        weights: HF name -> fp32 tensor (every trainable parameter once; tied head omitted).
        hf_config: the model's `PretrainedConfig` (written as config.json).
        tokenizer: the HF tokenizer (its files make the directory a complete model).
        state: trainer state (engine, data, step, ...), written with torch.save.
        before_marker: test hook called with the temp directory after every file but the
            marker is written (raise there to simulate a crash mid-save).

    Returns:
        The new checkpoint.

    Raises:
        OSError: the disk is full or unwritable; the temp directory is removed and the
            previous checkpoints are untouched.
    """
    from lazytrain.models.hf_loader import save_hf_dir

    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_hf_dir(weights, tmp)
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(state, tmp / STATE_FILE)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        for name in files:
            _fsync(tmp / name)
        if before_marker is not None:
            before_marker(tmp)
        (tmp / MARKER).write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync(tmp / MARKER)
        _fsync(tmp)
        if final.exists():  # a stale or invalid directory of the same step (resumed run)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep=final)
    return Checkpoint(path=final, step=step)


def _prune(root: Path, *, keep: Path) -> None:
    """Delete temp leftovers, invalid step directories and all but the newest KEEP_LAST."""
    valid = list_checkpoints(root.parent)
    keep_names = {c.path.name for c in valid[-KEEP_LAST:]} | {keep.name}
    for child in root.iterdir():
        stale_tmp = child.name.startswith(".tmp-") and not child.name.endswith(f"-{os.getpid()}")
        if child.is_dir() and (stale_tmp or (_NAME_RE.match(child.name)
                                             and child.name not in keep_names)):
            shutil.rmtree(child, ignore_errors=True)
