"""Where records come from: local files and folders, and Hugging Face Hub dataset ids.

Everything is read with the `datasets` library (`datasets.load_dataset`), so a dataset is
converted to Arrow once, memory-mapped from the `datasets` cache afterwards
(`HF_DATASETS_CACHE`, default `~/.cache/huggingface/datasets`), and a Hub dataset downloaded
once is found again with `HF_DATASETS_OFFLINE=1`. What `path` may be:

| path                                     | read with                                           |
|------------------------------------------|-----------------------------------------------------|
| `.json` / `.jsonl` / `.parquet` / `.arrow` / `.csv` file | the packaged builder of that type   |
| a folder written by `Dataset.save_to_disk` | `datasets.load_from_disk`                         |
| any other folder (data files, split names inferred from file names) | `load_dataset(folder)` |
| `owner/name` or `name` that is not a local path | `load_dataset(id, subset, split=split)`      |

`split` takes the `datasets` slicing syntax too (`train[:1000]`). `datasets` is imported on the
first read (`_datasets`), so a run that reads no file or Hub dataset (`embedded:arithmetic`)
never loads it, nor pyarrow and pandas behind it. Knows nothing about formats:
it returns a `datasets.Dataset` of raw records (`formats.py` turns them into examples).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow",
                 ".csv": "csv"}
"""File suffix -> `datasets` packaged builder."""

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = ("1", "on", "yes", "true")


def is_offline() -> bool:
    """True when `HF_DATASETS_OFFLINE` or `HF_HUB_OFFLINE` is set (1/ON/YES/TRUE), read now."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE
               for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def looks_like_hub_id(path: str) -> bool:
    """True for `name` or `owner/name` (no file suffix of a data file, not an absolute path)."""
    return bool(_HUB_ID_RE.match(path)) and Path(path).suffix.lower() not in FILE_BUILDERS


def _datasets() -> Any:
    """The `datasets` module, imported at the first read of a file or Hub dataset."""
    import datasets  # lazy: keeps datasets (pyarrow, pandas) out of runs that read no data.path

    return datasets


def _cache_dir() -> str:
    datasets = _datasets()
    return str(datasets.config.HF_DATASETS_CACHE)


def _pick_split(loaded: Any, split: str, *, path: str, what: str) -> Any:
    """One split of a `load_from_disk` result (a Dataset is used as it is)."""
    datasets = _datasets()
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if split not in loaded:
        raise ValueError(f"{what}: {path} has splits {sorted(loaded)}, not {split!r}; set "
                         f"data.split to one of them")
    return loaded[split]


def _local(path: Path, *, subset: str, split: str, what: str) -> Any:
    datasets = _datasets()
    saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    if path.is_dir() and saved:  # Dataset(Dict).save_to_disk
        return _pick_split(datasets.load_from_disk(str(path)), split, path=str(path), what=what)
    if path.is_dir():
        return datasets.load_dataset(str(path), subset or None, split=split)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is not None and not path.read_bytes()[:4096].strip():  # datasets: StopIteration
        raise ValueError(f"{what}: {path} has no records; it needs at least one")
    if builder is None:
        raise ValueError(f"{what}: {path} is not a data file datasets can read; give a "
                         f"{'/'.join(FILE_BUILDERS)} file, a folder of them, or a Hub id")
    # One file is one split, called "train" (so split slicing such as train[:100] works).
    return datasets.load_dataset(builder, data_files={"train": str(path)}, split=split)


def _hub(path: str, *, subset: str, split: str, data_dir: str, what: str) -> Any:
    datasets = _datasets()
    try:
        return datasets.load_dataset(path, subset or None, split=split, data_dir=data_dir or None)
    except ConnectionError as exc:
        if is_offline():
            raise FileNotFoundError(
                f"{what}: {path!r} is not in the datasets cache ({_cache_dir()}) and "
                f"HF_DATASETS_OFFLINE is set; load it once with the network (unset "
                f"HF_DATASETS_OFFLINE), or give a local file or folder") from None
        raise ConnectionError(f"{what}: cannot reach the Hugging Face Hub for {path!r} ({exc}); "
                              f"check the network, or set HF_DATASETS_OFFLINE=1 to use a cached "
                              f"copy, or give a local file or folder") from None
    except datasets.exceptions.DatasetNotFoundError as exc:
        raise FileNotFoundError(f"{what}: {path!r} is neither a local file or folder nor a Hub "
                                f"dataset ({exc}); check the path or the id") from None


