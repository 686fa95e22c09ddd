"""Dataset registries in LlamaFactory's `dataset_info.json` format: entry name -> dataset.

A registry is a JSON object mapping a dataset name to an entry (LlamaFactory
`data/README.md`, the format MegaTrain ships as `data/dataset_info.json`):

    {"alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
     "metamath": {"hf_hub_url": "meta-math/MetaMathQA",
                  "columns": {"prompt": "query", "response": "response"}},
     "gsm8k": {"file_name": "gsm8k/train.jsonl", "formatting": "alpaca",
               "columns": {"prompt": "question", "response": "answer"}},
     "chat": {"file_name": "chat.json", "formatting": "sharegpt",
              "columns": {"messages": "messages"},
              "tags": {"role_tag": "role", "content_tag": "content",
                       "user_tag": "user", "assistant_tag": "assistant"}}}

Keys read, with LlamaFactory's defaults:

| key          | meaning                                                 | default            |
|--------------|---------------------------------------------------------|--------------------|
| `file_name`  | file or folder under dataset_dir (any `sources.py` kind) | -                 |
| `hf_hub_url` | Hub dataset id, loaded with `datasets.load_dataset`     | -                  |
| `subset`, `split`, `folder` | Hub configuration, split, sub-folder      | -, train, -        |
| `formatting` | `alpaca` or `sharegpt`                                  | `alpaca`           |
| `ranking`    | preference data: `chosen`/`rejected` columns, for `train.method: dpo` | false |
| `columns`    | alpaca: prompt, query, response, system, history;       | alpaca: instruction, input, output |
|              | sharegpt: messages, system; ranking: chosen, rejected  | sharegpt: conversations; chosen, rejected |
| `tags`       | role_tag, content_tag, user_tag, assistant_tag, system_tag | from, value, human, gpt, system |
| `num_samples`| keep the first N records (LlamaFactory samples N at random) | all            |

An entry needs `file_name` or `hf_hub_url`; with both, the local `file_name` wins (no network).
Both are read through `datasets` (`sources.load_table`): a Hub entry lands in the `datasets`
cache and is found again with `HF_DATASETS_OFFLINE=1`. Conversion follows LlamaFactory's
converters: alpaca joins prompt and query with a newline, and `history` ([[prompt, response],
...]) becomes earlier turns; sharegpt takes a leading system turn as the system prompt and
requires user/assistant turns to alternate. Every assistant turn (history included) is trained.

A `"ranking": true` entry holds preference pairs (`read_ranking_records`, parsed into pairs by
`preference.read_registry_pairs` for `train.method: dpo`; the SFT reader refuses it, naming
`train.method`). Its prompt is built as above (alpaca: system, history turns, prompt and query
joined with a newline; sharegpt: the messages, alternating and ending on a user turn) and none
of its turns is trained; `chosen` and `rejected` are the two responses: alpaca text, sharegpt
one assistant-tag message. LlamaFactory has no default for these two columns; here they
default to `chosen` and `rejected`.

ModelScope/Modelers hubs, loading scripts, cloud files, multimodal columns and tool turns are
refused with an error that says what to do. Knows nothing about tokenizers.

Source: hiyouga/LLaMA-Factory `data/README.md`, `src/llamafactory/data/parser.py` (DatasetAttr
defaults) and `converter.py` (Alpaca/SharegptDatasetConverter), read for the conventions; no
code copied.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazytrain.data.formats import Example, Message, extract_final_answer
from lazytrain.data.sources import load_table

FORMATTINGS = ("alpaca", "sharegpt")
"""Supported `formatting` values (LlamaFactory's two record layouts)."""

DEFAULT_COLUMNS: dict[str, dict[str, str | None]] = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": None,
               "history": None},
    "sharegpt": {"messages": "conversations", "system": None},
}
"""Column role -> record key, per formatting (None: the role is absent unless mapped)."""

