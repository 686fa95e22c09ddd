"""Shared fixtures: the path to `../shared` (real data and configs), never copied into the repo."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _find_shared() -> Path | None:
    # CI clones the repo as `main/` with `shared/` beside it; developers have the same layout.
    for candidate in (REPO_ROOT.parent / "shared", REPO_ROOT / "shared"):
        if (candidate / "DESIGN.md").exists() or (candidate / "models").is_dir():
            return candidate
    return None


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """`../shared` beside the checkout; skips the test with a reason when it is absent."""
    found = _find_shared()
    if found is None:
        pytest.skip("../shared (real HF configs and datasets) is not beside this checkout")
    return found


@pytest.fixture(autouse=True)
def calibration_off(monkeypatch):
    """No test calibrates or reads the user's calibration cache: `LAZYTRAIN_CALIBRATE=off`
    overrides `runtime.calibrate: auto` (inherited by CLI subprocesses). The calibration tests
    delete it with `monkeypatch.delenv` and point `runtime.calibration_dir` at `tmp_path`."""
    monkeypatch.setenv("LAZYTRAIN_CALIBRATE", "off")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (for shipped configs under configs/)."""
    return REPO_ROOT


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where torch sees a CUDA device; elsewhere they are skipped
    with the reason (CI on CPU deselects them with -m "not gpu" as well)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id "gpu"
            item.add_marker(skip)
