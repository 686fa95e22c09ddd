"""MegaTrain run configs: recognising one, and converting it to a LazyTrain run config.

MegaTrain (arXiv 2604.05091) reads a YAML with the sections `model`, `dataset`, `training`,
`optimizer`, `memory`, `logging` (and `grpo` for its RL example, which becomes `train.method:
grpo` with our `grpo:` keys: `GRPO_KEYS`). `convert_megatrain` maps
every key it knows onto ours and lists each key it maps, sets or drops, with the reason, so
the user sees exactly what changed. The mapping tables are plain dicts read top to bottom.

Knows nothing of torch, models or solvers: input and output are plain dicts; the caller
validates the result with `lazytrain.config.config_from_dict` and writes it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

MEGATRAIN_SECTIONS = frozenset({"training", "dataset", "optimizer", "memory", "logging"})
"""Top-level sections that only MegaTrain's YAML has (ours: model, hardware, data, train,
planner, runtime, dist, grpo)."""

DEFAULT_HARDWARE = "h100-sxm"
"""MegaTrain configs name no hardware; its examples and README target one 80 GB H100."""

RENAMES: dict[str, tuple[str, str]] = {
    "training.batch_size": ("train.micro_batch", "sequences per micro-batch on one GPU"),
    "training.per_device_train_batch_size": ("train.micro_batch", "HF spelling"),
    "training.gradient_accumulation_steps": ("train.grad_accum", ""),
    "training.num_steps": ("train.steps", "optimizer steps"),
    "training.max_steps": ("train.steps", "HF spelling"),
    "training.num_train_epochs": ("train.epochs", "passes over the data"),
    "training.learning_rate": ("train.lr", "peak learning rate"),
    "training.warmup_steps": ("train.warmup_steps", ""),
    "training.weight_decay": ("train.weight_decay", "AdamW decoupled decay"),
    "training.max_grad_norm": ("train.clip_grad_norm", "global gradient-norm clip"),
    "training.seed": ("train.seed", ""),
    "optimizer.beta1": ("train.adam_beta1", ""),
    "optimizer.beta2": ("train.adam_beta2", ""),
    "optimizer.eps": ("train.adam_eps", ""),
    "dataset.max_seq_len": ("data.seq_len", "tokens per sequence"),
    "memory.checkpoint_interval": (
        "planner.megatrain_k",
        "MegaTrain's every-K-th-boundary rule, the baseline the plan is compared with; "
        "planner.policy stays milp (set it to megatrain to run MegaTrain's schedule)"),
}
"""MegaTrain dotted key -> (our dotted key, note). Values are copied unchanged."""

DROPPED: dict[str, str] = {
    "model.device": "the GPU is chosen by CUDA_VISIBLE_DEVICES (one rank per GPU)",
    "model.attn_implementation": "the engine runs the attention transformers selects for the "
                                 "model (sdpa where supported)",
    "model.trust_remote_code": "LazyTrain builds only transformers' own model classes, never "
                               "code downloaded with a checkpoint",
    "dataset.num_workers": "samples are tokenized once before training; no loader workers",
    "dataset.max_prompt_len": "a prompt is cut at data.seq_len - 1 tokens; data.seq_len "
                              "(dataset.max_seq_len) bounds prompt + completion",
    "dataset.max_response_len": "RL rollout length; supervised training has no rollouts "
                                "(with a grpo section it is grpo.max_new_tokens)",
    "optimizer.type": "LazyTrain's host AdamW (decoupled weight decay, as DeepSpeed CPUAdam's "
                      "default adamw_mode) runs the update",
    "memory.num_grad_slabs": "gradient D2H buffers follow the plan: each block's gradients "
                             "leave HBM in the window the plan gives them",
    "logging.log_interval": "every step is written to <run_dir>/metrics.jsonl",
    "logging.enable_timing": "per-window times are always measured (predicted vs measured "
                             "step in metrics.jsonl)",
}
"""MegaTrain dotted key -> why it has no LazyTrain counterpart."""

GRPO_KEYS: dict[str, tuple[str, str]] = {
    "grpo.n_rollouts_per_prompt": ("grpo.n", "group size: completions per prompt"),
    "grpo.num_generations": ("grpo.n", "TRL spelling"),
    "grpo.num_prompts_per_batch": ("grpo.prompts_per_step", "distinct prompts per step"),
    "grpo.clip_range": ("grpo.clip_eps", "epsilon of the clipped ratio"),
    "grpo.epsilon": ("grpo.clip_eps", "TRL spelling"),
    "grpo.kl_loss_coef": ("grpo.kl_coef", "per-token KL to the initial weights"),
    "grpo.beta": ("grpo.kl_coef", "TRL spelling"),
    "grpo.advantage_norm": ("grpo.scale_by_std", "divide by the group std"),
    "grpo.temperature": ("grpo.temperature", "rollout sampling temperature"),
    "grpo.top_p": ("grpo.top_p", ""),
    "grpo.max_new_tokens": ("grpo.max_new_tokens", ""),
    "grpo.max_completion_length": ("grpo.max_new_tokens", "TRL spelling"),
    "grpo.learning_rate": ("train.lr", "peak learning rate"),
    "dataset.max_response_len": ("grpo.max_new_tokens", "tokens generated per rollout"),
}
"""MegaTrain's (and TRL's) GRPO keys -> ours; their presence sets `train.method: grpo`."""

GRPO_DROPPED: dict[str, str] = {
    "grpo.kl_loss_type": "the KL term is the k3 estimator exp(ref - logp) - (ref - logp) - 1 "
                         "(MegaTrain's low_var_kl); kl, mse and abs are not offered",
}
"""GRPO keys with no counterpart, and why."""

DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}
"""MegaTrain / torch dtype names -> ours."""

HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "gsm8k", "main")}
"""MegaTrain's built-in dataset names (not in its dataset_info.json) -> (hub id, data.format,
data.subset: openai/gsm8k has the configurations main and socratic and loads neither unnamed;
MegaTrain's loader reads main)."""

