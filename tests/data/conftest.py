"""Fixtures for the data tests: tokenizers trained on the embedded arithmetic problems."""

from __future__ import annotations

import pytest

from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.data.tiny_tokenizer import CHATML_TEMPLATE, train_tokenizer


def _corpus() -> list[str]:
    train, _ = arithmetic_dataset(num_train=200, num_eval=0, seed=1)
    return [m.content for ex in train for m in ex.messages] + ["Question: Answer: ####"]


@pytest.fixture(scope="session")
def _plain_tokenizer():
    return train_tokenizer(_corpus(), vocab_size=400)


@pytest.fixture
def plain_tokenizer(_plain_tokenizer):
    """A byte-level BPE tokenizer without a chat template (so chatml, the default, renders);
    a fresh copy per test, since `build_data` sets the chosen template on its tokenizer."""
    import copy
    return copy.deepcopy(_plain_tokenizer)


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The same kind of tokenizer with a ChatML chat template."""
    return train_tokenizer(_corpus(), vocab_size=400, chat_template=CHATML_TEMPLATE)


@pytest.fixture
def populate_hub_cache():
    """`fill(cache_dir, repo_id, subset, splits, work_dir=...)` (see `_populate_hub_cache`)."""
    return _populate_hub_cache


def _populate_hub_cache(cache_dir, repo_id: str, subset: str, splits: dict[str, list[dict]],
                        *, work_dir) -> None:
    """Put `splits` into a `datasets` cache as if `load_dataset(repo_id, subset)` had downloaded
    them once (the layout `datasets` reads offline: <cache>/<owner>___<name>/<subset>/<version>/
    <hash>/ with dataset_info.json and <name>-<split>.arrow). The files are written by
    `datasets`' own JSON builder, then moved to the Hub dataset's place; no network."""
    import json as _json
    import shutil
    from pathlib import Path

    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    owner, name = repo_id.split("/")
    snake = camelcase_to_snakecase(name)
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        path = Path(work_dir) / f"{split}.jsonl"
        path.write_text("".join(_json.dumps(r) + "\n" for r in rows))
        files[split] = str(path)
    builder = Json(cache_dir=str(work_dir / "build"), dataset_name=snake, config_name=subset,
                   data_files=files, hash="0000000000000000")
    builder.download_and_prepare()
    target = Path(cache_dir) / f"{owner}___{snake}" / subset / "0.0.0" / "0000000000000000"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(builder.cache_dir, target)
    info = _json.loads((target / "dataset_info.json").read_text())
    info["config_name"] = subset  # the builder appended a data-files hash to the config id
    (target / "dataset_info.json").write_text(_json.dumps(info))
