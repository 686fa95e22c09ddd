"""Which filesystem a directory lives on, read from the mount table, and the warning when the
NVMe tier's directory would really be in RAM (tmpfs, ramfs).

Owns the mount-table lookup only; knows nothing about files the runtime writes
(`runtime/nvme.py` calls the warning when it opens its directory).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystem types that live in RAM: an NVMe tier there would really be a DRAM tier."""


def filesystem_type(path: Path | str, *, mounts_path: Path | str = "/proc/mounts") -> str | None:
    """Type of the filesystem holding ``path`` ("ext4", "tmpfs", ...), from the mount table.

    The mount point is the longest entry of ``mounts_path`` that is a prefix of the resolved
    path. Returns None when the table cannot be read (non-Linux).
    """
    try:
        lines = Path(mounts_path).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts escapes space, tab, newline and backslash as octal (\040 ...).
        mount = fields[1].encode().decode("unicode_escape")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, fields[2]
    return best_type


def warn_if_ram_filesystem(directory: Path, *, mounts_path: Path | str = "/proc/mounts") -> bool:
    """Warn (RuntimeWarning) when ``directory`` is on tmpfs/ramfs; returns whether it warned."""
    fs = filesystem_type(directory, mounts_path=mounts_path)
    if fs in RAM_FILESYSTEMS:
        warnings.warn(
            f"runtime.nvme_dir {directory} is on {fs}, which lives in RAM: the NVMe tier would "
            "use DRAM, not a drive. Point runtime.nvme_dir at a directory on an NVMe drive.",
            RuntimeWarning,
            stacklevel=3,
        )
        return True
    return False
