"""Crash-safe files: atomic writes, append-only JSON-lines logs (their writer and reader), and
folders and files that another user of a shared directory cannot redirect through a symlink.

Atomic writes go to a temp file in the target's folder, fsync, then os.replace: the one
implementation every writer of the project uses (configs, hardware files, plans, Gantt PNGs,
safetensors shards), so a crash or Ctrl-C never leaves a half-written file under the real name.

The run logs (`windows.jsonl`, `metrics.jsonl`) are appended a line at a time instead, so a crash
can leave one torn last line; `read_jsonl` is the one reader of them, and skips it.

Files the project creates in place (the logs, lock files, NVMe-tier files) are opened with
`O_NOFOLLOW`: a symlink planted under their name is refused (ELOOP), never followed to
overwrite its target. `private_dir` is the folder check for directories others may write into
(a shared `runtime.nvme_dir`).

Imports neither torch nor a solver.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on a clean exit it is fsynced and renamed onto `path`.

    The caller writes the temp path however it likes (a library's save function, say). On an
    exception the temp file is removed and `path` is left as it was.

    Raises:
        OSError: the folder cannot be created or written (a failed write names `path`, and a
            full disk says so: `named_write_error`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:  # durable before it takes the real name
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise named_write_error(exc, path) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def named_write_error(exc: OSError, path: str | Path) -> OSError:
    """`exc` naming `path` when a failed `write()` left it nameless (a write names no file;
    the CLI's one line would say "[Errno 28] No space left on device" and nothing more), with
    the free bytes when the disk is full (ENOSPC). Any other error is returned as it is."""
    if type(exc) is not OSError or exc.errno is None or exc.filename is not None:
        return exc
    text = exc.strerror or os.strerror(exc.errno)
    if exc.errno == errno.ENOSPC:
        folder = Path(path).parent
        text += (f" (the disk is full: errno {errno.ENOSPC} ENOSPC, "
                 f"{shutil.disk_usage(folder).free} bytes free on {folder})")
    return OSError(exc.errno, text, str(path))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically and return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON (one space, a final newline) to `path` atomically and return
    the path. Values JSON has no type for (a Path, a dtype) are written as their `str`.

    Raises:
        ValueError: `obj` holds a circular reference (`path` is left as it was).
        OSError: the folder cannot be created or written.
    """
    return write_text_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of an append-only JSON-lines log, one dict per non-blank line, in file order.

    A crash mid-append leaves at most one torn line, the last one (a prefix of a record): it is
    skipped. Any other line that is not a JSON object means the file was damaged some other way,
    and is an error rather than a silently shorter history.

    Args:
        path: the log (`RUN_DIR/windows.jsonl`, `RUN_DIR/metrics.jsonl`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line before the last does not parse, or a line is JSON but no object
            (names the file and the line number).
    """
    path = Path(path)
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == lines[-1][0]:
                break  # torn by a crash mid-append
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg}) before the last line; the log is "
                             f"damaged: delete line {n} or the file") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: a JSON {type(record).__name__}, not an object; "
                             f"delete line {n} or the file")
        records.append(record)
    return records


def open_nofollow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)`: never through a symlink.

    Raises:
        OSError: `path` is a symlink (a one-line message naming it and the fix: remove the
            link); any other error of `os.open`.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise OSError(f"{path} is a symbolic link; lazytrain does not open its files through "
                      f"links someone else may have planted: remove it") from None


def open_append(path: str | Path) -> TextIO:
    """`path` opened for appending UTF-8 text (created when missing), never through a symlink:
    the writer of the append-only logs (`read_jsonl` reads them).

    Raises:
        OSError: as `open_nofollow`.
    """
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def append_jsonl(path: str | Path, records: list[dict]) -> None:
    """Append one JSON line per record to `path` (`open_append`).

    Raises:
        OSError: as `open_nofollow`; a failed write names `path` and says when the disk is
            full (`named_write_error`).
    """
    try:
        with open_append(path) as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in records))
    except OSError as exc:
        raise named_write_error(exc, path) from exc


def private_dir(path: str | Path, *, key: str) -> Path:
    """Create folder `path` with mode 0700 (its parents as usual) and check that it is one this
    user owns: in a directory others may write into (a shared `runtime.nvme_dir`), a name
    someone else can predict may already be theirs.

    Args:
        path: the folder.
        key: the config key that chose it, named in errors.

    Returns:
        `path` as a Path.

    Raises:
        OSError: `path` is a symlink, not a folder, or owned by another user (one line
            naming `key`, the owner and the fix), or it cannot be created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    fix = f"remove it, or set {key} to a directory only you can write"
    if stat.S_ISLNK(info.st_mode):
        problem = f"is a symbolic link (to {os.readlink(path)})"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"belongs to another user (uid {info.st_uid}; you are {os.getuid()})"
    else:
        return path
    raise OSError(f"{key}: {path} {problem}; refusing to put this job's files there: {fix}")
