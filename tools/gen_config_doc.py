"""Generate docs/config.md from the config dataclasses: every key's type, default, unit and
meaning, the accepted alternative spellings, and the data formats with one example each.

Run from the repository root after changing a config field or a data format:

    python tools/gen_config_doc.py            # rewrite docs/config.md
    python tools/gen_config_doc.py --check    # exit 1 when docs/config.md is stale

The meaning column is the docstring under each field (`lazytrain.config.field_docs`); units
come from the key's suffix, which the config style requires (`hbm_gb`, `time_limit_s`).
`tests/test_config_doc.py` fails when a key is missing or the file differs from this output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lazytrain.config import (KEY_ALIASES, SECTIONS, VALUE_ALIASES,  # noqa: E402
                              field_docs)
from lazytrain.data.formats import FORMATS, detect_format  # noqa: E402

OUT = ROOT / "docs" / "config.md"

UNIT_SUFFIXES = (
    ("_gb_per_s", "GB/s"), ("_gb", "GB"), ("_bytes", "bytes"), ("_ms", "ms"), ("_s", "s"),
    ("_tflops", "TFLOP/s"), ("_tokens", "tokens"), ("_fraction", "fraction"),
    ("_ratio", "fraction"), ("seq_len", "tokens"), ("micro_batch", "sequences"),
    ("grad_accum", "micro-batches"), ("_steps", "steps"), ("_every", "steps"),
    ("steps", "steps"), ("epochs", "epochs"), ("_windows", "windows"), ("_threads", "threads"),
    ("threads", "threads"),
)
"""Key suffix -> unit, first match wins (GB = 1e9 bytes, as in hardware.json)."""

FORMAT_EXAMPLES: dict[str, dict] = {
    "alpaca": {"instruction": "Add the numbers.", "input": "17 + 25",
               "output": "17 + 25 = 42.\n#### 42"},
    "gsm8k": {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
              "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    "metamathqa": {"query": "What is 6 times 7?",
                   "response": "6 * 7 = 42. The answer is: 42"},
    "messages": {"messages": [{"role": "system", "content": "You are concise."},
                              {"role": "user", "content": "What is 2 + 2?"},
                              {"role": "assistant", "content": "4"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "What is 2 + 2?"},
                                   {"from": "gpt", "value": "4"}]},
    "prompt_completion": {"prompt": "What is 2 + 2?", "completion": "2 + 2 = 4.\n#### 4"},
    "text": {"text": "The quick brown fox jumps over the lazy dog."},
}
"""One record per format in `lazytrain.data.FORMATS` (the test parses each one with it)."""

REGISTRY_EXAMPLE = {
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "math_qa": {"file_name": "math/train.jsonl", "formatting": "alpaca",
                "columns": {"prompt": "question", "response": "answer"}},
    "chat": {"file_name": "chat.json", "formatting": "sharegpt",
             "columns": {"messages": "messages"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                      "assistant_tag": "assistant"}},
}
"""A LlamaFactory `dataset_info.json` with the three kinds of entry (`lazytrain.data.registry`)."""


def unit_of(key: str) -> str:
    """The unit a key's suffix names, or "-"."""
    for suffix, unit in UNIT_SUFFIXES:
        if key.endswith(suffix):
            return unit
    return "-"


def type_text(tp) -> str:
    """A YAML-reader's name for an annotation: `int`, `float or null`, `one of: a, b`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of: " + ", ".join(f"`{a}`" for a in args)
    if origin is tuple:
        return "list of " + type_text(args[0]).removeprefix("one of: ")
    return getattr(tp, "__name__", str(tp))


def default_text(value) -> str:
    """The default as YAML would spell it."""
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section_table(name: str, cls) -> list[str]:
    """The markdown table of one section: key, type, default, unit, meaning."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    lines = [f"## `{name}:`", "", _cell(cls.__doc__ or ""), "",
             "| key | type | default | unit | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"| `{name}.{f.name}` | {_cell(type_text(hints[f.name]))} | "
                     f"{default_text(default)} | {unit_of(f.name)} | {_cell(docs[f.name])} |")
    return lines + [""]


def aliases_section() -> list[str]:
    """The accepted alternative spellings."""
    lines = ["## Other spellings accepted", "",
             "Keys and values users bring from HF TrainingArguments and MegaTrain; they are",
             "renamed before validation, and the saved config uses our name.", "",
             "| written | read as |", "|---|---|"]
    lines += [f"| `{alias}` | `{key}` |" for alias, key in KEY_ALIASES.items()]
    lines += [f"| value `{alias}` | `{value}` |" for alias, value in VALUE_ALIASES.items()]
    return lines + [""]


def formats_section() -> list[str]:
    """The data formats (`data.format`), one example record each."""
    lines = ["## Data formats (`data.format`)", "",
             "`data.path` names a JSON (a list of records), JSONL (one record per line),",
             "Parquet, Arrow or CSV file, a folder of them, or a Hugging Face Hub dataset id",
             "(`data.subset`, `data.split`), all read with `datasets`; `auto` picks the first",
             "format below whose required columns the dataset has. `embedded:arithmetic` needs",
             "no file (generated word problems).", ""]
    for name, spec in FORMATS.items():
        lines += [f"### `{name}`", "", f"Required columns: "
                  + ", ".join(f"`{c}`" for c in spec.required) + ". One JSONL line:", "",
                  "```json", json.dumps(FORMAT_EXAMPLES[name]), "```", ""]
    lines += ["### LlamaFactory registry (`data.registry_path`)", "",
              "A `dataset_info.json` maps names to files under `data.dataset_dir`",
              "(`file_name`) or to Hub datasets (`hf_hub_url`, with `subset` and `split`);",
              "`data.path` then names an entry. `formatting` is `alpaca` (default) or",
              "`sharegpt`, and `columns` / `tags` rename the fields:", "",
              "```json", json.dumps(REGISTRY_EXAMPLE, indent=1), "```", ""]
    return lines


def render() -> str:
    """The whole docs/config.md text."""
    lines = ["# Run config reference", "",
             "Generated from the config dataclasses (`src/lazytrain/config/sections.py`) by",
             "`python tools/gen_config_doc.py`; do not edit by hand. Each section is one YAML",
             "mapping; `--set section.key=value` overrides any key. GB means 1e9 bytes.", ""]
    for name, cls in SECTIONS.items():
        lines += section_table(name, cls)
    lines += aliases_section() + formats_section()
    return "\n".join(lines).rstrip() + "\n"


def check_examples() -> None:
    """Every format has an example, and each example is detected as and parsed by its format.

    Raises:
        ValueError: a format without an example, or an example its format refuses.
    """
    for name, spec in FORMATS.items():
        if name not in FORMAT_EXAMPLES:
            raise ValueError(f"tools/gen_config_doc.py: no FORMAT_EXAMPLES entry for {name!r}")
        record = FORMAT_EXAMPLES[name]
        if detect_format(record) != name:
            raise ValueError(f"the {name} example is detected as {detect_format(record)}")
        spec.convert(record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/config.md differs from the generated text")
    args = parser.parse_args(argv)
    check_examples()
    text = render()
    if args.check:
        stale = not OUT.is_file() or OUT.read_text() != text
        if stale:
            print(f"{OUT} is stale: run python tools/gen_config_doc.py", file=sys.stderr)
        return int(stale)
    from lazytrain.atomic import write_text_atomic
    print(write_text_atomic(OUT, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
