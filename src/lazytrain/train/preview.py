"""The data of a run config as training will see it, for `lazytrain data`: the tokenizer and
the data read as `Trainer` reads them (source, format, chat template, `data.seq_len`,
`data.overlong`), rendered samples with their trained tokens marked (`data.preview`) and the
counts. With `train.method: dpo` the samples are preference pairs, read and encoded as the
DPO trainer does (`dpo_run.templated_pairs`, `preference.encode_pair`). Loads the model's
tokenizer, never its weights; writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lazytrain.data import build_data, encode
from lazytrain.data.preview import count_pairs, count_samples, marked_text, pair_lines
from lazytrain.models.families import text_model_config
from lazytrain.train import checks, dpo_run, model_source

DROPPED_SHOWN = 10
"""Dropped pairs listed by index in the DPO counts (the rest are counted)."""


def preview_lines(cfg: Any, *, samples: int, count: int) -> Iterator[str]:
    """Lines to print: the data layer's notes, the first `samples` training samples (rendered,
    trained tokens between `data.preview.TRAINED_OPEN` and `TRAINED_CLOSE`, a cut one said),
    then one line of counts over the first `count` training samples (0: all). With
    `train.method: dpo`: `pair_preview_lines`.

    Raises:
        FileNotFoundError, ValueError: as `Trainer` for a missing or malformed data file, an
            unknown template or format, a model without a tokenizer.
    """
    dc, tc = cfg.data, cfg.train
    checks.check_data_paths(dc)
    source = model_source.resolve_model_source(cfg.model.config_path, weights=False)
    hf_config = text_model_config(model_source.load_hf_config(source))
    tokenizer = model_source.load_tokenizer(
        source, vocab_size=hf_config.vocab_size,
        corpus=lambda: dpo_run.training_corpus(cfg, seed=tc.seed))
    if tc.method == "dpo":
        yield from pair_preview_lines(cfg, tokenizer, samples=samples, count=count)
        return
    data = build_data(dc, tokenizer, micro_batch=tc.micro_batch, seed=tc.seed,
                      hf_config=hf_config)
    examples = data.train.examples
    yield from data.notes
    for index, example in enumerate(examples[:samples]):
        encoded = encode(tokenizer, example, seq_len=dc.seq_len, overlong=dc.overlong)
        yield f"--- sample {index} ({data.format})"
        yield ("(skipped: no trained token within data.seq_len)" if encoded is None else
               marked_text(tokenizer, encoded) + (" [cut at data.seq_len]"
                                                  if encoded.truncated else ""))
    counts, trained = count_samples(tokenizer, examples[:count] if count else examples,
                                    seq_len=dc.seq_len, overlong=dc.overlong)
    whole = counts.drawn - counts.truncated - counts.skipped
    yield (f"{len(examples)} training samples ({data.format}, {data.source}), "
           f"{len(data.eval_examples)} held out; of {counts.drawn} counted at data.seq_len="
           f"{dc.seq_len}: {whole} fit whole, {counts.truncated} truncated, {counts.skipped} "
           f"skipped (data.overlong={dc.overlong}); {trained} trained tokens")


def pair_preview_lines(cfg: Any, tokenizer: Any, *, samples: int, count: int) -> Iterator[str]:
    """Lines for a `train.method: dpo` config: the template note, the first `samples` training
    pairs (`data.preview.pair_lines`: the rendered prompt, the chosen and rejected responses
    with their trained tokens marked, token counts against `data.seq_len`), then the counts
    over the first `count` pairs (0: all): pairs that fit whole, are truncated or dropped,
    the dropped ones' indices, and the trained tokens kept.

    Raises:
        ValueError, FileNotFoundError: as `dpo_run.templated_pairs` (packing on, `data.mix`,
            a record that is not a pair, a registry entry without ranking, ...).
    """
    dc = cfg.data
    train, held, note = dpo_run.templated_pairs(dc, tokenizer, seed=cfg.train.seed)
    if note:
        yield note
    for index, pair in enumerate(train[:samples]):
        yield f"--- pair {index} (preference)"
        yield from pair_lines(tokenizer, pair, seq_len=dc.seq_len, overlong=dc.overlong)
    counted = train[:count] if count else train
    counts, trained, dropped = count_pairs(tokenizer, counted, seq_len=dc.seq_len,
                                           overlong=dc.overlong)
    whole = counts.drawn - counts.truncated - counts.skipped
    listed = ", ".join(map(str, dropped[:DROPPED_SHOWN])) + (
        f" and {len(dropped) - DROPPED_SHOWN} more" if len(dropped) > DROPPED_SHOWN else "")
    yield (f"{len(train)} training pairs (preference, {dc.path}), {len(held)} held out; of "
           f"{counts.drawn} counted at data.seq_len={dc.seq_len}: {whole} fit whole, "
           f"{counts.truncated} truncated, {counts.skipped} dropped"
           f"{f' (pairs {listed})' if dropped else ''} (data.overlong={dc.overlong}); "
           f"{trained} trained tokens")