_HF_CACHE_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/")
"""An HF cache snapshot path names its hub id: `models--Qwen--Qwen3.5-27B/snapshots/<sha>`."""


@dataclass(kw_only=True)
class Conversion:
    """The result of `convert_megatrain`."""

    config: dict = field(default_factory=dict)
    """Our run config as `{section: {key: value}}` (not yet validated)."""
    mapped: list[tuple[str, str, str]] = field(default_factory=list)
    """(MegaTrain key, our key = value, note) for every key carried over or derived."""
    dropped: list[tuple[str, str]] = field(default_factory=list)
    """(MegaTrain key, why) for every key with no counterpart."""
    model_id: str = ""
    """The model as MegaTrain names it (hub id), derived from an HF cache path if needed."""

    def set(self, dotted: str, value, *, source: str, note: str = "") -> None:
        """Set our key `dotted` to `value` and record where it came from."""
        section, key = dotted.split(".")
        self.config.setdefault(section, {})[key] = value
        self.mapped.append((source, f"{dotted} = {value!r}", note))

    def summary(self) -> str:
        """Human-readable report: one line per mapped and per dropped key."""
        lines = [f"mapped ({len(self.mapped)}):"]
        lines += [f"  {src:<40} -> {dst}" + (f"  ({note})" if note else "")
                  for src, dst, note in self.mapped]
        lines.append(f"dropped ({len(self.dropped)}):")
        lines += [f"  {src:<40} {why}" for src, why in self.dropped]
        return "\n".join(lines)


MEGATRAIN_MODEL_KEYS = frozenset({"device", "devices", "attn_implementation",
                                  "trust_remote_code"})
"""`model:` keys only MegaTrain's YAML has (both have `name` and `dtype`)."""


def looks_like_megatrain(raw: dict) -> bool:
    """True when a YAML mapping has MegaTrain's layout: a `training` section, two of its other
    sections, or a `model:` section with a key only MegaTrain has."""
    if not isinstance(raw, dict):
        return False
    sections = MEGATRAIN_SECTIONS & set(map(str, raw))
    model = raw.get("model")
    return ("training" in sections or len(sections) >= 2
            or (isinstance(model, dict) and bool(MEGATRAIN_MODEL_KEYS & set(map(str, model)))))


