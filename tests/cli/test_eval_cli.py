"""`lazytrain eval`: lm-eval tasks on a run's checkpoint through the streaming engine score as
lm-eval's own HF backend (`HFLM`) on the checkpoint's weights (the reference); the results JSON
is written whole; a missing lm-eval and an unknown task are one line each (exit 2)."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest

import lazytrain.evaluation
from lazytrain.cli.main import main
from lazytrain.train.checkpoint import latest_checkpoint
from lm_eval_fixtures import TASK_NAMES, write_local_tasks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_local_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def both(fitted_run, tasks_dir, tmp_path_factory):
    """(the results JSON `lazytrain eval` wrote, its stdout, HFLM's results) on the four local
    tasks."""
    lm_eval = pytest.importorskip("lm_eval", reason="lazytrain eval needs the eval extra")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    out = tmp_path_factory.mktemp("eval") / "results.json"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        with contextlib.redirect_stdout(stdout):
            code = main(["eval", str(fitted_run), "--tasks", ",".join(TASK_NAMES),
                         "--include-path", str(tasks_dir), "--output", str(out),
                         "--device", "cpu"])
        assert code == 0
        # HFLM's max_length is the model's 512 positions, ours 511 (a scored window must fit
        # them): no request of these tasks comes near either
        reference = lm_eval.simple_evaluate(
            model=HFLM(pretrained=str(latest_checkpoint(fitted_run).path), device="cpu",
                       dtype="float32", batch_size=1),
            tasks=list(TASK_NAMES),
            task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    return json.loads(out.read_text()), stdout.getvalue(), reference


@pytest.mark.parametrize("task, metric", [("local_mc", "acc,none"), ("local_mc", "acc_norm,none"),
                                          ("local_ll", "acc,none"),
                                          ("local_gen", "exact_match,none")])
def test_scores_equal_lm_evals_hf_backend_on_the_checkpoint(both, task, metric):
    ours, _, reference = both
    assert ours["results"][task][metric] == reference["results"][task][metric]


@pytest.mark.parametrize("task, metric", [("local_ll", "perplexity,none"),
                                          ("local_rolling", "word_perplexity,none"),
                                          ("local_rolling", "bits_per_byte,none")])
def test_likelihood_metrics_are_close_to_lm_evals_hf_backend(both, task, metric):
    ours, _, reference = both
    assert ours["results"][task][metric] == pytest.approx(reference["results"][task][metric],
                                                          rel=1e-4)


def test_the_fitted_checkpoint_scores_above_zero(both):
    """Guards the equalities above: all-zero scores would agree without testing much."""
    ours = both[0]["results"]
    assert ours["local_mc"]["acc,none"] > 0 and ours["local_gen"]["exact_match,none"] > 0


def test_the_table_names_every_task(both):
    table = both[1]
    assert all(f"|{name}" in table.replace(" ", "") for name in TASK_NAMES)


def test_an_unknown_task_is_one_line_naming_it(fitted_run, tasks_dir, capsys):
    pytest.importorskip("lm_eval", reason="lazytrain eval needs the eval extra")
    assert main(["eval", str(fitted_run), "--tasks", "local_mc,no_such_task",
                 "--include-path", str(tasks_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task(s) no_such_task;" in err


def test_without_lm_eval_it_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises
    for name in ("lm_eval_run", "lm_eval_model"):  # as if never imported
        monkeypatch.delitem(sys.modules, f"lazytrain.evaluation.{name}", raising=False)
        monkeypatch.delattr(lazytrain.evaluation, name, raising=False)
    assert main(["eval", str(tmp_path), "--tasks", "local_mc"]) == 2
    assert capsys.readouterr().err == ("error: lazytrain eval needs lm-eval (the eval extra): "
                                       "pip install -e '.[eval]'\n")
