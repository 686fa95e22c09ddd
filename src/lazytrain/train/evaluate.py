"""Held-out evaluation: mean next-token loss and exact match of the final answer.

Runs a plain HF model that holds a copy of the current fp32 master weights (built once per run,
refreshed before each evaluation): the loss over the trained tokens of each held-out example,
and, for examples with a checkable answer (GSM8K `####`, arithmetic, MetaMathQA), greedy
generation from the prompt and a comparison of the extracted final answer. The copy costs
4 B/param of host memory (counted by the preflight); a model too big for that would evaluate
through the streaming engine instead; that engine-side evaluation for models larger than
host memory is not built yet.

Evaluation leaves the global RNG state as it found it (forked), so a run evaluated in the middle
trains exactly like one that is not. It runs with one torch thread (restored afterwards): greedy
generation is thousands of tiny ops, and on a shared 2-core machine every intra-op parallel
region waits for a descheduled sibling thread. Measured here (SmolLM2-135M, 8 prompts x 32 new
tokens, load average ~5): 16-22 s with 1 thread, 158 s with 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lazytrain.contract import IGNORE_INDEX
from lazytrain.data import (Example, encode, encode_prompt, extract_final_answer, pad_batch,
                            stop_token_ids)

EVAL_BATCH = 8
"""Examples per evaluation forward / generation batch (bounds the [B, S, vocab] logits)."""
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

    def to_dict(self) -> dict:
        return asdict(self)


def build_eval_model(hf_config: Any):
    """A real (not meta) fp32 HF model of `hf_config`, in eval mode, weights to be loaded."""
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model.eval()


def load_weights(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Copy the engine's fp32 master weights (HF names) into `model`.

    Raises:
        KeyError: a parameter of the model has no weight (tied heads excepted).
    """
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise KeyError(f"evaluation model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()


@torch.no_grad()
def eval_loss(model: Any, tokenizer: Any, examples: list[Example], *, seq_len: int,
              pad_id: int) -> float | None:
    """Token-weighted mean loss of `examples` (truncated to seq_len; unusable ones dropped)."""
    encoded = [e for e in (encode(tokenizer, ex, seq_len=seq_len, overlong="truncate")
                           for ex in examples) if e is not None]
    total, count = 0.0, 0
    for i in range(0, len(encoded), EVAL_BATCH):
        chunk = encoded[i:i + EVAL_BATCH]
        batch = pad_batch(chunk, seq_len=max(len(e.input_ids) for e in chunk), pad_id=pad_id)
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits.float()
        targets = batch["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum")
        total += float(losses)
        count += int((targets != IGNORE_INDEX).sum())
    return total / count if count else None


@torch.no_grad()
def generate_answers(model: Any, tokenizer: Any, examples: list[Example], *,
                     max_new_tokens: int, pad_id: int) -> list[str]:
    """Greedy continuations (decoded, special tokens dropped) of each example's prompt; each
    stops at eos or at the chat template's end-of-turn token (`data.stop_token_ids`)."""
    texts = []
    eos = stop_token_ids(tokenizer)
    for i in range(0, len(examples), EVAL_BATCH):
        prompts = [encode_prompt(tokenizer, ex) for ex in examples[i:i + EVAL_BATCH]]
        width = max(len(p) for p in prompts)
        # Left padding: every row's next token is generated at the same position.
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=eos)
        texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return texts


def evaluate_heldout(model: Any, tokenizer: Any, examples: list[Example], *, seq_len: int,
             pad_id: int, data_format: str) -> EvalResult:
    """Loss and exact match of `model` on `examples` (RNG state and thread count preserved)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _evaluate(model, tokenizer, examples, seq_len=seq_len, pad_id=pad_id,
                         data_format=data_format)
    finally:
        torch.set_num_threads(threads)


def _evaluate(model: Any, tokenizer: Any, examples: list[Example], *, seq_len: int,
              pad_id: int, data_format: str) -> EvalResult:
    with torch.random.fork_rng(devices=[]):
        loss = eval_loss(model, tokenizer, examples, seq_len=seq_len, pad_id=pad_id) \
            if examples else None
        scored = [ex for ex in examples if ex.answer is not None]
        new_tokens = MAX_NEW_TOKENS.get(data_format, DEFAULT_MAX_NEW_TOKENS)
        texts = generate_answers(model, tokenizer, scored, max_new_tokens=new_tokens,
                                 pad_id=pad_id) if scored else []
    predicted, hits = grade(texts, scored)
    samples = tuple({"prompt": ex.prompt_messages[-1].content, "answer": ex.answer,
                     "generated": t, "predicted": p}
                    for ex, t, p in list(zip(scored, texts, predicted))[:3])
    return EvalResult(loss=loss, exact_match=hits / len(scored) if scored else None,
                      num_examples=len(examples), num_scored=len(scored), samples=samples,
                      num_correct=hits)


def grade(texts: list[str], examples: list[Example]) -> tuple[list[str | None], int]:
    """The exact-match grader: each generated text's final answer (`extract_final_answer`:
    after the last `####`, else after `The answer is:`, else the last number), and how many
    equal their example's reference answer.

    Returns:
        (predicted answers, normalized or None; the number of correct ones).
    """
    predicted = [extract_final_answer(t) for t in texts]
    return predicted, sum(p is not None and p == ex.answer for p, ex in zip(predicted, examples))


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
