"""Atomic file writes: a temp file in the target's folder, fsync, then os.replace.

The one implementation every writer of the project uses (configs, hardware files, plans, Gantt
PNGs, safetensors shards), so a crash or Ctrl-C never leaves a half-written file under the real
name. Imports neither torch nor a solver.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
