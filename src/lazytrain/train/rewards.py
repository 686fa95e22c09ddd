"""GRPO rewards: what a completion of a prompt is worth, as a float.

Owns the built-in reward functions and the lookup of `grpo.rewards` names, built-in or a
user's function named by import path. A reward function has the signature

    fn(completion: str, *, prompt: str, answer: str | None) -> float

`completion` is the generated text (special tokens dropped), `prompt` the last user turn,
`answer` the example's normalized reference answer (`data.normalize_answer`; None when the
example has none). The rewards of a rollout are summed over the names in `grpo.rewards`.

Built-ins (`BUILTIN_REWARDS`):

- `exact_match`: 1.0 when the completion's final answer equals the reference, else 0.0. The
  final answer is read as the held-out exact match reads it (`data.extract_final_answer`:
  after the last `####`, else after `The answer is:`, else the last number), so the reward and
  the evaluation's exact match agree on every completion.
- `format`: 1.0 when a line of the completion is the answer line `#### <number>` (the GSM8K
  convention of the embedded arithmetic problems, `data/synthetic.py`), else 0.0.
- `math_verify`: 1.0 when Hugging Face's math-verify package finds the completion's answer
  mathematically equal to the reference (`1/2` equals `0.5`, LaTeX or plain), else 0.0; needs
  the `math` extra (`pip install -e '.[math]'`).

Knows nothing of the engine, plans or tokenizers.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, Protocol

from lazytrain.data import extract_final_answer


class RewardFn(Protocol):
    """A reward function (module docstring)."""

    def __call__(self, completion: str, *, prompt: str, answer: str | None) -> float: ...


ANSWER_LINE = re.compile(r"^\s*####\s*-?[\d,]*\.?\d+\s*$", re.MULTILINE)
"""The answer line of a worked GSM8K-style answer: `#### 14` (sign, commas, decimals allowed)."""


def exact_match(completion: str, *, prompt: str, answer: str | None) -> float:
    """1.0 when `extract_final_answer(completion)` equals `answer`, else 0.0 (also when the
    example has no reference answer)."""
    predicted = extract_final_answer(completion)
    return float(answer is not None and predicted is not None and predicted == answer)


def format_reward(completion: str, *, prompt: str, answer: str | None) -> float:
    """1.0 when some line of `completion` is the answer line `#### <number>`, else 0.0."""
    return float(ANSWER_LINE.search(completion) is not None)


def math_verify_reward(completion: str, *, prompt: str, answer: str | None) -> float:
    """1.0 when math-verify finds the completion's answer equal to `answer`, else 0.0.

    The completion's `#### N` tail is read first when it has one (math-verify's own
    extraction looks for LaTeX and the last expression); parsing and comparison run without
    math-verify's signal-based timeout, which works only on the main thread.

    Raises:
        ImportError: math-verify is not installed (names the extra that installs it).
    """
    try:
        from math_verify import parse, verify  # lazy: optional `math` extra, only this reward
    except ImportError:
        raise ImportError("grpo.rewards: math_verify needs the math-verify package; install "
                          "it with pip install -e '.[math]'") from None
    if answer is None:
        return 0.0
    text = completion.rsplit("####", 1)[1] if "####" in completion else completion
    gold = parse(answer, parsing_timeout=None)
    target = parse(text, parsing_timeout=None)
    return float(bool(gold) and bool(target) and verify(gold, target, timeout_seconds=None))


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "format": format_reward,
    "math_verify": math_verify_reward,
}
"""`grpo.rewards` name -> built-in reward function."""


def load_reward(name: str) -> RewardFn:
    """The reward function `name`: a built-in (`BUILTIN_REWARDS`) or `module:function`, a
    function imported from an importable module (on `sys.path`, e.g. a file `my_rewards.py` in
    the working directory: `my_rewards:length_penalty`).

    Raises:
        ValueError: `name` is neither a built-in nor `module:function`, the module cannot be
            imported, or it has no callable of that name (each names `grpo.rewards` and the fix).
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"grpo.rewards: {name!r} is not a built-in reward "
                         f"({', '.join(BUILTIN_REWARDS)}) nor module:function (e.g. "
                         f"my_rewards:length_penalty)")
    try:
        module = importlib.import_module(module_name)  # lazy: the user's grpo.rewards module
    except ImportError as exc:
        raise ValueError(f"grpo.rewards: {name!r}: cannot import module {module_name!r} "
                         f"({exc}); put it on PYTHONPATH or in the working directory") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"grpo.rewards: {name!r}: module {module_name!r} has no function "
                         f"{attr!r}; name a callable fn(completion, *, prompt, answer) -> float")
    return fn


def score(fns: list[RewardFn], completions: list[str], *, prompts: list[str],
          answers: list[str | None]) -> list[float]:
    """The summed reward of each completion over `fns` (one float per completion).

    Raises:
        TypeError: a reward function returned something that is not a real number (names it).
    """
    out = []
    for text, prompt, answer in zip(completions, prompts, answers):
        total = 0.0
        for fn in fns:
            value = fn(text, prompt=prompt, answer=answer)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                value = _as_float(fn, value)
            total += float(value)
        out.append(total)
    return out


def _as_float(fn, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"grpo.rewards: {getattr(fn, '__name__', fn)!r} returned "
                        f"{type(value).__name__} {value!r}; a reward function returns a float"
                        ) from None
