"""The decode plan's cache bytes (`planner.inference_plans.kv_layout`, from the parsed model
spec and the HF config) against the bytes of every tensor in HF's own cache after a prefill
of 3 rows x 10 tokens through StreamedLM: equal for full attention, Gated-DeltaNet layers
(recurrent state and conv inputs) and MLA's latent; an upper bound within one token per row
and sliding layer where HF keeps window - 1 tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from engine_helpers import model_pair  # noqa: E402
from test_families import family_config  # noqa: E402

from lazytrain.evaluation.streamed_lm import StreamedLM  # noqa: E402
from lazytrain.planner.inference_plans import kv_layout  # noqa: E402
from lazytrain.runtime.backends import make_device  # noqa: E402
from lazytrain.spec.model import ModelSpec  # noqa: E402

ROWS, TOKENS = 3, 10


class _Tokenizer:
    eos_token_id = 5
    pad_token_id = 0


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _hf_cache_bytes(family: str) -> tuple[int, int, dict]:
    """(bytes HF's cache holds after the prefill, the plan's cache bytes, the config dict)."""
    config = family_config(family)
    _, adapter = model_pair(config)
    lm = StreamedLM(adapter, _Tokenizer(), device=make_device("cpu"), weights="host")
    cache = DynamicCache(config=adapter.config)
    ids = torch.randint(1, 90, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lm._decode_step(ids, torch.ones_like(ids), torch.arange(TOKENS).expand(ROWS, -1), cache)
    held = sum(_tensor_bytes(vars(layer)) for layer in cache.layers)
    d = config.to_dict()
    kv = kv_layout(ModelSpec.from_hf_config(d), d, dtype_bytes=4)  # fp32 model
    return held, kv.cache_bytes(batch=ROWS, context_tokens=TOKENS), d


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text", "deepseek_v2"])
def test_the_plans_cache_bytes_equal_hfs_cache(family):
    held, planned, _ = _hf_cache_bytes(family)
    assert planned == held


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_layers_are_bounded_within_one_token_per_row(family):
    held, planned, d = _hf_cache_bytes(family)
    # keys + values of one token per row in every sliding layer: 2 x 2 kv heads x 16 dims x 4 B
    sliding = sum(1 for kind in (d.get("layer_types") or ["sliding_attention"] * 4)
                  if kind == "sliding_attention")
    slack = sliding * ROWS * 2 * 2 * 16 * 4
    assert held <= planned <= held + slack
