"""Crash-safe files: atomic writes, and the reader of append-only JSON-lines logs.

Atomic writes go to a temp file in the target's folder, fsync, then os.replace: the one
implementation every writer of the project uses (configs, hardware files, plans, Gantt PNGs,
safetensors shards), so a crash or Ctrl-C never leaves a half-written file under the real name.

The run logs (`windows.jsonl`, `metrics.jsonl`) are appended a line at a time instead, so a crash
can leave one torn last line; `read_jsonl` is the one reader of them, and skips it.

Imports neither torch nor a solver.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on a clean exit it is fsynced and renamed onto `path`.

    The caller writes the temp path however it likes (a library's save function, say). On an
    exception the temp file is removed and `path` is left as it was.

    Raises:
        OSError: the folder cannot be created or written.
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
