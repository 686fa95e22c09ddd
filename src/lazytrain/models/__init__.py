"""Adapters from Hugging Face decoder-only models to the streaming engine (see `adapter.py`)."""

from lazytrain.models.adapter import LAYOUTS, DecoderLayout, ModelAdapter, shift_labels
from lazytrain.models.hf_loader import (adapter_from_model, load_adapter_from_config,
                                        load_adapter_from_dir, save_hf_dir)

__all__ = ["LAYOUTS", "DecoderLayout", "ModelAdapter", "adapter_from_model",
           "load_adapter_from_config", "load_adapter_from_dir", "save_hf_dir", "shift_labels"]
