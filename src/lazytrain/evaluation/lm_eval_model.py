"""lm-eval's model interface over a `StreamedLM`: run lm-eval tasks on models that do not fit a GPU.

`StreamedEvalLM` is an `lm_eval.api.model.TemplateLM` whose three request kinds go through the
streaming engine's forward-only and decode passes (`StreamedLM.token_logprobs`, `.generate`):

- `loglikelihood` (and so multiple choice): lm-eval's own `TemplateLM.loglikelihood` splits each
  (context, continuation) pair into tokens the way its HF backend does (trailing spaces of the
  context move to the continuation; the whole string is encoded once and cut at the context's
  length; an empty context is the BOS, or EOS, token), and `_loglikelihood_tokens` scores the
  last `max_length + 1` tokens as `HFLM` does, so the scores are HFLM's up to float rounding;
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows of `max_length` tokens, summed;
- `generate_until`: the context left-cut to `max_length - max_gen_toks` tokens, generated until
  EOS, one of the task's `until` strings, or `max_gen_toks`; greedy unless the task samples
  (`do_sample`, `temperature`, `top_p`); the text is cut at the first stop string, as HFLM does.

Whether a continuation is the greedy one (lm-eval's `is_greedy`, behind the `acc` of
loglikelihood tasks and the `exact_match` of multiple choice) needs the argmax at every position,
which a log-probability alone does not give: a token of probability above 1/2 is the argmax (the
others share less than 1/2); otherwise a greedy decode from the context decides, the unsure
requests of a scored batch decoded together, each row stopped once it differs from every
continuation of the batch.

Needs lm-eval (the `eval` extra); only `lazytrain eval` imports this module. Runs in one process
(lm-eval's rank 0 of 1).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (handle_stop_sequences, has_bos_prefix,
                                  normalize_gen_kwargs, postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lazytrain.evaluation.completions import stop_on

if TYPE_CHECKING:
    from lazytrain.evaluation.streamed_lm import StreamedLM

DEFAULT_MAX_GEN_TOKS = 256
"""Tokens generated when a task names no `max_gen_toks`: lm-eval's HF backend's default."""

DEFAULT_SEED = 1234
"""Seed of the first sampled generation (lm-eval's default seed); request i uses seed + i."""

SURE_GREEDY_LOGPROB = math.log(0.5)
"""Natural log; a token above it has probability > 1/2, so it is the argmax of its position."""

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")
"""The generation kwargs a task may set (lm-eval's aliases of max_gen_toks are normalized)."""


class StreamedEvalLM(TemplateLM):
    """An lm-eval model (`lm_eval.api.model.TemplateLM`) backed by a `StreamedLM`.

    Args:
        lm: the streamed model (`StreamedLM`, or any object with its `tokenizer`,
            `eos_token_ids`, `max_length`, `token_logprobs` and `generate`).
        batch_size: sequences per `token_logprobs` call and prompts per `generate` call (>= 1).
        seed: seed of the first sampled generation; request i of a `generate_until` call uses
            `seed + i`, so a run is reproducible.

    Raises:
        ValueError: `batch_size` below 1.
    """

    def __init__(self, lm: "StreamedLM", *, batch_size: int = 1, seed: int = DEFAULT_SEED):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        self.lm = lm
        self.tokenizer = lm.tokenizer
        self.batch_size = batch_size
        self.seed = seed

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's EOS id: lm-eval's end-of-text token and its stop string."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token scored before an empty context or a rolling window: BOS, else EOS (HFLM's)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """lm-eval's context length: one token below the model's `StreamedLM.max_length`.

        lm-eval scores windows of `max_length + 1` tokens (the last one is only predicted),
        and `StreamedLM.token_logprobs` runs its forward over every token of a sequence, so the
        window must fit the model's positions. Scores equal HFLM's at the model's full length
        for every request shorter than that; rolling windows are one token shorter than its.
        """
        return self.lm.max_length - 1

    @property
    def max_gen_toks(self) -> int:
        """Tokens generated when a task names no limit."""
        return DEFAULT_MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's path, as lm-eval names cached chat-templated requests."""
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """Token ids of `string` as HFLM encodes them: the tokenizer's own special tokens
        unless `add_special_tokens` says otherwise or the string already starts with the
        prefix token; the last `left_truncate_len` ids when given."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """`chat_history` rendered with the tokenizer's chat template (the run's, saved with
        its checkpoint), for `lazytrain eval --apply-chat-template`."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is greedy) per ((context, continuation) strings,
        context ids, continuation ids) request, the key None for a rolling window.

        Raises:
            ValueError: an empty continuation, or one longer than `max_length` tokens.
        """
        return self._score(requests, with_greedy=True)

    def _score(self, requests, *, with_greedy: bool) -> list[tuple[float, bool]]:
        """The log-likelihoods of `_loglikelihood_tokens`, `is_greedy` False unless asked for."""
        answers = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start:start + self.batch_size]
            windows = [self._window(context, continuation) for _, context, continuation in batch]
            scored = [logprobs[-len(continuation):] for (_, _, continuation), logprobs in
                      zip(batch, self.lm.token_logprobs(windows))]
            flags = (self._greedy_flags([(w[:-len(c)], c, lp) for (_, _, c), w, lp in
                                         zip(batch, windows, scored)])
                     if with_greedy else [False] * len(batch))
            for (key, _, _), logprobs, greedy in zip(batch, scored, flags):
                answer = (float(logprobs.sum()), greedy)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                answers.append(answer)
        return answers

    def _window(self, context: list[int], continuation: list[int]) -> list[int]:
        """The tokens one request scores: the last `max_length + 1` of context + continuation
        (the context cut from the left, as HFLM does)."""
        if not continuation or len(continuation) > self.max_length:
            raise ValueError(f"a loglikelihood continuation must have 1 to {self.max_length} "
                             f"tokens (the model's max_length); got {len(continuation)}")
        return (context + continuation)[-(self.max_length + 1):]

    def _greedy_flags(self, items) -> list[bool]:
        """Per (context ids, continuation ids, float32 [len(continuation)] log p of each
        continuation token) item: True when greedy decoding from the context gives the
        continuation.

        Sure from the log-probabilities when every token is above 1/2. The other items are
        decoded together in one batched `generate` call, a row stopped as soon as its tokens
        start no continuation of the batch (so at its first differing token, or soon after);
        a row whose decode ended early at an EOS that its continuation also holds, or whose
        context leaves no room for the batch's longest continuation, is decoded on alone.
        """
        flags = [bool((logprobs > SURE_GREEDY_LOGPROB).all()) for _, _, logprobs in items]
        unsure = [k for k, sure in enumerate(flags) if not sure]
        if not unsure:
            return flags
        steps = max(len(items[k][1]) for k in unsure)
        batched = [k for k in unsure if len(items[k][0]) + steps <= self.lm.max_length]
        continuations = [items[k][1] for k in batched]
        decoded = dict(zip(batched, self.lm.generate(
            [items[k][0] for k in batched], max_new_tokens=steps,
            stop=lambda toks: not any(c[:len(toks)] == toks for c in continuations))
            if batched else []))
        for k in unsure:
            context, continuation, _ = items[k]
            head = decoded[k][:len(continuation)] if k in decoded else None
            if head is None or (len(head) < len(continuation)
                                and head == continuation[:len(head)]):
                flags[k] = self._decodes_to(context, continuation)
            else:
                flags[k] = head == continuation
        return flags

    def _decodes_to(self, context: list[int], continuation: list[int]) -> bool:
        """True when greedy decoding from `context` gives `continuation`; the decode stops at
        the first token that differs."""
        done = 0
        while done < len(continuation):  # more than one pass only past an EOS in `continuation`
            wanted = continuation[done:]
            new = self.lm.generate([context + continuation[:done]], max_new_tokens=len(wanted),
                                   stop=lambda toks, w=wanted: toks != w[:len(toks)])[0]
            if not new or new != wanted[:len(new)]:
                return False
            done += len(new)
        return True

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Per request (one string), the summed log-likelihood (natural log) of its tokens over
        lm-eval's disjoint rolling windows of `max_length` tokens, the first after the prefix
        token."""
        totals = []
        for (string,) in [request.args for request in requests]:
            windows = [(None, *make_disjoint_window(window)) for window in
                       get_rolling_token_windows(token_list=self.tok_encode(string),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)]
            total = sum(logprob for logprob, _ in self._score(windows, with_greedy=False))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            totals.append(total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The generated text per (context, gen_kwargs) request, cut at its first stop string.

        Requests with the same generation kwargs go `batch_size` at a time to one
        `StreamedLM.generate` call.

        Raises:
            ValueError: a generation kwarg other than `GEN_KWARGS`, or `max_gen_toks` that
                leaves no room for the context in `max_length`.
        """
        args = [request.args for request in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        texts: list[str | None] = [None] * len(args)
        for indices in groups.values():
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                outputs = self._generate([args[i][0] for i in batch], args[batch[0]][1],
                                         seed=self.seed + batch[0])
                for i, text in zip(batch, outputs):
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
        return texts

    def _generate(self, contexts: list[str], gen_kwargs: dict, *, seed: int) -> list[str]:
        """Generated texts for `contexts` under one task's generation kwargs."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen_toks = kwargs.pop("max_gen_toks")
        sample, temperature = kwargs.pop("do_sample"), float(kwargs.pop("temperature", 0.0))
        temperature = temperature if sample else 0.0
        top_p = float(kwargs.pop("top_p", 1.0))
        if kwargs:
            raise ValueError(f"generation_kwargs: {sorted(kwargs)} not supported by lazytrain "
                             f"eval; a task may set {', '.join(GEN_KWARGS)}")
        room = self.max_length - max_gen_toks
        if room <= 0:
            raise ValueError(f"generation_kwargs.max_gen_toks ({max_gen_toks}) must be below "
                             f"the model's max_length ({self.max_length})")
        prompts = [self.tok_encode(context, left_truncate_len=room) for context in contexts]
        outputs = self.lm.generate(prompts, max_new_tokens=max_gen_toks, temperature=temperature,
                                   top_p=top_p, seed=seed, stop=stop_on(self.tokenizer, until))
        return [postprocess_generated_text(
            self.tokenizer.decode(tokens, skip_special_tokens=True), stop=until,
            think_end_token=None) for tokens in outputs]
