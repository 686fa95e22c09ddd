"""The lm-eval model over a `StreamedLM` scores local tasks as lm-eval's own HF backend does.

Reference: lm-eval's `HFLM` on the same weights (a tiny Llama fitted on the tasks' lines, so
greedy answers, stop strings and greedy continuations occur). The model under test runs on a
plain-HF stand-in with `StreamedLM`'s interface (tests/lm_eval_fixtures.py), so this checks the
lm-eval side alone: tokenization, windows, greedy checks, stops and metrics. A `max_length` of
32 tokens makes the rolling task span several windows and cuts long contexts from the left.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval", reason="lazytrain eval needs the eval extra (lm-eval)")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lazytrain.evaluation.lm_eval_model import StreamedEvalLM  # noqa: E402
from lm_eval_fixtures import (QUESTIONS, TASK_NAMES, HFStandIn, fitted_model_dir,  # noqa: E402
                              write_local_tasks)

pytestmark = pytest.mark.slow

MAX_LENGTH = 32  # tokens; below the rolling passages' length and the longest contexts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fitted_model_dir(tmp_path_factory.mktemp("fitted"))


def _evaluate(model, include_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        return simple_evaluate(model=model, tasks=list(TASK_NAMES), log_samples=True,
                               task_manager=TaskManager(include_path=str(include_path),
                                                        include_defaults=False))


@pytest.fixture(scope="module")
def both(model_dir, tmp_path_factory):
    """(ours, lm-eval's HF backend): simple_evaluate's results on the four local tasks."""
    tasks = write_local_tasks(tmp_path_factory.mktemp("tasks"))
    # lm-eval's max_length is one below the model's: a scored window must fit its positions
    ours = _evaluate(StreamedEvalLM(HFStandIn(model_dir, max_length=MAX_LENGTH + 1),
                                    batch_size=3),
                     tasks)
    reference = _evaluate(HFLM(pretrained=str(model_dir), device="cpu", dtype="float32",
                               batch_size=1, max_length=MAX_LENGTH), tasks)
    return ours, reference


def _responses(result, task):
    return [sample["resps"] for sample in result["samples"][task]]


@pytest.mark.parametrize("task, metric", [("local_mc", "acc,none"), ("local_mc", "acc_norm,none"),
                                          ("local_ll", "acc,none"),
                                          ("local_gen", "exact_match,none")])
def test_scores_equal_lm_evals_hf_backend(both, task, metric):
    ours, reference = both
    assert ours["results"][task][metric] == reference["results"][task][metric]


@pytest.mark.parametrize("task, metric", [("local_ll", "perplexity,none"),
                                          ("local_rolling", "word_perplexity,none"),
                                          ("local_rolling", "bits_per_byte,none")])
def test_likelihood_metrics_are_close_to_lm_evals_hf_backend(both, task, metric):
    ours, reference = both
    assert ours["results"][task][metric] == pytest.approx(reference["results"][task][metric],
                                                          rel=1e-5)


@pytest.mark.parametrize("task", ["local_mc", "local_ll"])
def test_every_loglikelihood_and_greedy_flag_matches(both, task):
    ours, reference = both
    mine, theirs = _responses(ours, task), _responses(reference, task)
    flat_mine = [answer for doc in mine for choice in doc for answer in choice]
    flat_theirs = [answer for doc in theirs for choice in doc for answer in choice]
    assert [greedy for _, greedy in flat_mine] == [greedy for _, greedy in flat_theirs]
    assert [ll for ll, _ in flat_mine] == pytest.approx([ll for ll, _ in flat_theirs], abs=1e-4)


def test_the_fitted_model_exercises_both_greedy_outcomes(both):
    """Guards the comparison above: with only False flags it would not test the greedy check."""
    flags = [answer[1] for task in ("local_mc", "local_ll") for doc in _responses(both[1], task)
             for choice in doc for answer in choice]
    assert True in flags and False in flags


def test_generations_equal_lm_evals_hf_backend_and_stop_at_the_until_strings(both):
    ours, reference = both
    texts = [sample["filtered_resps"][0] for sample in ours["samples"]["local_gen"]]
    assert texts == [sample["filtered_resps"][0] for sample in reference["samples"]["local_gen"]]
    assert all(text.strip() and "\n" not in text for text in texts)


class _Recording(HFStandIn):
    """The stand-in, recording each `generate` call's keyword arguments."""

    calls: list

    def generate(self, prompts, **kwargs):
        self.calls.append({"prompts": len(prompts), **kwargs})
        return super().generate(prompts, **kwargs)


def _requests(*gen_kwargs: dict) -> list[Instance]:
    return [Instance(request_type="generate_until", doc={}, idx=0,
                     arguments=("Question: 2 + 3 = ? Answer:", kwargs)) for kwargs in gen_kwargs]


def test_sampling_kwargs_reach_generate_with_one_seed_per_request(model_dir):
    lm = _Recording(model_dir)
    lm.calls = []
    sampled = {"until": ["\n"], "do_sample": True, "temperature": 0.7, "top_p": 0.9,
               "max_new_tokens": 3}
    StreamedEvalLM(lm, seed=10).generate_until(_requests(sampled, sampled, {"until": ["\n"]}))
    assert [(c["temperature"], c["top_p"], c["max_new_tokens"], c["seed"]) for c in lm.calls] == \
        [(0.7, 0.9, 3, 10), (0.7, 0.9, 3, 11), (0.0, 1.0, 256, 12)]


def test_a_generation_kwarg_it_cannot_honour_is_refused_naming_it(model_dir):
    with pytest.raises(ValueError, match=r"^generation_kwargs: \['top_k'\] not supported"):
        StreamedEvalLM(HFStandIn(model_dir)).generate_until(_requests({"top_k": 5}))


def test_greedy_flags_equal_the_argmax_at_every_position(model_dir):
    """Reference: the HF model's argmax at each continuation position (the flag's definition),
    over greedy continuations, ones changed at the first or the last token, and in batches
    that mix them (the batched decode stops each row at its own first difference)."""
    lm = HFStandIn(model_dir)
    requests = []
    for question, _ in QUESTIONS[:4]:
        context = lm.tokenizer.encode(f"Question: {question} = ? Answer:")
        greedy = lm.generate([context], max_new_tokens=3)[0]
        other = (greedy[-1] + 7) % len(lm.tokenizer)
        requests += [(None, context, greedy), (None, context, greedy[:-1] + [other]),
                     (None, context, [other] + greedy[1:]), (None, context, greedy[:1])]
    expected = []
    for _, context, continuation in requests:
        with torch.no_grad():
            logits = lm.model(torch.tensor([context + continuation])).logits[0]
        picks = logits[len(context) - 1:-1].argmax(-1).tolist()
        expected.append(picks == continuation)
    flags = [greedy for _, greedy in StreamedEvalLM(lm, batch_size=5)._loglikelihood_tokens(
        requests)]
    assert flags == expected
    assert expected.count(True) >= 4 and expected.count(False) >= 4
