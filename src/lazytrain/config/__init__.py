"""The run config: YAML in, frozen dataclasses out (docs/config.md lists every key).

One dataclass per section (`model`, `hardware`, `data`, `train`, `planner`, `runtime`, `dist`),
composed by `RunConfig`; every part of the program receives only its own section. The package's
API is the names below; the modules own one concern each:

- `sections.py`: the section dataclasses, their defaults, docs and range checks; `field_docs`.
- `checks.py`: the range-check helpers the sections call.
- `coerce.py`: YAML values against the annotations, unknown keys, the accepted aliases.
- `load.py`: `load_config` (YAML file + `--set` overrides), `config_from_dict`, `save_config`,
  the resolution of a relative `model.config_path`.

Imports neither torch nor a solver.
"""

from __future__ import annotations

from lazytrain.config.coerce import KEY_ALIASES, VALUE_ALIASES
from lazytrain.config.load import (apply_overrides, apply_overrides_to_dict, config_from_dict,
                                   load_config, resolve_model_path, save_config)
from lazytrain.config.sections import (HARDWARE_OVERRIDE_RANGE, SECTIONS, DataConfig,
                                       DistConfig, Dtype, HardwareConfig, ModelConfig,
                                       PlannerConfig, RunConfig, RuntimeConfig, TrainConfig,
                                       field_docs)

__all__ = [
    "HARDWARE_OVERRIDE_RANGE", "KEY_ALIASES", "SECTIONS", "VALUE_ALIASES", "DataConfig",
    "DistConfig", "Dtype", "HardwareConfig", "ModelConfig", "PlannerConfig", "RunConfig",
    "RuntimeConfig", "TrainConfig", "apply_overrides", "apply_overrides_to_dict",
    "config_from_dict", "field_docs", "load_config", "resolve_model_path", "save_config",
]
