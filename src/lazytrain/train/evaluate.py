"""Held-out evaluation: mean next-token loss and exact match of the final answer.

Runs through the streaming engine's weight path (`lazytrain.evaluation.StreamedLM`), in the
compute dtype (`train.compute_dtype`), with no second copy of the model: the loss over the
trained tokens of each held-out example from per-token log-probabilities, and, for examples
with a checkable answer (GSM8K `####`, arithmetic, MetaMathQA), greedy generation with a KV
cache from the prompt and a comparison of the extracted final answer. On the cpu backend with
masters in the compute dtype the blocks run on views of the masters; otherwise they stream
through two device slots, or stay resident when the run's decode plan says the weights fit.

Evaluation leaves the global RNG state as it found it (forked), so a run evaluated in the middle
trains exactly like one that is not. It runs with one torch thread (restored afterwards): greedy
generation is thousands of tiny ops, and on a shared 2-core machine every intra-op parallel
region waits for a descheduled sibling thread. Measured here (SmolLM2-135M, 8 prompts x 32 new
tokens, load average ~5): 16-22 s with 1 thread, 158 s with 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from lazytrain.contract import IGNORE_INDEX
from lazytrain.data import Example, encode, encode_prompt, extract_final_answer
from lazytrain.evaluation.streamed_lm import EVAL_WINDOW, StreamedLM
from lazytrain.units import GB

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
"""Compute dtype -> its `train.compute_dtype` name, for the eval line."""
MAX_NEW_TOKENS = {"arithmetic": 48}
"""Greedy generation length per data format, tokens; others use DEFAULT_MAX_NEW_TOKENS. The
arithmetic worked answers are at most 37 tokens with the SmolLM2 tokenizer (measured on 2,048
generated problems), plus the end-of-turn token."""
DEFAULT_MAX_NEW_TOKENS = 160


@dataclass(kw_only=True, frozen=True, slots=True)
class EvalResult:
    """One evaluation of the held-out set."""

    loss: float | None
    """Token-weighted mean next-token loss over the trained tokens; None: no examples."""
    exact_match: float | None
    """Fraction of answer-bearing examples whose generated final answer equals the reference;
    None when no example has a checkable answer."""
    num_examples: int
    num_scored: int
    """Examples with a checkable answer (the exact-match denominator)."""
    samples: tuple[dict, ...] = ()
    """The first 3 scored examples' {prompt (last user turn), answer, generated text, predicted
    answer}, for the summary; the same examples at every evaluation of a run."""
    num_correct: int = 0
    """Scored examples whose predicted answer equals the reference (exact-match numerator)."""
    loss_tokens: int = 0
    """Trained tokens the loss averages over (what a data-parallel evaluation sums)."""
    device_peak_bytes: int = 0
    """Device memory the ledger saw held during the evaluation (window "eval"), bytes."""
    h2d_bytes: int = 0
    """Weight bytes copied host-to-device by the evaluation (window "eval"), bytes."""
    dtype: str = ""
    """The compute dtype it ran in ("fp32" or "bf16": `train.compute_dtype`)."""

    def to_dict(self) -> dict:
        return asdict(self)


def eval_loss(lm: StreamedLM, examples: list[Example], *, seq_len: int) -> tuple[float, int]:
    """Summed loss of `examples` (truncated to seq_len; unusable ones dropped) and the number
    of trained tokens it sums over: minus the log-probability of every trained token (label !=
    IGNORE_INDEX).

    The labels of a trained token are the token itself (`data.encode`), so the log-probability
    of the sequence's next token is its loss term.
    """
    encoded = [e for e in (encode(lm.tokenizer, ex, seq_len=seq_len, overlong="truncate")
                           for ex in examples) if e is not None and len(e.input_ids) >= 2]
    total, count = 0.0, 0
    for e, logprobs in zip(encoded, lm.token_logprobs([list(e.input_ids) for e in encoded])):
        trained = torch.tensor(e.labels[1:]) != IGNORE_INDEX
        total -= float(logprobs[trained].sum())
        count += int(trained.sum())
    return total, count


def generate_answers(lm: StreamedLM, examples: list[Example], *,
                     max_new_tokens: int) -> list[str]:
    """Greedy continuations (decoded, special tokens dropped) of each example's prompt; each
    stops at one of `lm.eos_token_ids` (eos and the chat template's end-of-turn token:
    `data.stop_token_ids`)."""
    prompts = [encode_prompt(lm.tokenizer, ex) for ex in examples]
    new = lm.generate(prompts, max_new_tokens=max_new_tokens)
    return lm.tokenizer.batch_decode(new, skip_special_tokens=True)


def evaluate_heldout(lm: StreamedLM, examples: list[Example], *, seq_len: int,
                     data_format: str) -> EvalResult:
    """Loss and exact match of the model behind `lm` on `examples` (RNG state and thread count
    preserved)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _evaluate(lm, examples, seq_len=seq_len, data_format=data_format)
    finally:
        torch.set_num_threads(threads)


