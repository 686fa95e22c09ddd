"""NVMe tier: aligned chunked I/O (O_DIRECT and buffered), the tmpfs warning, and faults (ENOSPC,
short read, missing file) surfacing as NvmeIOError naming boundary and path, with no
scratch file left behind."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.errors import NvmeIOError
from lazytrain.runtime.filesystem import filesystem_type, warn_if_ram_filesystem
from lazytrain.runtime.nvme import (
    ALIGN_BYTES,
    FaultInjector,
    IoEvent,
    NvmeIO,
    aligned_empty,
    supports_o_direct,
)

CPU = torch.device("cpu")
SMALL_CHUNK_BYTES = 8192
REPO_SRC = Path(__file__).resolve().parents[2] / "src"


def direct_modes():
    return [pytest.param(False, id="buffered"), pytest.param(True, id="o_direct")]


def require_direct(direct: bool, path: Path) -> None:
    if direct and not supports_o_direct(path):
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 100_001])
def test_aligned_empty_returns_a_4kib_aligned_buffer_of_the_requested_length(nbytes):
    buf = aligned_empty(nbytes)
    assert buf.numel() == nbytes and buf.data_ptr() % ALIGN_BYTES == 0 and buf.is_contiguous()


@pytest.mark.parametrize("direct", direct_modes())
def test_nvme_io_round_trips_aligned_chunks_at_an_offset(tmp_path, direct):
    require_direct(direct, tmp_path)
    nbytes = 5 * ALIGN_BYTES  # 3 requests of 8 KiB, 8 KiB, 4 KiB
    src = aligned_empty(nbytes)
    src.copy_(random_bytes(nbytes))
    dst = aligned_empty(nbytes)
    io = NvmeIO(tmp_path, chunk_bytes=SMALL_CHUNK_BYTES, direct=direct)
    try:
        assert io.direct == direct
        futures = io.write((3, 0), src, ALIGN_BYTES)
        assert len(futures) == 3
        io.wait(futures)
        io.finish_write((3, 0))
        assert io.path_for((3, 0)).stat().st_size == ALIGN_BYTES + nbytes
        io.wait(io.read((3, 0), dst, ALIGN_BYTES))
        assert torch.equal(dst, src)
    finally:
        io.close()
    assert list(tmp_path.iterdir()) == []


def test_nvme_io_refuses_a_misaligned_buffer_under_o_direct(tmp_path):
    require_direct(True, tmp_path)
    io = NvmeIO(tmp_path, direct=True)
    try:
        misaligned = aligned_empty(2 * ALIGN_BYTES)[1 : 1 + ALIGN_BYTES]
        with pytest.raises(ValueError, match="aligned"):
            io.write((0, 0), misaligned, 0)
    finally:
        io.close()


def test_filesystem_type_uses_the_longest_mount_prefix(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\nnone /scratch\\040x ext4 rw 0 0\n")
    assert filesystem_type("/scratch/run/nvme", mounts_path=mounts) == "tmpfs"
    assert filesystem_type("/scratchy", mounts_path=mounts) == "ext4"
    assert filesystem_type("/scratch x/a", mounts_path=mounts) == "ext4"


def test_nvme_dir_on_tmpfs_warns_and_on_ext4_does_not(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path}/ram tmpfs rw 0 0\n")
    with pytest.warns(RuntimeWarning, match="tmpfs"):
        assert warn_if_ram_filesystem(tmp_path / "ram" / "nvme", mounts_path=mounts)
    assert not warn_if_ram_filesystem(tmp_path / "disk", mounts_path=mounts)


# ---- faults through the store ---------------------------------------------------------------


def offload(store: ActivationStore, boundary: int, *, micro_batch: int = 1) -> None:
    """Window f{boundary}: put a 20004-byte fp32 boundary (not a 4 KiB multiple) on nvme."""
    store.begin_window(f"f{boundary}")
    store.put(boundary, torch.arange(5001, dtype=torch.float32), "nvme", micro_batch=micro_batch)
    store.transfer(boundary, "d2h", 1.0, micro_batch=micro_batch)
    store.transfer(boundary, "nvme_write", 1.0, micro_batch=micro_batch)
    store.end_window()


def prefetch(store: ActivationStore, boundary: int, *, micro_batch: int = 1) -> None:
    store.begin_window(f"b{boundary + 1}")
    store.transfer(boundary, "nvme_read", 1.0, micro_batch=micro_batch)
    store.transfer(boundary, "h2d", 1.0, micro_batch=micro_batch)
    store.end_window()


def make_store(tmp_path: Path, direct: bool, faults: FaultInjector | None = None, *,
               device=CPU) -> ActivationStore:
    return ActivationStore(device=device, nvme_dir=tmp_path / "nvme", direct=direct,
                           chunk_bytes=SMALL_CHUNK_BYTES, fault_hook=faults)


@pytest.fixture(params=["cpu", "cpu-checked", "cpu-threaded"])
def device(request):
    """The failure paths on each backend: `cpu-checked` records no violation (nothing freed
    or reused under a running copy), `cpu-threaded` runs them with late copies and jobs."""
    dev = make_device(request.param, seed=8)
    yield dev
    dev.close()
    assert not getattr(dev, "violations", None), dev.violations[:1]


def assert_names_boundary_and_path(err: NvmeIOError, nvme_dir: Path) -> None:
    path = nvme_dir / "ckpt_b7_m1.bin"
    assert (err.boundary, err.micro_batch, err.path) == (7, 1, path)
    assert str(err).startswith("boundary 7 (micro-batch 1): NVMe ")
    assert str(path) in str(err)


@pytest.mark.parametrize("direct", direct_modes())
def test_disk_full_on_write_names_boundary_and_path_and_leaves_no_file(tmp_path, direct, device):
    require_direct(direct, tmp_path)
    faults = FaultInjector()
    faults.fail_next_write(boundary=7)
    store = make_store(tmp_path, direct, faults, device=device)
    with pytest.raises(NvmeIOError) as info:
        # the host does not wait for writes at their window's end (they wait for device work):
        # a failed one is raised at the first window end that finds it finished, at the latest
        # by its read-back, before any of its bytes are used
        offload(store, 7)
        prefetch(store, 7)
    store.close()
    assert_names_boundary_and_path(info.value, tmp_path / "nvme")
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device" in str(info.value)
    assert list((tmp_path / "nvme").iterdir()) == []


@pytest.mark.parametrize("direct", direct_modes())
def test_short_read_of_a_truncated_file_names_boundary_and_path_and_leaves_no_file(tmp_path, direct,
                                                                                 device):
    require_direct(direct, tmp_path)
    faults = FaultInjector()
    faults.truncate_next_read(boundary=7)
    store = make_store(tmp_path, direct, faults, device=device)
    offload(store, 7)
    with pytest.raises(NvmeIOError, match="short read") as info:
        prefetch(store, 7)
    store.close()
    assert_names_boundary_and_path(info.value, tmp_path / "nvme")
    assert list((tmp_path / "nvme").iterdir()) == []


@pytest.mark.parametrize("direct", direct_modes())
def test_missing_file_on_read_names_boundary_and_path(tmp_path, direct, device):
    require_direct(direct, tmp_path)
    faults = FaultInjector()
    faults.delete_before_next_read(boundary=7)
    with make_store(tmp_path, direct, faults, device=device) as store:
        offload(store, 7)
        with pytest.raises(NvmeIOError, match="No such file") as info:
            prefetch(store, 7)
    assert_names_boundary_and_path(info.value, tmp_path / "nvme")
    assert info.value.errno == errno.ENOENT
    assert list((tmp_path / "nvme").iterdir()) == []


def test_file_is_removed_on_release_and_the_rest_on_close(tmp_path):
    store = make_store(tmp_path, direct=False)
    offload(store, 7)
    offload(store, 8)
    store.wait_writes()
    nvme = tmp_path / "nvme"
    assert sorted(p.name for p in nvme.iterdir()) == ["ckpt_b7_m1.bin", "ckpt_b8_m1.bin"]
    # Padded to 4 KiB: 20004 B -> 20480 B on disk and in the accounting.
    assert (nvme / "ckpt_b7_m1.bin").stat().st_size == 20480
    assert store.bytes_by_tier()["nvme"] == 2 * 20480
    store.release(7, micro_batch=1)
    assert [p.name for p in nvme.iterdir()] == ["ckpt_b8_m1.bin"]
    store.close()
    assert list(nvme.iterdir()) == []


def test_an_exception_inside_the_with_block_removes_the_files(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with make_store(tmp_path, direct=False) as store:
            offload(store, 7)
            1 / 0
    assert list((tmp_path / "nvme").iterdir()) == []


def test_fault_hook_sees_every_open_and_chunk_and_delayed_reads_still_round_trip(tmp_path):
    events: list[IoEvent] = []
    faults = FaultInjector()
    faults.delay_reads(1.0)

    def hook(event: IoEvent) -> None:
        events.append(event)
        faults(event)

    store = ActivationStore(device=CPU, nvme_dir=tmp_path, direct=False,
                            chunk_bytes=SMALL_CHUNK_BYTES, fault_hook=hook)
    with store:
        offload(store, 7)
        prefetch(store, 7)
        assert torch.equal(store.get(7, micro_batch=1), torch.arange(5001, dtype=torch.float32))
    # 20480 padded bytes in 8 KiB requests: 3 writes and 3 reads, one open each.
    ops = sorted(e.op for e in events)
    assert ops == ["open_read", "open_write"] + ["read"] * 3 + ["write"] * 3


EXIT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import torch
    from lazytrain.runtime.activations import ActivationStore

    nvme_dir, mode = Path(sys.argv[1]), sys.argv[2]
    store = ActivationStore(device=torch.device("cpu"), nvme_dir=nvme_dir, direct=False)
    store.begin_window("f0")
    store.put(0, torch.ones(5000), "nvme")
    store.transfer(0, "d2h", 1.0)
    store.transfer(0, "nvme_write", 1.0)
    store.end_window()
    assert [p.name for p in nvme_dir.iterdir()] == ["ckpt_b0_m0.bin"]
    if mode == "ctrl_c_in_with":
        with store:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    elif mode == "ctrl_c":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    # mode "exit": leave without close(); atexit cleans up.
    """
)


