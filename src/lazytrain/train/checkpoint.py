"""Training checkpoints: atomic directories that HF can load and `--resume` continues from.

Layout of `RUN_DIR/checkpoints/step-000012/`:

    config.json, model.safetensors (or shards + index)   HF-loadable weights in `model.dtype`
                                                          (config.json's dtype says which:
                                                          float32 or bfloat16)
    masters.safetensors (or shards + index)              only when `model.dtype` is narrower
                                                          than the masters (bf16 export of
                                                          fp32 masters): the masters as they
                                                          are, so a resume continues bit-exact
    generation_config.json                                generation defaults of the config
    tokenizer.json, tokenizer_config.json, ...           the tokenizer, so the dir is a model
    trainer_state.pt                                      optimizer + RNG (engine; one
                                                          process), data position, step,
                                                          config, world_size
    shard-rank00000.pt ... shard-rankNNNNN.pt             data parallel: each rank's AdamW
                                                          moments (ZeRO-1 shard) and RNG states
    COMPLETE                                              JSON marker, written last: every
                                                          file with its size and its xxh3-128
                                                          digest, and world_size

Atomicity (one protocol for one process and for every rank of a data-parallel job:
`save_checkpoint`): everything is written into `checkpoints/.tmp-step-000012/`, every file and
the directory are fsynced, the `COMPLETE` marker is written and fsynced last, then the
directory is renamed to its final name and the parent fsynced. A directory is valid only when
its marker exists, parses, and every listed file has the listed size; temp directories and
directories without a marker (a crash, a kill, a full disk, a rank that died) are never picked
up, and are removed by the next successful save. The newest `train.keep_checkpoints` valid
checkpoints are kept (default `KEEP_LAST`; a checkpoint of SmolLM2-135M is about 1.6 GB: 4
B/param weights + 8 B/param Adam moments).

Loading never runs code from a file: `trainer_state.pt` (and a data-parallel rank shard) is
read with `torch.load(weights_only=True)`, which accepts tensors, numbers, strings and plain
containers only; anything else is refused with `CheckpointError`. `--resume` goes through
`resume_checkpoint`, which is strict where `latest_checkpoint` is lenient: a missing run
directory, a run without a complete checkpoint, or a newest step directory that is damaged is
an error naming what is missing, never a silent fresh start; with `verify` (the trainer's
default; `--no-verify-checkpoint` skips it for very large checkpoints) every file must also
match the xxh3-128 digest its marker recorded, so a corruption that keeps the size is named.

Knows nothing of the training loop; it receives the tensors and state dicts to write, and the
rank context (`lazytrain.train.rank`) for the barriers of a data-parallel save.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash
from safetensors import safe_open
from transformers import GenerationConfig

from lazytrain.contract import ADAM_MOMENT_BYTES
from lazytrain.errors import UserError
from lazytrain.models.hf_loader import save_hf_dir, weight_files
from lazytrain.train.rank import ONE_PROCESS, RankContext

MARKER = "COMPLETE"
"""Name of the marker file written last into a finished checkpoint directory."""
STATE_FILE = "trainer_state.pt"
"""torch.save'd dict: engine (optimizer, RNG), data, step, schedule."""
KEEP_LAST = 1
"""Valid checkpoints kept per run by default (`train.keep_checkpoints`; older ones are deleted
after a newer one is complete)."""
MASTERS_PREFIX = "masters"
"""Stem of `masters.safetensors` (or its shards + index): the master weights in their own dtype,
written beside a narrower `model.dtype` export; HF's loaders ignore them."""
_NAME_RE = re.compile(r"^step-(\d{6,})$")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be resumed from: missing, incomplete, damaged, or holding
    objects other than tensors and plain containers (the message names the path and the fix).
    A user error (also a ValueError): the `--resume` input is bad, the CLI exits 2."""


def load_torch_file(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU: tensors, numbers, strings and plain
    containers only, so a crafted file cannot run code.

    Raises:
        CheckpointError: the file is missing, truncated, or holds any other object (named).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refused to load ({_refusal_reason(exc)}): a checkpoint state file may "
            f"hold only tensors and plain containers; this one was not written by lazytrain or was "
            f"altered, do not resume from it") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); resume "
                              f"from an older checkpoint or start again with --overwrite"
                              ) from None


def _refusal_reason(exc: Exception) -> str:
    """What torch's weights-only unpickler refused ("Trying to load unsupported GLOBAL
    posix.system ..."), without its advice to load the file with weights_only=False, which
    would run the code a crafted file carries."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    reasons = [ln for ln in lines if "weights_only" not in ln and "Weights only load" not in ln
               and not ln.startswith("Check the documentation")]
    return reasons[0][:200] if reasons else "an object other than tensors and plain containers"