DEFAULT_TAGS: dict[str, str] = {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                                "assistant_tag": "gpt", "system_tag": "system",
                                "observation_tag": "observation",
                                "function_tag": "function_call"}
"""ShareGPT tag defaults (LlamaFactory DatasetAttr)."""

RANKING_COLUMNS: dict[str, str] = {"chosen": "chosen", "rejected": "rejected"}
"""Column roles of a `"ranking": true` entry's two responses -> default record keys."""

UNSUPPORTED_COLUMNS = ("images", "videos", "audios", "tools", "kto_tag")
"""Column roles of multimodal, tool-use and KTO data: refused (text only)."""

UNSUPPORTED_SOURCES = ("ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
"""Entry keys of sources `datasets` does not load from an id (ModelScope, Modelers, loading
scripts, cloud storage): refused unless the entry also has `file_name` or `hf_hub_url`."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RegistryEntry:
    """One resolved `dataset_info.json` entry."""

    name: str
    """The entry's key in the registry."""
    path: Path | None
    """The local file or folder (dataset_dir / file_name); None for a Hub entry."""
    hub_id: str = ""
    """`hf_hub_url` when the entry has no `file_name`; empty for a local entry."""
    subset: str = ""
    """Hub configuration (`subset`); empty: the dataset's default."""
    split: str = "train"
    """Split to read (`split`, datasets slicing allowed)."""
    folder: str = ""
    """Sub-folder of the Hub dataset (`folder`); empty: none."""
    formatting: str
    """"alpaca" or "sharegpt"."""
    columns: Mapping[str, str | None]
    """Column role -> record key (defaults filled in)."""
    tags: Mapping[str, str]
    """ShareGPT tags (defaults filled in)."""
    num_samples: int | None = None
    """Keep only the first N records; None keeps all."""
    ranking: bool = False
    """A preference entry (`"ranking": true`): `columns` also maps `chosen` and `rejected`."""


def load_registry(path: str | Path) -> dict[str, dict]:
    """The registry JSON as a dict of entries.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not valid JSON, or not an object of objects.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.registry_path: {path} does not exist; give a "
                                f"LlamaFactory-style dataset_info.json")
    try:
        registry = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"data.registry_path: {path} is not valid JSON ({exc})") from None
    if not isinstance(registry, dict) or not all(isinstance(v, dict) for v in registry.values()):
        raise ValueError(f"data.registry_path: {path} must map dataset names to objects")
    return registry


def resolve_entry(registry_path: str | Path, name: str, *,
                  dataset_dir: str | Path | None = None) -> RegistryEntry:
    """Look up `name` and fill in LlamaFactory's defaults.

    Args:
        registry_path: the dataset_info.json.
        name: the entry (`data.path` when `data.registry_path` is set).
        dataset_dir: folder `file_name` resolves against; None: the registry's folder.

    Raises:
        ValueError: unknown name (with the closest names), an entry with neither file_name
            nor hf_hub_url, an unknown formatting, unsupported (multimodal/tool/KTO) columns,
            chosen/rejected columns without `"ranking": true`, an unknown column role or tag,
            or a bad num_samples.
    """
    registry = load_registry(registry_path)
    if name not in registry:
        close = difflib.get_close_matches(name, list(registry), n=3)
        hint = f"; did you mean {', '.join(close)}" if close else ""
        raise ValueError(f"data.path: {name!r} is not an entry of {registry_path}{hint} "
                         f"(entries: {', '.join(sorted(registry))})")
    info = registry[name]
    where = f"data.registry_path: {registry_path} entry {name!r}"
    if "file_name" not in info and "hf_hub_url" not in info:
        remote = {k: info[k] for k in UNSUPPORTED_SOURCES if k in info}
        raise ValueError(f"{where} has neither file_name nor hf_hub_url (source {remote} is not "
                         f"supported); download it and add \"file_name\" with its path under "
                         f"the dataset dir, or give its Hugging Face id as \"hf_hub_url\"")
    formatting = info.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise ValueError(f"{where}: formatting {formatting!r} is not supported; use one of "
                         f"{list(FORMATTINGS)}")
    ranking = bool(info.get("ranking"))
    columns = dict(DEFAULT_COLUMNS[formatting]) | (RANKING_COLUMNS if ranking else {})
    for role, key in dict(info.get("columns") or {}).items():
        if role in UNSUPPORTED_COLUMNS:
            raise ValueError(f"{where}: column {role!r} is not supported (text only); "
                             f"remove it from \"columns\"")
        if role in RANKING_COLUMNS and not ranking:
            raise ValueError(f"{where}: column {role!r} belongs to preference data; add "
                             f"\"ranking\": true to the entry (and train it with "
                             f"train.method: dpo), or remove it from \"columns\"")
        if role not in columns:
            raise ValueError(f"{where}: unknown column role {role!r} for {formatting}; "
                             f"known: {sorted(columns)}")
        columns[role] = key
    tags = dict(DEFAULT_TAGS)
    for tag, value in dict(info.get("tags") or {}).items():
        if tag not in tags:
            raise ValueError(f"{where}: unknown tag {tag!r}; known: {sorted(tags)}")
        tags[tag] = value
    num = info.get("num_samples")
    if num is not None and (not isinstance(num, int) or num < 1):
        raise ValueError(f"{where}: num_samples must be an int >= 1; got {num!r}")
    base = Path(dataset_dir) if dataset_dir else Path(registry_path).parent
    local = base / info["file_name"] if "file_name" in info else None
    return RegistryEntry(name=name, path=local, hub_id="" if local else info["hf_hub_url"],
                         subset=str(info.get("subset") or ""),
                         split=str(info.get("split") or "train"),
                         folder=str(info.get("folder") or ""), formatting=formatting,
                         columns=columns, tags=tags, num_samples=num, ranking=ranking)


def _column(record: Mapping, key: str | None, role: str):
    """record[key] or raise KeyError naming the role (the caller adds record and file)."""
    if key not in record or record[key] is None:
        raise KeyError(f"column {key!r} (role {role!r}) is missing; the record has "
                       f"{sorted(record)}")
    return record[key]


def _answer_of(text: str) -> str | None:
    """Exact-match answer when the response carries a marker (GSM8K `####`, MetaMathQA)."""
    has_marker = "####" in text or "The answer is:" in text
    return extract_final_answer(text) if has_marker else None


def _alpaca_prompt(record: Mapping, columns: Mapping[str, str | None]) -> list[Message]:
    """The system turn, the history turns (assistant ones trained) and the user turn (prompt
    and query joined with a newline) of an alpaca record.

    Raises:
        KeyError: the mapped prompt column is missing.
    """
    messages = []
    if columns["system"] and record.get(columns["system"]):
        messages.append(Message(role="system", content=str(record[columns["system"]])))
    for old_prompt, old_response in (record.get(columns["history"]) or []
                                     if columns["history"] else []):
        messages.append(Message(role="user", content=str(old_prompt)))
        messages.append(Message(role="assistant", content=str(old_response), train=True))
    parts = [str(_column(record, columns["prompt"], "prompt"))]
    if columns["query"] and record.get(columns["query"]):
        parts.append(str(record[columns["query"]]))
    messages.append(Message(role="user", content="\n".join(parts)))
    return messages


def alpaca_example(record: Mapping, columns: Mapping[str, str | None]) -> Example:
    """An alpaca-formatted record (LlamaFactory AlpacaDatasetConverter conventions).

    Raises:
        KeyError: a mapped prompt or response column is missing.
    """
    messages = _alpaca_prompt(record, columns)
    response = _column(record, columns["response"], "response")
    if not isinstance(response, str):
        raise TypeError(f"column {columns['response']!r} must be a string; got "
                        f"{type(response).__name__}")
    messages.append(Message(role="assistant", content=response, train=True))
    return Example(messages=tuple(messages), answer=_answer_of(response))


def _sharegpt_turns(record: Mapping, columns: Mapping[str, str | None],
                    tags: Mapping[str, str]) -> list[Message]:
    """The system turn (a leading system-tag turn, else the system column) and the alternating
    user/assistant turns of a sharegpt record, assistant turns trained.

    Raises:
        KeyError: the messages column or a turn's role/content key is missing.
        ValueError: a tool turn, or a role tag that breaks the user/assistant alternation.
    """
    turns = list(_column(record, columns["messages"], "messages"))
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    messages = []
    if columns["system"] and record.get(columns["system"]):
        messages.append(Message(role="system", content=str(record[columns["system"]])))
    elif turns and turns[0].get(role_tag) == tags["system_tag"]:
        messages.append(Message(role="system", content=str(turns[0][content_tag])))
        turns = turns[1:]
    expected = (tags["user_tag"], tags["assistant_tag"])
    for i, turn in enumerate(turns):
        tag = turn[role_tag]
        if tag in (tags["observation_tag"], tags["function_tag"]):
            raise ValueError(f"turn {i} is a tool turn ({tag!r}); tool-use data is not "
                             f"supported")
        if tag != expected[i % 2]:
            raise ValueError(f"turn {i} has {role_tag}={tag!r}; expected {expected[i % 2]!r} "
                             f"(turns alternate {expected[0]!r}, {expected[1]!r}; check \"tags\")")
        is_assistant = i % 2 == 1
        messages.append(Message(role="assistant" if is_assistant else "user",
                                content=str(turn[content_tag]), train=is_assistant))
    return messages


def sharegpt_example(record: Mapping, columns: Mapping[str, str | None],
                     tags: Mapping[str, str]) -> Example:
    """A sharegpt-formatted record: user/assistant turns alternate, every assistant turn is
    trained; a leading system-tag turn (or the system column) is the system prompt.

    Raises:
        KeyError: the messages column or a turn's role/content key is missing.
        ValueError: a tool turn, a role tag that breaks the user/assistant alternation, or no
            assistant turn.
    """
    messages = _sharegpt_turns(record, columns, tags)
    if not any(m.train for m in messages):
        raise ValueError("the conversation has no assistant turn to train on")
    last = [m.content for m in messages if m.train][-1]
    return Example(messages=tuple(messages), answer=_answer_of(last))


def _sharegpt_response(turn: Mapping, tags: Mapping[str, str], role: str) -> dict[str, str]:
    """A sharegpt `chosen`/`rejected` message (an assistant-tag turn) -> role/content."""
    tag = turn[tags["role_tag"]]
    if tag != tags["assistant_tag"]:
        raise ValueError(f"the {role!r} message has {tags['role_tag']}={tag!r}; expected "
                         f"{tags['assistant_tag']!r} (an assistant turn; tool turns are not "
                         f"supported; check \"tags\")")
    return {"role": "assistant", "content": str(turn[tags["content_tag"]])}


def ranking_record(record: Mapping, entry: RegistryEntry) -> dict[str, Any]:
    """A record of a `"ranking": true` entry -> a preference record in the explicit-prompt
    layout `preference.parse_pair` reads: {"prompt": [role/content turns], "chosen": ...,
    "rejected": ...} (alpaca: the responses as given; sharegpt: each message's tags mapped).

    Raises:
        KeyError: a mapped column, or a turn's role/content key, is missing.
        ValueError: a tool turn, broken user/assistant alternation, a sharegpt conversation
            that does not end on a user turn, a response that is not an assistant turn.
    """
    if entry.formatting == "alpaca":
        prompt = _alpaca_prompt(record, entry.columns)
    else:
        prompt = _sharegpt_turns(record, entry.columns, entry.tags)
        if not prompt or prompt[-1].role != "user":
            raise ValueError("the conversation must end on a user turn (chosen and rejected "
                             "answer it)")
    out: dict[str, Any] = {"prompt": [{"role": m.role, "content": m.content} for m in prompt]}
    for role in RANKING_COLUMNS:
        value = _column(record, entry.columns[role], role)
        if entry.formatting == "sharegpt" and isinstance(value, Mapping):
            value = _sharegpt_response(value, entry.tags, role)
        out[role] = value
    return out


def _entry_table(entry: RegistryEntry):
    """The entry's records as a `datasets.Dataset` (its file or folder, or its Hub id)."""
    what = f"data.path: registry entry {entry.name!r}"
    if entry.path is not None:
        if not entry.path.exists():
            raise FileNotFoundError(f"{what}: {entry.path} does not exist; fix its file_name or "
                                    f"set data.dataset_dir")
        return load_table(entry.path, split=entry.split, what=what)
    return load_table(entry.hub_id, subset=entry.subset, split=entry.split, data_dir=entry.folder,
                      what=what)


def _converted(entry: RegistryEntry, convert: Callable[[Mapping], Any]) -> list:
    """`convert` of each of the entry's first `num_samples` records; a record that does not
    convert is one ValueError naming the entry, the source and the record index."""
    source = entry.path if entry.path is not None else entry.hub_id
    out: list = []
    for index, record in enumerate(_entry_table(entry)):
        try:
            out.append(convert(record))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise ValueError(f"data.path: registry entry {entry.name!r}: {source} record "
                             f"{index}: {msg}") from None
        if entry.num_samples is not None and len(out) >= entry.num_samples:
            break
    return out


def read_registry_dataset(registry_path: str | Path, name: str, *,
                          dataset_dir: str | Path | None = None) -> tuple[list[Example], str]:
    """Read entry `name` of a registry into `Example`s.

    Returns:
        (examples, "registry:<formatting>").

    Raises:
        FileNotFoundError: the registry or the entry's file is missing; a Hub entry offline
            and not in the datasets cache (`sources.load_table`).
        ValueError: see `resolve_entry` and `sources.load_table` (no records, unreadable
            file); a `"ranking": true` entry (preference pairs train with
            `train.method: dpo`); a record that does not convert names the source, the record
            index and the problem (e.g. the missing column).
    """
    entry = resolve_entry(registry_path, name, dataset_dir=dataset_dir)
    if entry.ranking:
        raise ValueError(f"data.path: registry entry {name!r} of {registry_path} is preference "
                         f"data (\"ranking\": true), which trains with train.method: dpo; set "
                         f"train.method: dpo, or name an entry without ranking")
    if entry.formatting == "alpaca":
        examples = _converted(entry, lambda r: alpaca_example(r, entry.columns))
    else:
        examples = _converted(entry, lambda r: sharegpt_example(r, entry.columns, entry.tags))
    return examples, f"registry:{entry.formatting}"


def read_ranking_records(registry_path: str | Path, name: str, *,
                         dataset_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The records of `"ranking": true` entry `name` as `ranking_record`s (first
    `num_samples`), for `preference.read_registry_pairs`.

    Raises:
        FileNotFoundError: as `read_registry_dataset`.
        ValueError: as `resolve_entry`; an entry without `"ranking": true`; a record that does
            not convert (`ranking_record`), naming the source and the record index.
    """
    entry = resolve_entry(registry_path, name, dataset_dir=dataset_dir)
    if not entry.ranking:
        raise ValueError(f"data.path: registry entry {name!r} of {registry_path} is not "
                         f"preference data (no \"ranking\": true); train.method: dpo reads "
                         f"ranking entries with chosen and rejected columns: name one, or "
                         f"train this entry with train.method: sft")
    return _converted(entry, lambda r: ranking_record(r, entry))
