"""YAML values against the sections' annotations: aliases, type checks, unknown keys.

Owns the spellings accepted besides ours (`KEY_ALIASES`, `VALUE_ALIASES`) and the checking of
one section's `{key: value}` against its dataclass's annotations (`build_section`: an unknown
key gets the closest valid one, a value of the wrong type the key and the expected type).
Knows nothing about files or overrides (`load.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from lazytrain.errors import ConfigError, ConfigTypeError


KEY_ALIASES: dict[str, str] = {
    "train.learning_rate": "train.lr",
    "train.per_device_train_batch_size": "train.micro_batch",
    "train.gradient_accumulation_steps": "train.grad_accum",
    "train.num_train_epochs": "train.epochs",
    "train.max_steps": "train.steps",
    "train.max_grad_norm": "train.clip_grad_norm",
    "train.save_every": "train.checkpoint_every_steps",
    "train.save_steps": "train.checkpoint_every_steps",
    "data.max_seq_len": "data.seq_len",
}
"""Spellings users bring from HF TrainingArguments and MegaTrain -> our key. The alias is
replaced before validation (errors and the saved config use our name); an alias whose target
this version lacks stays an unknown key."""

VALUE_ALIASES: dict[str, str] = {"bfloat16": "bf16", "float32": "fp32"}
"""torch dtype names -> ours, accepted wherever a dtype choice is expected."""



def build_section(section: str, cls: type, values: dict):
    """The dataclass `cls` of section `section` built from its YAML mapping `values`.

    Raises:
        ConfigError: an unknown key (the closest valid one named), an alias set together with
            its key, a choice not among the allowed ones, or a range check of `cls`.
        ConfigTypeError: a value of the wrong type (the key and the expected type named).
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in unalias(section, values, names).items():
        if key not in names:
            raise ConfigError(unknown_key(f"{section}.{key}",
                                          [f"{section}.{n}" for n in names]))
        kwargs[key] = coerce(f"{section}.{key}", hints[key], value)
    return cls(**kwargs)


def unalias(section: str, values: dict, names: list[str]) -> dict:
    """`values` with `KEY_ALIASES` spellings renamed to our keys (those this section has).

    Raises:
        ConfigError: an alias and its key both set.
    """
    out = {}
    for key, value in values.items():
        target = KEY_ALIASES.get(f"{section}.{key}", "").partition(".")[2]
        if target in names:
            if target in values:
                raise ConfigError(f"{section}.{key} and {section}.{target} are both set; "
                                 f"{section}.{key} is another name for {section}.{target}, "
                                 f"keep one")
            key = target
        out[key] = value
    return out


def unknown_key(dotted: str, valid: list[str]) -> str:
    """The message for an unknown key `dotted`: the closest of `valid`, else all of them."""
    dotted = str(dotted)  # a YAML key may be an int or a bool (`1: 2`)
    close = difflib.get_close_matches(dotted, valid, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(valid)}"
    return f"unknown config key {dotted}; {hint}"


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Check (and minimally convert) one value against its annotation.

    Ints are accepted for floats; numeric strings are accepted for floats because PyYAML reads
    `1e-4` (no dot) as a string. Nothing else is converted.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(key, inner[0], value)
    if origin is tuple:  # tuple[X, ...]: a YAML list, or one value standing for a list of one
        items = value if isinstance(value, list) else [value]
        return tuple(coerce(key, args[0], item) for item in items)
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads a bare off / on as a bool
        if isinstance(value, str) and VALUE_ALIASES.get(value) in args:
            value = VALUE_ALIASES[value]
        if value not in args:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, args))}; "
                              f"got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigTypeError(f"{key} must be a bool (true/false); got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{key} must be an int; got {value!r} "
                                  f"({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigTypeError(f"{key} must be a float; got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigTypeError(f"{key} must be a float; got {value!r} "
                              f"({type(value).__name__})")
    if tp is str:
        if not isinstance(value, str):
            raise ConfigTypeError(f"{key} must be a string; got {value!r} "
                                  f"({type(value).__name__})")
        return value
    if dataclasses.is_dataclass(tp):  # one mapping of a list of them, such as data.mix
        if not isinstance(value, dict):
            keys = ", ".join(f.name for f in dataclasses.fields(tp))
            raise ConfigTypeError(f"{key} must be a list of mappings with keys {keys}; got "
                                  f"{value!r}")
        return build_section(key, tp, value)
    raise TypeError(f"{key}: unsupported annotation {tp!r}")  # internal: a new field type