@dataclass(kw_only=True, frozen=True, slots=True)
class Checkpoint:
    """A valid checkpoint on disk."""

    path: Path
    """The checkpoint directory (an HF model directory)."""
    step: int
    """Optimizer steps completed when it was written."""

    def load_state(self) -> dict[str, Any]:
        """The trainer state dict (`trainer_state.pt`, loaded with weights_only=True).

        Raises:
            CheckpointError: the file is missing, damaged, or holds objects other than tensors
                and plain containers (nothing in it is executed).
        """
        state = load_torch_file(self.path / STATE_FILE)
        if not isinstance(state, dict) or "step" not in state:
            raise CheckpointError(f"{self.path / STATE_FILE} is not a lazytrain trainer state "
                                  f"(no step); resume from another checkpoint")
        return state


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(path: Path) -> str | None:
    """What makes checkpoint directory `path` invalid ("COMPLETE marker missing",
    "model.safetensors is 10 bytes, the marker says 99", ...), or None when it is valid."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return f"its {MARKER} marker is missing (the save did not finish)"
    except (OSError, ValueError) as exc:
        return f"its {MARKER} marker is unreadable ({exc})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        return f"its {MARKER} marker lists no files"
    for name, size in files.items():
        try:
            have = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if have != size:
            return f"{name} is {have} bytes, the marker says {size}"
    return None


def file_digest(path: Path) -> str:
    """xxh3-128 of the file's bytes, hex (read in 8 MiB chunks; several GB/s on one core)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def digest_problem(path: Path) -> str | None:
    """Which file of checkpoint `path` no longer has the xxh3-128 digest its marker recorded
    (a same-size corruption, which `problem` cannot see), or None when all match. Reads every
    file once. A marker without digests (written before they were recorded) is not checked.

    Raises:
        OSError, ValueError: the marker or a file cannot be read (call `problem` first).
    """
    digests = json.loads((path / MARKER).read_text()).get("xxh3") or {}
    for name, want in digests.items():
        if file_digest(path / name) != want:
            return f"{name} does not match its xxh3 digest in {MARKER} (same size, other bytes)"
    return None


def is_valid(path: Path) -> bool:
    """True when `path` holds a marker that lists files which all exist with their sizes."""
    try:
        return problem(path) is None
    except (TypeError, AttributeError):
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


def resume_checkpoint(run_dir: str | Path, *, verify: bool = False) -> Checkpoint:
    """The checkpoint `--resume RUN_DIR` continues from: the newest step directory, which must
    be valid.

    Args:
        run_dir: the run directory.
        verify: also check every file against its xxh3 digest (`digest_problem`; reads the
            whole checkpoint once: the disk's read rate bounds it, xxh3 hashes at several GB/s).
            False: marker and sizes only.

    Raises:
        CheckpointError: `run_dir` does not exist; it holds no step directory with a complete
            marker; or its newest step directory is damaged, sizes or (with `verify`) digests
            (what is wrong named, and the older valid checkpoint if there is one).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume: {run_dir} does not exist; give the run directory of "
                              f"an earlier `lazytrain train`")
    root = checkpoints_dir(run_dir)
    steps = sorted((int(m.group(1)), child) for child in (root.iterdir() if root.is_dir() else ())
                   if (m := _NAME_RE.match(child.name)) and child.is_dir())
    if not steps:
        raise CheckpointError(f"--resume: {run_dir} has no checkpoint ({root} holds no "
                              f"step-N directory with a {MARKER} marker); train without "
                              f"--resume (add --overwrite to clear the run's files)")
    step, newest = steps[-1]
    bad = problem(newest)
    if bad is None and verify:
        bad = digest_problem(newest)
    if bad is not None:
        older = [p for _, p in steps[:-1] if is_valid(p)]
        fix = (f"remove {newest} to resume from {older[-1]}" if older else
               "no older complete checkpoint exists; start again with --overwrite")
        raise CheckpointError(f"--resume: checkpoint {newest} is damaged: {bad}; {fix}")
    return Checkpoint(path=newest, step=step)


def shard_name(rank: int) -> str:
    """The file of rank `rank`'s shard in a data-parallel checkpoint."""
    return f"shard-rank{rank:05d}.pt"