@pytest.mark.slow  # one fresh interpreter (torch import) per mode: 3-6 s on a shared 2-core box
@pytest.mark.parametrize("mode", ["exit", "ctrl_c", "ctrl_c_in_with"])
def test_files_are_removed_when_the_interpreter_exits_or_gets_ctrl_c(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=f"{REPO_SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "nvme"), mode],
                          env=env, capture_output=True, text=True, timeout=60)
    assert "AssertionError" not in proc.stderr, proc.stderr
    if mode == "exit":
        assert proc.returncode == 0, proc.stderr
    else:
        assert "KeyboardInterrupt" in proc.stderr
    assert list((tmp_path / "nvme").iterdir()) == []


# ---- integrity: checksums and timeouts ------------------------------------------------------


def flip_bit_before_read(path_offset: int):
    """A fault hook that flips one bit of the file, at `path_offset`, before it is read."""
    def hook(event: IoEvent) -> None:
        if event.op == "open_read":
            with open(event.path, "r+b") as fh:
                fh.seek(path_offset)
                byte = fh.read(1)[0]
                fh.seek(path_offset)
                fh.write(bytes([byte ^ 0x10]))
    return hook


@pytest.mark.parametrize("direct", direct_modes())
def test_a_flipped_bit_on_the_drive_is_a_checksum_error_naming_the_extent(tmp_path, direct):
    require_direct(direct, tmp_path)
    store = make_store(tmp_path, direct, flip_bit_before_read(2 * ALIGN_BYTES + 17))
    offload(store, 7)  # 8 KiB write requests: byte 8209 is in the extent [8K, 16K)
    with pytest.raises(NvmeIOError, match=r"checksum mismatch \(xxh3-64\) of bytes "
                                                r"\[8192, 16384\) \(the 8192-byte extent "
                                                r"written at offset 8192\)") as info:
        prefetch(store, 7)
    store.close()
    assert_names_boundary_and_path(info.value, tmp_path / "nvme")
    assert list((tmp_path / "nvme").iterdir()) == []


