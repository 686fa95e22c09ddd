"""Fixtures of the data-parallel tests: one tiny model directory per session."""

from __future__ import annotations

import pytest

from dist_helpers import tiny_model_dir


@pytest.fixture(scope="session")
def dp_model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("dp_tiny_llama"))
