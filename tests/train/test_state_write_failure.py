"""A write that fails in the middle of `trainer_state.pt` (a disk that fills while torch's zip
writer streams the state) is the OSError that stopped it, naming the file: torch's writer turns
it into "[enforce fail at inline_container.cc] unexpected pos", which named neither.

The failure is real, not mocked: RLIMIT_FSIZE makes the kernel refuse writes past 100 kB
(EFBIG, as ENOSPC refuses them on a full disk) after the first bytes went through."""

from __future__ import annotations

import errno
import resource
import signal

import pytest
import torch

from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import _save_failure_cause


@pytest.fixture
def writes_stop_at_100_kb():
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_write_failing_mid_state_names_trainer_state_pt(tmp_path, writes_stop_at_100_kb):
    path = tmp_path / ckpt.STATE_FILE
    with pytest.raises(OSError) as info:
        ckpt._torch_save({"moments": torch.zeros(400_000)}, path)  # 1.6 MB > 100 kB
    assert info.value.errno == errno.EFBIG and info.value.filename == str(path)
    assert "unexpected pos" not in str(info.value)
    assert _save_failure_cause(info.value, tmp_path).startswith("writing trainer_state.pt: ")


def test_a_failed_first_save_does_not_point_at_a_resume_with_nothing_to_resume(tmp_path):
    from lazytrain.train.loop import CheckpointSaveError, save_errors

    with pytest.raises(CheckpointSaveError) as info:
        with save_errors(tmp_path, step=1):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    assert "--resume" not in str(info.value) and "--overwrite" in str(info.value)