def corrupt_byte(path: Path, offset: int) -> None:
    """Add 1 to the byte of `path` at `offset` (mod 256)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([(byte + 1) % 256]))


def written_file(io: NvmeIO, key, nbytes: int, offset: int = 0) -> torch.Tensor:
    """`nbytes` random bytes written to `key`'s file at `offset` (SMALL_CHUNK_BYTES requests)."""
    src = aligned_empty(nbytes)
    src.copy_(random_bytes(nbytes, seed=5))
    io.wait(io.write(key, src, offset))
    io.finish_write(key)
    return src


@pytest.mark.parametrize("direct", direct_modes())
@pytest.mark.parametrize("bad, extent", [(0, "[0, 8192)"), (8192 + 4095, "[8192, 16384)"),
                                         (16384 + 5000, "[16384, 24576)")])
def test_a_corrupted_byte_is_an_error_naming_the_write_extent_that_holds_it(tmp_path, direct,
                                                                            bad, extent):
    # three write requests of 8 KiB: extents [0, 8K), [8K, 16K), [16K, 24K)
    require_direct(direct, tmp_path)
    io = NvmeIO(tmp_path, chunk_bytes=SMALL_CHUNK_BYTES, direct=direct)
    try:
        written_file(io, (2, 1), 6 * ALIGN_BYTES)
        corrupt_byte(io.path_for((2, 1)), bad)
        with pytest.raises(NvmeIOError, match=re.escape(f"of bytes {extent} (the 8192-byte "
                                                        f"extent written at offset")) as info:
            io.wait(io.read((2, 1), aligned_empty(6 * ALIGN_BYTES), 0))
        assert info.value.boundary == 2 and info.value.micro_batch == 1
    finally:
        io.close()


