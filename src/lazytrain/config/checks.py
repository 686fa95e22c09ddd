"""The range checks of the config sections: one call per rule, one error naming the key.

Owns `check` (a rule on one value) and `check_finite` (no inf or nan in a section's floats),
which every section's `__post_init__` calls; knows nothing about YAML or the sections' fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lazytrain.errors import ConfigError


def check(cond: bool, key: str, rule: str, value: Any) -> None:
    """Raise `ConfigError("<key> must be <rule>; got <value>")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{key} must be {rule}; got {value!r}")


def check_finite(obj: Any, section: str) -> None:
    """Raise `ConfigError("<section>.<key> must be a finite number; got inf")` for any float
    field of the dataclass `obj` that is inf or nan (YAML `.inf`, `.nan`, `1e400`): the range
    checks below compare with `>`, which inf passes and nan silently fails with a wrong rule."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name} must be a finite number; got {value!r}")