def save_checkpoint(run_dir: str | Path, *, step: int, weights: dict[str, torch.Tensor],
                    hf_config: Any, tokenizer: Any, state: dict[str, Any],
                    shard: dict[str, Any] | None = None, ranks: RankContext = ONE_PROCESS,
                    export_dtype: torch.dtype | None = None, keep: int = KEEP_LAST,
                    before_marker: Callable[[Path], None] | None = None) -> Checkpoint:
    """Write checkpoint `step` atomically (module docstring) and prune older ones. With several
    ranks a collective: call it on every rank.

    Protocol: the main rank creates `checkpoints/.tmp-step-N/`; barrier; every rank writes and
    fsyncs its shard (several ranks only), the main rank the model files and the trainer
    state; barrier (every shard is on disk); the main rank fsyncs every file, writes the
    marker (files, sizes, world_size) last, renames the directory and prunes; barrier. A rank
    that dies before the marker leaves a directory without one, which `latest_checkpoint`
    never picks up. One process: the barriers are no-ops and the shard's entries go into
    `trainer_state.pt`.

    Args:
        run_dir: the run directory (shared by the ranks: one node, or a shared file system).
        step: optimizer steps completed.
        weights: HF name -> tensor (every trainable parameter once; tied head omitted; written
            by the main rank: the masters are equal on all ranks).
        hf_config: the model's `PretrainedConfig` (written as config.json).
        tokenizer: the HF tokenizer (its files make the directory a complete model).
        state: the main rank's trainer state (data, step, config), written with torch.save.
        shard: this rank's own state (engine: optimizer shard, RNG); None: nothing per rank.
        ranks: the rank context (`lazytrain.train.rank`); default one process.
        export_dtype: dtype of the HF weights (`model.dtype`); None: the masters' own. Narrower
            than a master: the masters also go into `MASTERS_FILE` (`--resume` reads them).
        keep: valid checkpoints kept, >= 1 (`train.keep_checkpoints`); older ones are deleted.
        before_marker: test hook, main rank, called with the temp directory after every file
            but the marker is written (raise there to simulate a crash mid-save).

    Returns:
        The new checkpoint (on every rank).

    Raises:
        OSError, SafetensorError: the disk is full or unwritable; the temp directory is removed
            and the previous checkpoints are untouched. RuntimeError: a peer rank died.
    """
    root = checkpoints_dir(run_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}"
    if ranks.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    ranks.barrier()
    if ranks.world_size == 1 and shard is not None:
        state, shard = {**state, **shard}, None
    try:
        if shard is not None:
            _torch_save(shard, tmp / shard_name(ranks.rank))
            _fsync(tmp / shard_name(ranks.rank))
        if ranks.is_main:
            write_model_files(tmp, weights=weights, hf_config=hf_config, tokenizer=tokenizer,
                              dtype=export_dtype)
            if _narrows(weights, export_dtype):
                save_hf_dir(weights, tmp, prefix=MASTERS_PREFIX)
            _torch_save({**state, "world_size": ranks.world_size}, tmp / STATE_FILE)
        ranks.barrier()  # every shard is on disk
        if ranks.is_main:
            _commit(tmp, final, step=step, world_size=ranks.world_size, keep=keep,
                    before_marker=before_marker)
    except BaseException:
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    ranks.barrier()  # nobody reads or writes the run directory before the rename
    return Checkpoint(path=final, step=step)


def _torch_save(obj: Any, path: Path) -> None:
    """`torch.save` into a file opened here: a failed write raises its OSError (ENOSPC, with
    `filename` set), where torch's own file writer says "[enforce fail at
    inline_container.cc] unexpected pos". Its zip writer says that even when the Python file's
    write raised (a disk that fills mid-file): the OSError it was handling is raised instead."""
    try:
        with open(path, "xb") as fh:  # a fresh temp directory: nothing to follow or replace
            torch.save(obj, fh)
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise
    except RuntimeError as exc:
        cause = exc.__context__
        if not isinstance(cause, OSError):
            raise
        cause.filename = cause.filename or str(path)
        raise cause from None


def checkpoint_bytes_per_param(*, export_bytes: int, master_bytes: int) -> int:
    """Bytes one checkpoint takes per parameter: the exported weights (`export_bytes`, of
    `model.dtype`), the masters again when the export is narrower (`master_bytes`, written
    under `MASTERS_PREFIX`) and the AdamW moments (`contract.ADAM_MOMENT_BYTES`). fp32
    throughout: 4 + 8 = 12; bf16 export of fp32 masters: 2 + 4 + 8 = 14."""
    return (export_bytes + (master_bytes if master_bytes > export_bytes else 0)
            + ADAM_MOMENT_BYTES)


