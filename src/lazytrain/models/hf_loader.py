"""Build a `ModelAdapter` from an HF config or a local HF model directory, and save one back.

Owns: building the module skeleton (on the meta device for real checkpoints), filling the
host parameter store from (sharded) safetensors tensor by tensor so host memory holds one
copy of the model, and writing the store back in the same sharded layout with an index json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
import safetensors.torch  # save_file read at the call, so a test can make the disk full
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import extract_weight_conversions_for_model

from lazytrain.atomic import atomic_path
from lazytrain.models.adapter import ModelAdapter, check_distinct_layers
from lazytrain.models.families import _get, resolve_layout, text_model_config
from lazytrain.models.host_params import HostParams

SHARD_BYTES = 2 * 1024**3
"""Largest safetensors shard written by `save_hf_dir`, bytes (HF's default is 5 GB)."""


def _store_for(model: nn.Module, *, master_dtype: str, masters=None,
               fills_masters: bool = True) -> HostParams:
    """An empty host store with the layout of `model`'s blocks and ends (`masters`,
    `fills_masters`: as `HostParams`)."""
    layout = resolve_layout(model)
    layers = list(_get(model, layout.layers))
    check_distinct_layers(layers, path=layout.layers)
    block_shapes = [{n: tuple(p.shape) for n, p in layer.named_parameters()} for layer in layers]
    prefixes = [f"{layout.layers}.{j}." for j in range(len(layers))]
    block_ids = {id(p) for layer in layers for p in layer.parameters()}
    ends = {n: tuple(p.shape) for n, p in model.named_parameters() if id(p) not in block_ids}
    return HostParams(block_shapes, prefixes, ends, master_dtype=master_dtype, masters=masters,
                      fills_masters=fills_masters)


def _to_meta(model: nn.Module, layout) -> None:
    """Drop the module's own weights (the store holds them); rotary buffers stay real."""
    for path in (layout.embed, layout.layers, layout.norm, layout.head):
        _get(model, path).to("meta")


def load_adapter_from_config(hf_config, *, dtype: str = "fp32", master_dtype: str = "fp32",
                             seed: int | None = None, masters=None,
                             fills_masters: bool = True) -> ModelAdapter:
    """Random-init model from an HF config (tests, tiny models), weights moved into the store.

    Args:
        hf_config: `transformers.PretrainedConfig` of a supported decoder-only family.
        dtype: compute dtype name ("fp32"|"bf16"); accepted for symmetry with the run config,
            the host store always holds `master_dtype` and the Engine casts device copies.
        master_dtype: "fp32" or "bf16" (`host_params.MASTER_DTYPES`); bf16 masters hold the
            initial fp32 weights rounded to nearest.
        seed: torch seed for the initialization (None: current RNG).
        masters, fills_masters: where the store's masters live and whether this process
            writes them (`HostParams`; data parallel: one shared copy per node).
    """
    hf_config = text_model_config(hf_config)
    if not fills_masters:  # another process writes the weights: never build them here
        return _layout_only_adapter(_meta_skeleton(hf_config)[0], master_dtype=master_dtype,
                                    masters=masters)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return adapter_from_model(model, master_dtype=master_dtype, masters=masters,
                              fills_masters=fills_masters)


def _meta_skeleton(hf_config) -> tuple[nn.Module, object]:
    """(model on the meta device with a real rotary module, its layout): no weight memory."""
    hf_config = text_model_config(hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    layout = resolve_layout(model)
    rotary = _get(model, layout.rotary)
    parent_path, _, attr = layout.rotary.rpartition(".")
    with torch.device("cpu"):  # the rotary inv_freq buffer must be real, not meta
        setattr(_get(model, parent_path), attr, type(rotary)(config=model.config))
    return model, layout


def _layout_only_adapter(model: nn.Module, *, master_dtype: str, masters) -> ModelAdapter:
    """The adapter of a rank whose masters another process fills (`fills_masters=False`):
    the store's layout from the meta skeleton, no weights read or built."""
    store = _store_for(model, master_dtype=master_dtype, masters=masters, fills_masters=False)
    return ModelAdapter(model, store)


def adapter_from_model(model: nn.Module, *, master_dtype: str = "fp32", masters=None,
                       fills_masters: bool = True) -> ModelAdapter:
    """Move an instantiated HF model's weights into a new host store (the model becomes a
    meta-device skeleton) and wrap it.

    Each parameter's storage is released right after its copy, so the model must not share
    parameter storage with tensors the caller still uses (e.g. `load_state_dict(assign=True)`).
    """
    store = _store_for(model, master_dtype=master_dtype, masters=masters,
                       fills_masters=fills_masters)
    with torch.no_grad():
        for name, p in model.named_parameters():
            group, local = store.locate(name)
            if fills_masters:
                group.master_views[local].copy_(p.detach())
            # free the module's copy at once (shape kept for `_to_meta`): host memory peaks
            # near one model, not two; file-mapped (safetensors mmap) storage is not resizable
            # and costs no anonymous memory anyway
            storage = p.detach().untyped_storage()
            if storage.resizable():
                storage.resize_(0)
    _to_meta(model, resolve_layout(model))
    return ModelAdapter(model, store)


def weight_files(model_dir: Path, *, prefix: str = "model") -> list[Path]:
    """The safetensors files of `model_dir` named `<prefix>.safetensors`, or the shards its
    `<prefix>.safetensors.index.json` lists (as `save_hf_dir` writes them).

    Raises:
        FileNotFoundError: neither file exists.
    """
    index = model_dir / f"{prefix}.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / f"{prefix}.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{model_dir}: no {prefix}.safetensors or "
                            f"{prefix}.safetensors.index.json")


def checkpoint_name(stored: str, layout) -> str | None:
    """The model parameter name of checkpoint tensor `stored`, or None to skip it
    (`DecoderLayout.checkpoint_skips`, then the first matching `checkpoint_renames` prefix)."""
    if stored.startswith(layout.checkpoint_skips):
        return None
    for old, new in layout.checkpoint_renames:
        if stored.startswith(old):
            return new + stored[len(old):]
    return stored


def _needs_hf_conversion(model_dir: Path, model: nn.Module, layout) -> bool:
    """True when some checkpoint tensor (after `checkpoint_name`) is not a model parameter and
    HF registers a checkpoint conversion for the model (reads the safetensors headers only)."""
    params = {n for n, _ in model.named_parameters()} | {f"{layout.head}.weight"}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names = {checkpoint_name(k, layout) for k in f.keys()} - {None}
        if names - params:
            return extract_weight_conversions_for_model(model) is not None
    return False


def load_adapter_from_dir(model_dir: str | Path, *, dtype: str = "fp32",
                          master_dtype: str = "fp32", masters=None,
                          fills_masters: bool = True) -> ModelAdapter:
    """Load a local HF model directory block by block into the host store.

    The skeleton is built on the meta device; each safetensors tensor is read and copied
    straight into its slot of the master buffers (converted by `copy_`: a fp32 checkpoint into
    bf16 masters is rounded to nearest, a bf16 one into fp32 masters upcast exactly), so host
    memory peaks at one model copy plus one tensor. `dtype` is accepted for symmetry (see
    `load_adapter_from_config`); `master_dtype` as there.

    Checkpoints whose tensors need HF's checkpoint conversion (the per-expert MoE layout
    `experts.<e>.gate_proj/up_proj/down_proj` or Mixtral's `block_sparse_moe.experts.<e>.w1..w3`,
    fused into `experts.gate_up_proj`/`down_proj` by `transformers.conversion_mapping`) are
    loaded by HF's `from_pretrained` in fp32 and moved into the store parameter by parameter
    (`adapter_from_model`): HF owns the conversion rules; host memory peaks near one fp32 model.

    `masters`, `fills_masters`: as `load_adapter_from_config` (a rank that does not fill the
    masters still reads the tensor names, so a missing weight is reported on every rank; for a
    checkpoint that needs HF's conversion it reads nothing and never builds the model: the meta
    skeleton already has the converted layout).

    Raises:
        FileNotFoundError: no safetensors weights in the directory.
        KeyError: a tensor in the files that the model does not have, or a missing one.
    """
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    model, layout = _meta_skeleton(config)
    if _needs_hf_conversion(model_dir, model, layout):
        if not fills_masters:
            return _layout_only_adapter(model, master_dtype=master_dtype, masters=masters)
        converted = AutoModelForCausalLM.from_pretrained(model_dir, config=model.config,
                                                         dtype=torch.float32)
        return adapter_from_model(converted, master_dtype=master_dtype, masters=masters,
                                  fills_masters=fills_masters)
    store = _store_for(model, master_dtype=master_dtype, masters=masters,
                       fills_masters=fills_masters)
    seen = set()
    tied_head = f"{layout.head}.weight"
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                name = checkpoint_name(stored, layout)
                if name is None:
                    continue  # vision tower / MTP head: not part of the causal LM
                if getattr(model.config, "tie_word_embeddings", False) and name == tied_head:
                    continue  # the tied head is the embedding
                group, local = store.locate(name)
                if fills_masters:
                    group.master_views[local].copy_(f.get_tensor(stored))
                seen.add(name)
    missing = set(store.named_master()) - seen
    if missing:
        raise KeyError(f"{model_dir}: weights missing for {sorted(missing)[:5]}")
    return ModelAdapter(model, store)


def save_hf_dir(adapter_or_state_dict, model_dir: str | Path, *, dtype: torch.dtype | None = None,
                shard_bytes: int = SHARD_BYTES, prefix: str = "model") -> Path:
    """Write weights as HF sharded safetensors (+ index json, + config.json for an adapter).

    Each file is written to a temporary name and renamed (atomic per file).

    Args:
        adapter_or_state_dict: a `ModelAdapter` (its master weights, fp32 or bf16) or a
            name->tensor dict.
        model_dir: target directory (created).
        dtype: save dtype (None: as stored).
        shard_bytes: largest shard, bytes.
        prefix: file name stem (`model`: what HF loads; another stem writes files HF ignores).

    Returns:
        model_dir as a Path.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(adapter_or_state_dict, ModelAdapter):
        tensors = adapter_or_state_dict.params.named_master()
        adapter_or_state_dict.config.save_pretrained(model_dir)
    else:
        tensors = dict(adapter_or_state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * (t.element_size() if dtype is None else dtype.itemsize)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = (f"{prefix}.safetensors" if n == 1 else
                 f"{prefix}-{k + 1:05d}-of-{n:05d}.safetensors")
        # clone: views of one flat buffer share storage, which safetensors refuses
        out = {name: (t if dtype is None else t.to(dtype)).detach().clone().contiguous()
               for name, t in shard.items()}
        _atomic(model_dir / fname, lambda p, out=out: safetensors.torch.save_file(
            out, str(p), metadata={"format": "pt"}))
        for name, t in out.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic(model_dir / f"{prefix}.safetensors.index.json",
                lambda p: p.write_text(json.dumps(index, indent=2)))
    return model_dir


def _atomic(path: Path, write) -> None:
    with atomic_path(path) as tmp:
        write(tmp)