def _evaluate(lm: StreamedLM, examples: list[Example], *, seq_len: int,
              data_format: str) -> EvalResult:
    with torch.random.fork_rng(devices=[]):
        total, tokens = eval_loss(lm, examples, seq_len=seq_len) if examples else (0.0, 0)
        scored = [ex for ex in examples if ex.answer is not None]
        new_tokens = MAX_NEW_TOKENS.get(data_format, DEFAULT_MAX_NEW_TOKENS)
        texts = generate_answers(lm, scored, max_new_tokens=new_tokens) if scored else []
    predicted, hits = grade(texts, scored)
    samples = tuple({"prompt": ex.prompt_messages[-1].content, "answer": ex.answer,
                     "generated": t, "predicted": p}
                    for ex, t, p in list(zip(scored, texts, predicted))[:3])
    return EvalResult(loss=total / tokens if tokens else None,
                      exact_match=hits / len(scored) if scored else None,
                      num_examples=len(examples), num_scored=len(scored), samples=samples,
                      num_correct=hits, loss_tokens=tokens)


def evaluate_shared(lm: StreamedLM, examples: list[Example], *, rank: int, world_size: int,
                    all_sum: Callable[[float], float], seq_len: int,
                    data_format: str) -> EvalResult:
    """`evaluate_heldout` of this rank's share of `examples` (`share_of`), combined over the
    ranks (`combine`; one process: its own result), with the device bytes the ledger booked
    to the evaluation (`StreamedLM`'s window "eval"): the peak held and the H2D bytes moved.
    """
    ledger = lm.dev.ledger
    moved = ledger.moved_by_window().get(EVAL_WINDOW, {}).get("h2d", 0)
    part = evaluate_heldout(lm, share_of(examples, rank=rank, world_size=world_size),
                            seq_len=seq_len, data_format=data_format)
    part = dataclasses.replace(
        part, dtype=DTYPE_NAMES.get(lm.dtype, str(lm.dtype)),
        device_peak_bytes=ledger.peak_by_window().get(EVAL_WINDOW, 0),
        h2d_bytes=ledger.moved_by_window().get(EVAL_WINDOW, {}).get("h2d", 0) - moved)
    return combine(part, all_sum) if world_size > 1 else part


def share_of(examples: list[Example], *, rank: int, world_size: int) -> list[Example]:
    """Rank `rank`'s contiguous share of `examples` in a data-parallel evaluation (sizes differ
    by at most one): rank 0 holds the first ones, so its samples are a one-process run's."""
    n = len(examples)
    return examples[rank * n // world_size:(rank + 1) * n // world_size]


def combine(part: EvalResult, all_sum: Callable[[float], float]) -> EvalResult:
    """The whole evaluation from each rank's `part` (`share_of`): losses weighted by their
    trained tokens, counts summed, samples and bytes of this rank (rank 0: the first ones).

    Args:
        all_sum: sums a float over the ranks (a collective every rank calls in this order).
    """
    tokens = int(all_sum(part.loss_tokens))
    total = all_sum((part.loss or 0.0) * part.loss_tokens)
    scored, hits = int(all_sum(part.num_scored)), int(all_sum(part.num_correct))
    return dataclasses.replace(
        part, loss=total / tokens if tokens else None, loss_tokens=tokens, num_scored=scored,
        num_correct=hits, exact_match=hits / scored if scored else None,
        num_examples=int(all_sum(part.num_examples)))


def grade(texts: list[str], examples: list[Example]) -> tuple[list[str | None], int]:
    """The exact-match grader: each generated text's final answer (`extract_final_answer`:
    after the last `####`, else after `The answer is:`, else the last number), and how many
    equal their example's reference answer.

    Returns:
        (predicted answers, normalized or None; the number of correct ones).
    """
    predicted = [extract_final_answer(t) for t in texts]
    return predicted, sum(p is not None and p == ex.answer for p, ex in zip(predicted, examples))


def eval_line(when: str, result: EvalResult, *, seq_len: int) -> str:
    """"eval before: loss 1.2345, exact match 0.25 (4/16)", then the compute dtype it ran in
    and the device bytes the ledger booked to it when any ("; in fp32, device peak 0.612 GB,
    0.27 GB host-to-device"); a loss of None
    (no held-out example keeps a trained token within seq_len) is said in words, with the
    fix."""
    loss = (f"{result.loss:.4f}" if result.loss is not None else
            f"n/a (no held-out example keeps an answer token within data.seq_len={seq_len}; "
            f"raise data.seq_len)")
    match = (f"{result.exact_match} ({result.num_correct}/{result.num_scored})"
             if result.exact_match is not None else "n/a (no checkable answers)")
    device = (f", device peak {result.device_peak_bytes / GB:.3g} GB, "
              f"{result.h2d_bytes / GB:.3g} GB host-to-device"
              if result.device_peak_bytes or result.h2d_bytes else "")
    dtype = f"; in {result.dtype}{device}" if result.dtype else ""
    return f"eval {when}: loss {loss}, exact match {match}{dtype}"


def sample_lines(when: str, result: EvalResult) -> list[str]:
    """Two lines showing the first held-out sample: its question, then what the model wrote
    (newlines as ` / `), the predicted and the expected answer; [] without a sample.

    Args:
        when: "before" or "after" (training), printed in the first line.
        result: an evaluation with `samples`.
    """
    if not result.samples:
        return []
    s = result.samples[0]
    verdict = "right" if s["predicted"] == s["answer"] else "wrong"
    generated = " / ".join(ln.strip() for ln in s["generated"].strip().splitlines())
    return [f"sample {when}: {s['prompt']}",
            f"  model wrote: {generated}  -> {s['predicted']} (expected {s['answer']}: {verdict})"]