def _narrows(weights: dict[str, torch.Tensor], dtype: torch.dtype | None) -> bool:
    """True when exporting `weights` in `dtype` loses bits of some floating-point master."""
    return dtype is not None and any(t.is_floating_point() and t.element_size() > dtype.itemsize
                                     for t in weights.values())


def load_masters(checkpoint: Checkpoint, params) -> bool:
    """Copy the checkpoint's masters files (`MASTERS_PREFIX`, if any) into the host store
    `params` (`models.host_params.HostParams`), over the narrower `model.dtype` weights the
    adapter was loaded from, so a resume continues from the exact masters (one tensor in
    memory at a time). True when the checkpoint had them.

    Raises:
        KeyError: the files name a parameter the model does not have.
    """
    try:
        files = weight_files(checkpoint.path, prefix=MASTERS_PREFIX)
    except FileNotFoundError:
        return False
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                group, local = params.locate(name)
                group.master_views[local].copy_(f.get_tensor(name))
    return True


def _commit(tmp: Path, final: Path, *, step: int, world_size: int, keep: int,
            before_marker) -> None:
    """The main rank: fsync every file, digest it, write the marker last, rename, prune."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    for name in files:
        _fsync(tmp / name)
    digests = {name: file_digest(tmp / name) for name in files}
    if before_marker is not None:
        before_marker(tmp)
    (tmp / MARKER).write_text(json.dumps({"step": step, "files": files, "xxh3": digests,
                                          "world_size": world_size}, indent=1))
    _fsync(tmp / MARKER)
    _fsync(tmp)
    if final.exists():  # a stale or invalid directory of the same step (resumed run)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(final.parent)
    _prune(final.parent, newest=final, keep=keep)


def load_shard(checkpoint: Checkpoint, ranks: RankContext, *,
               state: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's own state in `checkpoint` (what `save_checkpoint` got as `shard`): for one
    process `state`, the loaded trainer state that holds it; else this rank's shard file,
    loaded with `weights_only=True` (the world size was checked against the job before
    planning: `check_world_size`).

    Raises:
        CheckpointError: the shard is missing, damaged, or holds objects other than tensors
            and plain containers (nothing in it is executed).
    """
    if ranks.world_size == 1 and state is not None:
        return state
    return load_torch_file(checkpoint.path / shard_name(ranks.rank))


def check_world_size(checkpoint: Checkpoint, *, world_size: int) -> None:
    """Refuse a checkpoint written by another number of ranks (its marker says how many).

    Raises:
        ValueError: names the checkpoint, both world sizes and the torchrun fix.
    """
    saved = json.loads((checkpoint.path / MARKER).read_text()).get("world_size") or 1
    if saved != world_size:
        raise ValueError(
            f"checkpoint {checkpoint.path} was written by {saved} rank(s); this job has "
            f"{world_size}: resume with the same world size (e.g. torchrun "
            f"--nproc_per_node {saved} -m lazytrain.cli.main train --resume RUN_DIR)")


def write_model_files(directory: Path, *, weights: dict[str, torch.Tensor], hf_config: Any,
                      tokenizer: Any, dtype: torch.dtype | None = None) -> None:
    """The HF model part of a checkpoint: safetensors in `dtype` (`model.dtype`; None: as the
    masters are), config.json (its `dtype` that of the written weights), generation_config.json
    and the tokenizer.

    Raises:
        OSError, SafetensorError: a write failed (the caller removes the directory).
    """
    save_hf_dir(weights, directory, dtype=dtype)
    dtypes = ({dtype} if dtype is not None else
              {t.dtype for t in weights.values() if t.is_floating_point()})
    config = copy.deepcopy(hf_config)
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()  # what from_pretrained(dtype="auto") should load
    config.save_pretrained(directory)
    generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _prune(root: Path, *, newest: Path, keep: int) -> None:
    """Delete temp leftovers, invalid step directories and all but the newest `keep` valid."""
    valid = list_checkpoints(root.parent)
    keep_names = {c.path.name for c in valid[-keep:]} | {newest.name}
    for child in root.iterdir():
        stale_tmp = child.name.startswith(".tmp-")  # the new one is renamed already
        if child.is_dir() and (stale_tmp or (_NAME_RE.match(child.name)
                                             and child.name not in keep_names)):
            shutil.rmtree(child, ignore_errors=True)
