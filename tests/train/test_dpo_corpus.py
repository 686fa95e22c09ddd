"""A model that ships no tokenizer trains one on the run's data: with `train.method: dpo` that
data is preference pairs, which the SFT corpus reader cannot detect."""

from __future__ import annotations

import json

from lazytrain.config import load_config
from lazytrain.train.dpo_run import training_corpus


def test_the_tokenizer_corpus_of_a_dpo_run_is_its_pairs_texts(tmp_path):
    rows = [{"prompt": f"What is {i}+1?", "chosen": f"{i}+1 = {i + 1}\n#### {i + 1}",
             "rejected": f"{i}+1 = {i + 2}\n#### {i + 2}"} for i in range(6)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["train.method=dpo", f"data.path={path}", "data.num_eval=2"])
    texts = training_corpus(cfg, seed=0)
    expected = {r[k] for r in rows for k in ("prompt", "chosen", "rejected")}
    assert set(texts) == expected and len(texts) == 3 * len(rows)
