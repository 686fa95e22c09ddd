"""The default job's task and metric: the embedded problems are what synthetic.py promises
(checked by re-doing the arithmetic from the story text alone), and the exact-match grader
scores hand-written generations as a person would."""

from __future__ import annotations

import re

import pytest

from lazytrain.data.formats import Example, Message
from lazytrain.data.synthetic import MAX_OPERAND, MAX_START, NUM_STEPS, arithmetic_dataset
from lazytrain.train.evaluate import EvalResult, grade, sample_lines

ADD = re.compile(r"(?:buys|gives \w+|finds) (\d+)")
SUB = re.compile(r"(?:gives away|loses|uses) (\d+)")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_story_alone_determines_the_answer_with_small_one_digit_steps(seed):
    train, held = arithmetic_dataset(num_train=300, num_eval=16, seed=seed)
    for ex in train + held:
        sentences = ex.messages[0].content.split(". ")
        total = int(re.search(r"has (\d+)", sentences[0]).group(1))
        assert 3 <= total <= MAX_START
        steps = 0
        for sentence in sentences[1:]:
            if (m := SUB.search(sentence)) is not None:  # before ADD: "gives away" vs "gives"
                total -= int(m.group(1))
            elif (m := ADD.search(sentence)) is not None:
                total += int(m.group(1))
            else:
                continue
            steps += 1
            assert 1 <= int(m.group(1)) <= MAX_OPERAND and total >= 1
        assert steps == NUM_STEPS
        assert ex.answer == str(total)
        assert ex.messages[1].content.endswith(f"#### {total}")


def _ex(answer: str) -> Example:
    return Example(messages=(Message(role="user", content="q"),
                             Message(role="assistant", content=f"#### {answer}", train=True)),
                   answer=answer)


def test_the_grader_scores_generations_as_a_person_would():
    texts = ["Maya starts with 12 shells.\n12 + 7 = 19.\n19 - 5 = 14.\n#### 14",  # right
             "12 + 7 = 19.\n19 - 5 = 15.\n#### 15",                                # wrong
             "She has 19 - 5 = 14 shells left, so 14.",       # no marker: last number, right
             "#### 1,400.00",                                  # formatting normalized, right
             "I do not know.",                                 # no answer at all
             "#### 14\n#### 13"]                               # the last marker counts: wrong
    examples = [_ex("14"), _ex("14"), _ex("14"), _ex("1400"), _ex("14"), _ex("14")]
    predicted, correct = grade(texts, examples)
    assert predicted == ["14", "15", "14", "1400", None, "13"]
    assert correct == 3


def test_the_sample_lines_show_question_generation_and_verdict():
    result = EvalResult(loss=0.5, exact_match=0.5, num_examples=2, num_scored=2, num_correct=1,
                        samples=({"prompt": "Ava has 3 apples. How many?", "answer": "3",
                                  "generated": "3 + 0 = 3.\n#### 3", "predicted": "3"},))
    assert sample_lines("after", result) == [
        "sample after: Ava has 3 apples. How many?",
        "  model wrote: 3 + 0 = 3. / #### 3  -> 3 (expected 3: right)"]
    assert sample_lines("before", EvalResult(loss=None, exact_match=None, num_examples=0,
                                             num_scored=0)) == []
