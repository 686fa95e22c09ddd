"""lazytrain.atomic: the atomic writers leave the old file on failure; the JSON-lines reader skips
the one torn last line a crash mid-append leaves and refuses any other damage."""

from __future__ import annotations

import errno
import json
import os

import pytest

from lazytrain.atomic import atomic_path, read_jsonl, write_json_atomic, write_text_atomic

RECORDS = [{"step": 1, "micro_batch": 0, "windows": [{"name": "f0", "wall_ms": 2.5}]},
           {"step": 2, "micro_batch": 0, "windows": [{"name": "f0", "wall_ms": 3.0}]}]


def _log(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_a_torn_last_line_cut_mid_json_is_skipped(tmp_path):
    full = json.dumps({"step": 3, "micro_batch": 0, "windows": [{"name": "f0", "wall_ms": 1.0}]})
    torn = full[:len(full) // 2]  # the crash came in the middle of the third record
    path = _log(tmp_path / "windows.jsonl", RECORDS, tail=torn)
    assert read_jsonl(path) == RECORDS


def test_blank_lines_are_skipped_and_a_complete_last_line_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n\n  \n{"step": 2, "loss": 1.5}')  # no final \n
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def test_an_empty_log_has_no_records(tmp_path):
    assert read_jsonl(_log(tmp_path / "windows.jsonl", [])) == []


def test_a_damaged_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + '{"step": 2, "mic' + "\n"
                    + json.dumps(RECORDS[1]) + "\n")
    with pytest.raises(ValueError, match=r"windows.jsonl:2: not JSON .*delete line 2"):
        read_jsonl(path)


def test_a_json_value_that_is_no_object_is_refused(tmp_path):
    path = _log(tmp_path / "windows.jsonl", RECORDS, tail="[1, 2]\n")
    with pytest.raises(ValueError, match=r"windows.jsonl:3: a JSON list, not an object"):
        read_jsonl(path)


def test_a_missing_log_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "windows.jsonl")


def test_an_exception_inside_atomic_path_leaves_the_old_file_and_no_temp(tmp_path):
    path = write_text_atomic(tmp_path / "plan.json", "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_write_json_atomic_writes_paths_as_text_and_is_fsynced_before_the_rename(
        tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = write_json_atomic(tmp_path / "sub" / "summary.json",
                             {"run_dir": tmp_path, "loss": [2.5, 1.0]})
    assert path.read_text() == ('{\n "run_dir": "' + str(tmp_path) + '",\n "loss": [\n  2.5,\n'
                                '  1.0\n ]\n}\n')
    assert len(synced) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]


def test_write_json_atomic_leaves_the_old_file_when_the_object_cannot_be_written(tmp_path):
    path = write_json_atomic(tmp_path / "summary.json", {"step": 1})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular reference"):
        write_json_atomic(path, loop)
    assert json.loads(path.read_text()) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_full_disk_under_a_run_log_names_the_log_and_says_the_disk_is_full():
    """/dev/full refuses every write with ENOSPC, as a full disk does: the error names the log
    (a failed write() carries no file name of its own) and says the disk is full."""
    from lazytrain.atomic import append_jsonl

    with pytest.raises(OSError) as info:
        append_jsonl("/dev/full", RECORDS)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == "/dev/full"
    assert "the disk is full" in str(info.value) and "bytes free" in str(info.value)


def test_a_full_disk_under_an_atomic_write_names_the_file_and_leaves_the_old_one(
        tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(path), "write_text", full)
    with pytest.raises(OSError) as info:
        write_text_atomic(path, "new")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert "the disk is full" in str(info.value)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["summary.json"]
