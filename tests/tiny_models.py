"""A tiny random Llama directory with a trained BPE tokenizer, shared by the training and the
data-parallel tests (tests/ is on sys.path through its conftest.py)."""

from __future__ import annotations

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