def convert_megatrain(raw: dict, *, hardware: str = DEFAULT_HARDWARE, run_dir: str = "",
                      train_keys: frozenset[str] = frozenset()) -> Conversion:
    """Convert a parsed MegaTrain YAML to our run config dict.

    Args:
        raw: the MegaTrain YAML as loaded by `yaml.safe_load`.
        hardware: our `hardware.preset` (MegaTrain configs name none).
        run_dir: `train.run_dir`; empty leaves our default.
        train_keys: the keys our `train:` section has; a MegaTrain key whose target is not
            among them is dropped with that reason (empty: every target is kept).

    Returns:
        The `Conversion` (config dict, mapped and dropped keys).

    Raises:
        ValueError: `raw` is not a mapping of sections, or the model has no name.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"a MegaTrain config is a mapping of sections; got "
                         f"{type(raw).__name__}")
    out = Conversion()
    flat = _flatten(raw)
    _convert_model(flat, out)
    _convert_dataset(flat, out)
    _convert_precision(flat, out)
    _convert_grpo(flat, out)
    for key, (target, note) in RENAMES.items():
        if key not in flat:
            continue
        value = flat.pop(key)
        section, name = target.split(".")
        if section == "train" and train_keys and name not in train_keys:
            out.dropped.append((key, f"this LazyTrain has no {target}; set train.steps"))
            continue
        out.set(target, value, source=key, note=note)
    for key in sorted(flat):
        section = key.split(".")[0]
        if key in DROPPED:
            out.dropped.append((key, DROPPED[key]))
        elif key in GRPO_DROPPED:
            out.dropped.append((key, GRPO_DROPPED[key]))
        else:
            out.dropped.append((key, "not a MegaTrain key this converter knows"))
        flat.pop(key)
    out.set("hardware.preset", hardware, source="(none)",
            note="MegaTrain configs name no hardware; change with --hardware")
    if run_dir:
        out.set("train.run_dir", run_dir, source="(none)", note="one run directory per config")
    return out


def _convert_grpo(flat: dict, out: Conversion) -> None:
    """A `grpo:` section -> `train.method: grpo` and our `grpo.*` keys (`GRPO_KEYS`); the
    step's rollouts fill the micro-batches: train.grad_accum = prompts x n / train.micro_batch
    (MegaTrain's GRPO config has no batch size: ours, 4, unless given)."""
    if not any(k.startswith("grpo.") for k in flat):
        return
    out.set("train.method", "grpo", source="grpo", note="a grpo section: GRPO training")
    for key, (target, note) in GRPO_KEYS.items():
        if key in flat:
            out.set(target, flat.pop(key), source=key, note=note)
    grpo = out.config.get("grpo", {})
    micro = flat.get("training.batch_size", flat.get("training.per_device_train_batch_size", 4))
    rows = grpo.get("prompts_per_step", 4) * grpo.get("n", 4)
    if rows % micro == 0 and "training.gradient_accumulation_steps" not in flat:
        out.set("train.grad_accum", rows // micro, source="grpo",
                note=f"{rows} rollouts per step in micro-batches of {micro}")


def _flatten(raw: dict) -> dict:
    """`{section: {key: value}}` -> `{"section.key": value}` (a scalar section stays whole)."""
    flat = {}
    for section, body in raw.items():
        if isinstance(body, dict):
            flat.update({f"{section}.{k}": v for k, v in body.items()})
        else:
            flat[str(section)] = body
    return flat


def model_id_of(name: str) -> str:
    """The hub id in a MegaTrain `model.name`: the name itself, or `org/model` read from an HF
    cache snapshot path (`.../models--Qwen--Qwen3.5-27B/snapshots/<sha>`)."""
    match = _HF_CACHE_SNAPSHOT.search(name)
    return f"{match.group(1)}/{match.group(2)}" if match else name


def _convert_model(flat: dict, out: Conversion) -> None:
    name = flat.pop("model.name", None)
    if not name:
        raise ValueError("model.name: a MegaTrain config must name its model (hub id or path)")
    out.model_id = model_id_of(str(name))
    local = str(name).startswith(("/", ".", "~"))
    note = ("a path on the MegaTrain machine: set model.config_path to the model's config.json"
            if local else "hub id: `lazytrain plan` fetches only its config.json into the HF "
            "cache; offline, set model.config_path to a local config.json")
    if out.model_id != name:
        note = f"HF cache snapshot of {out.model_id}, " + note
    out.set("model.config_path", str(name), source="model.name", note=note)
    out.set("model.name", out.model_id.rsplit("/", 1)[-1].lower(), source="model.name",
            note="label in reports")
    devices = flat.pop("model.devices", None)
    if isinstance(devices, list) and devices:
        out.set("dist.nproc_per_node", len(devices), source="model.devices",
                note="one rank per listed GPU, launched with torchrun")
        out.set("hardware.gpus_per_node", len(devices), source="model.devices",
                note="the listed GPUs share one node's DRAM and NVMe")


def _convert_precision(flat: dict, out: Conversion) -> None:
    raw = flat.pop("model.dtype", None)
    if raw is None:
        return
    dtype = DTYPES.get(str(raw))
    if dtype is None:
        out.dropped.append(("model.dtype", f"{raw!r} is not one of {sorted(DTYPES)}; "
                                           f"LazyTrain computes in bf16 or fp32"))
        return
    out.set("model.dtype", dtype, source="model.dtype", note="dtype of the saved weights")
    out.set("train.compute_dtype", dtype, source="model.dtype",
            note="streamed weights and activations")
    if dtype == "bf16":
        out.set("train.master_dtype", "bf16", source="model.dtype",
                note="MegaTrain keeps bf16 host masters and gradients with fp32 Adam moments "
                     "(12 B/param)")


def _convert_dataset(flat: dict, out: Conversion) -> None:
    path = flat.pop("dataset.path", None)
    name = flat.pop("dataset.name", None)
    dataset_dir = flat.pop("dataset.dataset_dir", None)
    query = flat.pop("dataset.query_field", None)
    response = flat.pop("dataset.response_field", None)
    if path is not None:
        out.set("data.path", str(path), source="dataset.path")
    elif name in HUB_DATASETS:
        hub_id, fmt, subset = HUB_DATASETS[name]
        out.set("data.path", hub_id, source="dataset.name",
                note=f"MegaTrain's built-in {name} loader reads this hub dataset")
        out.set("data.format", fmt, source="dataset.name")
        out.set("data.subset", subset, source="dataset.name",
                note=f"the configuration of {hub_id} MegaTrain's loader reads")
        if dataset_dir is not None:
            out.dropped.append(("dataset.dataset_dir", f"{name} is not a registry entry"))
    elif name is not None:
        out.set("data.path", str(name), source="dataset.name", note="a registry entry")
        folder = str(dataset_dir or "data")
        out.set("data.registry_path", f"{folder}/dataset_info.json",
                source="dataset.dataset_dir" if dataset_dir else "(none)",
                note="MegaTrain's registry file in its data folder (relative to where you run)")
        if dataset_dir is not None:
            out.set("data.dataset_dir", str(dataset_dir), source="dataset.dataset_dir")
    if query is None and response is None:
        return
    fields = "dataset.query_field + dataset.response_field"
    if (query, response) == ("query", "response"):
        out.set("data.format", "metamathqa", source=fields, note="the query/response schema")
    else:
        out.dropped.append((fields,
                            f"columns {query!r}/{response!r} are not a known schema; rename "
                            f"them to query/response or use a registry entry with columns"))


def with_train_keys(train_cls) -> frozenset[str]:
    """The field names of our `TrainConfig` (for `convert_megatrain(train_keys=...)`)."""
    return frozenset(f.name for f in dataclasses.fields(train_cls))
