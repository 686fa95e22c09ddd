"""Fixtures for the CLI tests: a finished tiny run whose model answers the local tasks' lines."""

from __future__ import annotations

import pytest

from lm_eval_fixtures import fitted_model_dir, trained_run


@pytest.fixture(scope="session")
def fitted_run(tmp_path_factory):
    """A one-step run from a tiny Llama fitted on the local tasks' lines (its checkpoint has
    the chatml template lazytrain saves for a template-less tokenizer)."""
    model_dir = fitted_model_dir(tmp_path_factory.mktemp("fitted"))
    return trained_run(model_dir, tmp_path_factory.mktemp("fitted_run") / "run")
