"""The data of a run config as training will see it, for `lazytrain data`: the tokenizer and
the data read as `Trainer` reads them (source, format, chat template, `data.seq_len`,
`data.overlong`), rendered samples with their trained tokens marked (`data.preview`) and the
counts. Loads the model's tokenizer, never its weights; writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lazytrain.data import build_data, corpus_texts, encode
from lazytrain.data.preview import count_samples, marked_text
from lazytrain.models.families import text_model_config
from lazytrain.train import checks, model_source


def preview_lines(cfg: Any, *, samples: int, count: int) -> Iterator[str]:
    """Lines to print: the data layer's notes, the first `samples` training samples (rendered,
    trained tokens between `data.preview.TRAINED_OPEN` and `TRAINED_CLOSE`, a cut one said),
    then one line of counts over the first `count` training samples (0: all).

    Raises:
        FileNotFoundError, ValueError: as `Trainer` for a missing or malformed data file, an
            unknown template or format, a model without a tokenizer.
    """
    dc, tc = cfg.data, cfg.train
    checks.check_data_paths(dc)
    source = model_source.resolve_model_source(cfg.model.config_path, weights=False)
    hf_config = text_model_config(model_source.load_hf_config(source))
    tokenizer = model_source.load_tokenizer(source, vocab_size=hf_config.vocab_size,
                                     corpus=lambda: corpus_texts(dc, seed=tc.seed))
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
