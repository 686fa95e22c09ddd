"""A model cut to some of its layers: the run's architecture with fewer blocks, so that what a
block of each kind costs is measured without building the whole model.

Owns `cut_config` (a copy of an HF config keeping chosen layers: `num_hidden_layers` and
`layer_types` cut to them, other fields optionally overridden) and `profile_layers` (the layers
a per-kind profile needs: the first layer of each block kind). The calibration
(`train.setup.measure_config_profile`) and the engine-overhead twins
(`profile.overhead.twin_adapter`) build their models from such configs. Block kinds and
parameter counts come from `spec.model.ModelSpec`, which mirrors the `transformers` modules.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from lazytrain.models.families import text_model_config
from lazytrain.spec.model import ModelSpec


def cut_config(hf_config: Any, layers: Sequence[int], *, overrides: dict | None = None) -> Any:
    """A copy of `hf_config` (its text model's config, `families.text_model_config`) holding
    only `layers`.

    `num_hidden_layers` becomes len(layers) and `layer_types`, when the config lists them, the
    kept layers' entries in the order given; an index past the config's last layer takes entry
    index % count (a twin of a model already cut repeats its kinds). Fields the family derives
    from the layer index (DeepSeek-V2's `first_k_dense_replace`) are left as they are:
    `profile_layers` checks that a cut keeps each layer's kind.

    Args:
        hf_config: a `transformers.PretrainedConfig` (not modified).
        layers: indices of the layers to keep (0-based).
        overrides: attribute -> value set on the copy first (a smaller shape).

    Raises:
        ValueError: `layers` is empty.
    """
    if not layers:
        raise ValueError("cut_config: no layers to keep; give at least one layer index")
    cfg = copy.deepcopy(text_model_config(hf_config))
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    types = getattr(cfg, "layer_types", None)
    cfg.num_hidden_layers = len(layers)
    if types:
        cfg.layer_types = [types[j % len(types)] for j in layers]
    return cfg


def block_shapes(hf_config: Any) -> tuple[tuple[str, int], ...]:
    """(kind, parameters) of each block of `hf_config`'s model (`ModelSpec`).

    Raises:
        ValueError: as `ModelSpec.from_hf_config` (unsupported family, a missing key).
    """
    spec = ModelSpec.from_hf_config(text_model_config(hf_config).to_dict())
    return tuple((b.kind, b.params) for b in spec.blocks)


def profile_layers(hf_config: Any) -> tuple[int, ...]:
    """The layers a per-kind profile is measured on: the first layer of each block kind.

    A config cut to exactly those layers (`cut_config`) is used when each keeps its kind and
    parameter count there; a family whose kinds follow the layer index in a way `layer_types`
    does not restate (DeepSeek-V2's leading `first_k_dense_replace` dense layers) gets the
    layers from 0 up to the last first-of-a-kind instead, which its index rules keep.

    Returns:
        increasing layer indices (a llama: (0,); Gemma3's 5:1 sliding/full pattern: (0, 5)).

    Raises:
        ValueError: as `ModelSpec.from_hf_config`; or not even the leading layers keep their
            kinds when cut (the family is named).
    """
    full = block_shapes(hf_config)
    kinds = [kind for kind, _ in full]
    firsts = tuple(kinds.index(kind) for kind in dict.fromkeys(kinds))
    for layers in (firsts, tuple(range(firsts[-1] + 1))):
        if block_shapes(cut_config(hf_config, layers)) == tuple(full[j] for j in layers):
            return layers
    raise ValueError(f"model config: a {type(hf_config).__name__} cut to its first "
                     f"{firsts[-1] + 1} layers changes their block kinds; set runtime.calibrate=off "
                     f"(analytic costs) or hardware.profile_path")
