"""Reading and writing run configs: YAML file -> `RunConfig`, `--set` overrides, saving.

Loading (`load_config`) is: YAML -> plain dict -> `--set section.key=value` overrides applied to
the dict -> unknown keys rejected (dotted path + closest valid key) -> values checked against
each field's type (the key and the expected type named) -> dataclasses built, whose
`__post_init__` checks ranges ("planner.time_limit_s must be > 0; got -1").

Model path resolution: a relative `model.config_path` is resolved when the YAML is loaded, in
this order: the YAML file's directory, the current directory, then a `shared/` tree next to or
above the repository or the current directory (where the reference model configs that the
shipped `configs/*.yaml` name live; the repository does not copy them). The first existing
file or directory wins and is stored as an absolute path (so the resolved config saved with a
run or plan is unambiguous). A value that resolves to nothing (e.g. the built-in name
`smollm2-135m-instruct`) is kept as written and resolved by name later
(`lazytrain.spec.model.BUILTIN_CONFIGS` for planning; the model loader for weights).

Owns the file and override handling and the model path; the keys live in `sections.py`, the
type checks and aliases in `coerce.py`. Imports neither torch nor a solver.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import yaml

from lazytrain.atomic import write_text_atomic
from lazytrain.config.coerce import build_section, unknown_key
from lazytrain.config.sections import SECTIONS, ModelConfig, RunConfig
from lazytrain.errors import ConfigError, ConfigFileNotFoundError, ConfigTypeError
from lazytrain.megatrain import MEGATRAIN_SECTIONS, looks_like_megatrain


def load_config(path: str | Path | None = None,
                overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a run config YAML, apply `section.key=value` overrides, validate.

    Args:
        path: YAML file; None gives the embedded default job (all defaults).
        overrides: strings `section.key=value` (the `--set` flag), applied in order before
            validation; the value is parsed as YAML (`train.lr=3e-4`, `hardware.hbm_gb=40`).

    Returns:
        The validated, frozen `RunConfig`; a relative `model.config_path` resolved as the module
        docstring says.

    Raises:
        ConfigFileNotFoundError: `path` does not exist (a `FileNotFoundError`).
        ConfigError: a MegaTrain YAML (the converter command named), malformed YAML (file,
            line and problem named), unknown key (dotted path
            and closest valid key named), malformed override, or a value out of range or
            non-finite (`train.lr must be > 0; got -1`, `train.lr must be a finite number`).
        ConfigTypeError: a value of the wrong type (key and expected type named).

    Every error is a `lazytrain.errors.ConfigError` (a `UserError` and a `ValueError`).
    """
    raw: dict = {}
    base_dir = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigFileNotFoundError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(exc)}); fix the "
                             f"syntax at that line") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigTypeError(f"{path}: top level must be a mapping of sections; "
                            f"got {type(loaded).__name__}")
        raw = loaded or {}
        base_dir = path.resolve().parent
        if looks_like_megatrain(raw):
            raise ConfigError(f"{path} is a MegaTrain config (sections "
                             f"{', '.join(sorted(MEGATRAIN_SECTIONS & set(map(str, raw))))}"
                             f"); convert it first: lazytrain convert megatrain {path} "
                             f"--out {path.stem}-lazytrain.yaml")
    raw = apply_overrides_to_dict(raw, overrides)
    cfg = config_from_dict(raw)
    resolved = resolve_model_path(cfg.model.config_path, base_dir=base_dir)
    if resolved != cfg.model.config_path:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, config_path=resolved))
    return cfg


def apply_overrides(cfg: RunConfig, overrides: typing.Sequence[str]) -> RunConfig:
    """A copy of `cfg` with `section.key=value` overrides applied and validated again."""
    return config_from_dict(apply_overrides_to_dict(cfg.to_dict(), overrides))


def apply_overrides_to_dict(raw: dict, overrides: typing.Sequence[str]) -> dict:
    """Apply `section.key=value` strings to a nested dict (a new dict; `raw` is not changed).

    Raises:
        ConfigError: an override without `=`, not of the form `section.key`, or whose value
            is not valid YAML.
        ConfigTypeError: the section is not a mapping.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override key {dotted!r} must be section.key "
                             f"(e.g. train.lr=3e-4)")
        section, key = parts
        if out.get(section) is None:  # absent, or an empty `section:` in the YAML
            out[section] = {}
        if not isinstance(out[section], dict):
            raise ConfigTypeError(f"{section} must be a mapping; got {out[section]!r}")
        try:
            out[section][key] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML "
                             f"({_yaml_problem(exc)}); quote it or fix it") from None
    return out


def _yaml_problem(exc: Exception) -> str:
    """One line describing a PyYAML error: "line 2, column 1: expected ',' or ']'"."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(problem)


def config_from_dict(raw: dict) -> RunConfig:
    """Build a validated `RunConfig` from `{section: {key: value}}` (missing = default).

    Raises:
        ConfigError: unknown section or key (closest valid one named), or a range violation.
        ConfigTypeError: a value of the wrong type.
    """
    sections = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(unknown_key(name, list(SECTIONS)))
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigTypeError(f"{name} must be a mapping of keys; got {value!r}")
        if name == "model":
            value = _model_source_from_name(value)
        sections[name] = build_section(name, SECTIONS[name], value)
    return RunConfig(**sections)


def _model_source_from_name(model: dict) -> dict:
    """A `model:` section that names a model (`model.name`) but no `model.config_path` must not
    train the built-in default under that name: a hub id (`org/name`) or an existing path in
    `name` becomes the config path; anything else is refused.

    Raises:
        ConfigError: `model.name` is set, `model.config_path` is not, and the name is neither a
            hub id nor a path.
    """
    name = model.get("name")
    if "config_path" in model or not isinstance(name, str) or not name:
        return model
    builtin = ModelConfig.__dataclass_fields__["config_path"].default
    if name == builtin or re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) or \
            Path(name).expanduser().exists():
        return {**model, "config_path": name}
    raise ConfigError(f"model.config_path: not set, but model.name is {name!r}; set "
                     f"model.config_path to the model's config.json, directory or hub id "
                     f"(org/name). The built-in {builtin} is used only when no model is named")


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write `cfg` as YAML atomically (temp file in the same directory + rename).

    Returns:
        The path written.
    """
    return write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def resolve_model_path(config_path: str, *, base_dir: Path | None = None) -> str:
    """Resolve a relative `model.config_path` to an absolute existing path, else keep it.

    Candidates, in order: `base_dir / p` (the YAML's directory), `cwd / p`, and, when `p` has a
    `shared` component, its tail under `shared/` next to or above the repository root (the
    parent of the YAML's `configs/` directory) and the current directory.

    Returns:
        The first existing candidate as an absolute path string, or `config_path` unchanged
        (absolute paths, built-in names, paths that do not exist here).
    """
    p = Path(config_path).expanduser()
    if p.is_absolute():
        return str(p)
    candidates = []
    if base_dir is not None:
        candidates.append(base_dir / p)
    candidates.append(Path.cwd() / p)
    parts = p.parts
    if "shared" in parts:
        tail = Path(*parts[len(parts) - parts[::-1].index("shared"):])
        roots = [Path.cwd()]
        if base_dir is not None:
            roots = [base_dir.parent, base_dir] + roots
        for root in roots:
            candidates += [root / "shared" / tail, root.parent / "shared" / tail]
    for cand in candidates:
        if cand.exists():
            return str(cand.resolve())
    return config_path

