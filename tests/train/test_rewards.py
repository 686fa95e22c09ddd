"""GRPO rewards on hand-written completions: the built-ins, a user's `module:function`, and one
clear error for a bad name."""

from __future__ import annotations

import sys

import pytest

from lazytrain.train.rewards import load_reward, score

WORKED = "Maya starts with 12 shells.\n12 + 7 = 19.\n19 - 5 = 14.\n#### 14"
WRONG = "Maya starts with 12 shells.\n12 + 7 = 19.\n19 - 5 = 15.\n#### 15"
NO_LINE = "She has 14 shells now."


@pytest.mark.parametrize("name,text,answer,expected", [
    ("exact_match", WORKED, "14", 1.0),
    ("exact_match", WRONG, "14", 0.0),
    ("exact_match", NO_LINE, "14", 1.0),  # the eval's grader: the last number, without ####
    ("exact_match", WORKED, None, 0.0),
    ("format", WORKED, "14", 1.0),
    ("format", WRONG, "14", 1.0),  # format only: a wrong answer line is still the line
    ("format", NO_LINE, "14", 0.0),
    ("format", "#### fourteen", "14", 0.0),
], ids=["em_right", "em_wrong", "em_last_number", "em_no_reference", "format_right",
        "format_wrong_answer", "format_missing", "format_not_a_number"])
def test_builtin_rewards_on_hand_written_completions(name, text, answer, expected):
    assert score([load_reward(name)], [text], prompts=["q"], answers=[answer]) == [expected]


def test_math_verify_checks_equal_values_in_other_forms():
    pytest.importorskip("math_verify")
    fn = load_reward("math_verify")
    assert fn("so the answer is $\\frac{1}{2}$", prompt="", answer="0.5") == 1.0
    assert fn("#### 14", prompt="", answer="14") == 1.0
    assert fn("#### 15", prompt="", answer="14") == 0.0
    assert fn("#### 14", prompt="", answer=None) == 0.0


def test_rewards_sum_over_names():
    fns = [load_reward("exact_match"), load_reward("format")]
    assert score(fns, [WORKED, WRONG, NO_LINE], prompts=["q"] * 3, answers=["14"] * 3) == \
        [2.0, 1.0, 1.0]


def test_user_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def length_penalty(completion, *, prompt, answer):\n"
        "    return -len(completion) / 100\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards_mod:length_penalty")
    assert score([fn], ["x" * 50], prompts=["q"], answers=["1"]) == [-0.5]
    sys.modules.pop("my_rewards_mod", None)


@pytest.mark.parametrize("name,fragment", [
    ("exact", "not a built-in reward"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("math:no_such_function", "has no function 'no_such_function'"),
    (":f", "not a built-in reward"),
], ids=["unknown_name", "missing_module", "missing_function", "empty_module"])
def test_a_bad_reward_name_is_one_error_naming_the_key(name, fragment):
    with pytest.raises(ValueError, match="grpo.rewards") as info:
        load_reward(name)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_reward_returning_text_is_refused_naming_it():
    def bad(completion, *, prompt, answer):
        return "yes"
    with pytest.raises(TypeError, match="'bad' returned str"):
        score([bad], ["x"], prompts=["q"], answers=["1"])