def load_table(path: str | Path, *, subset: str = "", split: str = "train", data_dir: str = "",
               what: str = "data.path") -> Any:
    """The records at `path` as a `datasets.Dataset` (one split).

    Args:
        path: a local file or folder, or a Hub dataset id (see the module docstring).
        subset: the Hub dataset's configuration (`load_dataset`'s `name`, e.g. "main" for
            openai/gsm8k); empty: the dataset's default.
        split: which split, with `datasets` slicing (`train`, `test[:100]`).
        data_dir: sub-folder of a Hub dataset (LlamaFactory's `folder`); empty: none.
        what: the config key named in errors.

    Returns:
        A non-empty `datasets.Dataset`.

    Raises:
        FileNotFoundError: a local path that does not exist and is no Hub id; a Hub id that
            does not exist; offline (`HF_DATASETS_OFFLINE`) and not cached.
        ConnectionError: online, and the Hub cannot be reached.
        ValueError: an unreadable file (bad JSON, naming the row), an unknown subset or split,
            or no records.
    """
    datasets = _datasets()
    text = str(path)
    local = Path(text).expanduser()
    try:
        if local.exists():
            table = _local(local, subset=subset, split=split, what=what)
        elif looks_like_hub_id(text):
            table = _hub(text, subset=subset, split=split, data_dir=data_dir, what=what)
        else:
            raise FileNotFoundError(f"{what}: {text} does not exist; give a "
                                    f"{'/'.join(FILE_BUILDERS)} file, a folder, or a Hub "
                                    f"dataset id (owner/name)")
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        raise ValueError(f"{what}: {text} cannot be read ({type(cause).__name__}: "
                         f"{cause}; rows count from 0)") from None
    except ValueError as exc:
        if str(exc).startswith(f"{what}: "):  # ours, already one line naming the key
            raise
        raise _explain(exc, text, subset=subset, split=split, what=what) from None
    if len(table) == 0:
        raise ValueError(f"{what}: {text} has no records; it needs at least one")
    return table


def _explain(exc: ValueError, path: str, *, subset: str, split: str, what: str) -> ValueError:
    """A `datasets` ValueError as a one-line error naming the config key to fix."""
    msg = str(exc).replace("\n", " ")
    if "corresponds to no data" in msg:
        return ValueError(f"{what}: {path} has no records; it needs at least one")
    if "Unknown split" in msg or "Bad split" in msg:
        return ValueError(f"data.split: {split!r} is not a split of {path} ({msg}); set "
                          f"data.split to one of its splits")
    if "config" in msg.lower():
        return ValueError(f"data.subset: {subset or '(none)'!r} does not select a configuration "
                          f"of {path} ({msg}); set data.subset")
    return ValueError(f"{what}: {path}: {msg}")


def mix_examples(parts: Sequence[Sequence[T]], weights: Sequence[float], *, seed: int,
                 names: Sequence[str]) -> list[T]:
    """The samples of `data.mix`: as many as `parts` hold together, part i giving
    round(weights[i] / sum(weights) x that total) of them, in an order shuffled by `seed`
    (one `random.Random(seed)` over the parts in turn), its samples repeated when it has
    fewer and a subset when it has more. The training stream shuffles the result again.

    Args:
        parts: the samples of each entry; weights: > 0, one per part; seed: `train.seed`;
        names: each entry's path, for errors.

    Raises:
        ValueError: an entry without samples, or whose weight gives it none of the total
            (naming it and the fix).
    """
    total, weight_sum = sum(len(p) for p in parts), sum(weights)
    rng = random.Random(seed)
    mixed: list[T] = []
    for part, name in zip(parts, names):
        if not part:
            raise ValueError(f"data.mix: {name} has no training samples; remove the entry or "
                             f"fix its path, split or subset")
    for part, weight, name in zip(parts, weights, names):
        share = round(weight / weight_sum * total)
        if share == 0:
            raise ValueError(f"data.mix: {name}'s weight {weight:g} gives it 0 of the {total} "
                             f"mixed samples (under half of one); raise its weight or remove it")
        order = list(range(len(part)))
        rng.shuffle(order)
        mixed += [part[order[k % len(part)]] for k in range(share)]
    return mixed