@pytest.mark.parametrize("direct", direct_modes())
def test_a_read_ending_inside_an_extent_checks_that_whole_extent(tmp_path, direct):
    # the read [0, 12K) covers extent [8K, 16K) in part; the byte at 13000 lies outside the
    # read but inside that extent: the extent is read again whole and its digest differs
    require_direct(direct, tmp_path)
    io = NvmeIO(tmp_path, chunk_bytes=SMALL_CHUNK_BYTES, direct=direct)
    try:
        src = written_file(io, (3, 0), 6 * ALIGN_BYTES)
        dst = aligned_empty(6 * ALIGN_BYTES)
        io.wait(io.read((3, 0), dst[:3 * ALIGN_BYTES], 0))  # intact file: passes
        assert torch.equal(dst[:3 * ALIGN_BYTES], src[:3 * ALIGN_BYTES])
        corrupt_byte(io.path_for((3, 0)), 13000)
        with pytest.raises(NvmeIOError, match=re.escape("of bytes [8192, 16384)")):
            io.wait(io.read((3, 0), dst[:3 * ALIGN_BYTES], 0))
    finally:
        io.close()


def test_reads_are_cut_at_the_written_extents_boundaries(tmp_path):
    # written at 4 KiB in 8 KiB requests: extents [4K, 12K), [12K, 20K), [20K, 24K); a read of
    # [0, 24K) in 8 KiB requests from 0 would straddle every extent, so it is cut at them
    seen = []
    io = NvmeIO(tmp_path, chunk_bytes=SMALL_CHUNK_BYTES, direct=False,
                fault_hook=lambda e: seen.append((e.op, e.offset, e.nbytes)))
    try:
        src = written_file(io, (4, 0), 5 * ALIGN_BYTES, offset=ALIGN_BYTES)
        dst = aligned_empty(6 * ALIGN_BYTES)
        io.wait(io.read((4, 0), dst, 0))
        assert sorted(r[1:] for r in seen if r[0] == "read") == [
            (0, 4096), (4096, 8192), (12288, 8192), (20480, 4096)]
        assert torch.equal(dst[ALIGN_BYTES:], src)
    finally:
        io.close()


@pytest.mark.parametrize("direct", direct_modes())
def test_unchanged_files_pass_the_check_and_a_rewrite_replaces_the_digests(tmp_path, direct):
    require_direct(direct, tmp_path)
    nbytes = 6 * ALIGN_BYTES
    io = NvmeIO(tmp_path, chunk_bytes=SMALL_CHUNK_BYTES, direct=direct)
    try:
        for seed in (1, 2):  # the second write of the key truncates and rewrites the file
            src = aligned_empty(nbytes)
            src.copy_(random_bytes(nbytes, seed=seed))
            io.wait(io.write((1, 0), src, 0))
            io.finish_write((1, 0))
            dst = aligned_empty(nbytes)
            # read back in other splits than written: 4 KiB at 12 KiB, then the rest
            io.wait(io.read((1, 0), dst[3 * ALIGN_BYTES:4 * ALIGN_BYTES], 3 * ALIGN_BYTES))
            io.wait(io.read((1, 0), dst[:3 * ALIGN_BYTES], 0))
            io.wait(io.read((1, 0), dst[4 * ALIGN_BYTES:], 4 * ALIGN_BYTES))
            io.finish_read((1, 0))
            assert torch.equal(dst, src)
    finally:
        io.close()


def test_a_stuck_drive_is_a_timeout_error_naming_the_file_not_a_hang(tmp_path):
    from lazytrain.runtime.nvme import NvmeTimeoutError

    faults = FaultInjector()
    io = NvmeIO(tmp_path, chunk_bytes=SMALL_CHUNK_BYTES, direct=False, fault_hook=faults,
                timeout_s=0.2)
    src = aligned_empty(2 * ALIGN_BYTES)
    try:
        io.wait(io.write((4, 0), src, 0))
        io.finish_write((4, 0))
        faults.delay_reads(3000)  # the drive answers after 3 s, 15x the timeout
        with pytest.raises(NvmeTimeoutError, match=r"runtime\.nvme_timeout_s=0\.2 s") as info:
            io.wait(io.read((4, 0), aligned_empty(2 * ALIGN_BYTES), 0))
        assert info.value.boundary == 4 and info.value.path == io.path_for((4, 0))
        assert isinstance(info.value, NvmeIOError)
    finally:
        io.close()
