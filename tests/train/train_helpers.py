"""Builders for the training tests: a tiny random Llama directory with a trained tokenizer, and
the run config of a tiny CPU run."""

from __future__ import annotations

from lazytrain.config import load_config
from lazytrain.data.tiny_tokenizer import train_tokenizer


def tiny_model_dir(root, texts, *, layers: int = 3, tied: bool = True):
    """Write config.json + random safetensors + a BPE tokenizer trained on `texts` to `root`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = train_tokenizer(texts, vocab_size=384)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=tied,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def tiny_config(model_dir, run_dir, *extra: str):
    """The run config for a tiny CPU run on the embedded arithmetic data."""
    return load_config(None, [f"model.config_path={model_dir}", f"train.run_dir={run_dir}",
                              "data.seq_len=160", "data.num_eval=4", "train.micro_batch=2",
                              "train.steps=4", "train.lr=3e-3", "train.warmup_steps=1",
                              "planner.policy=megatrain", "planner.megatrain_k=2",
                              "runtime.device=cpu", *extra])
