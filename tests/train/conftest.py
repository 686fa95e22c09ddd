"""Fixtures for the training tests: a tiny random Llama directory with a trained tokenizer."""

from __future__ import annotations

import pytest

from lazytrain.config import load_config
from lazytrain.data.synthetic import arithmetic_dataset
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


@pytest.fixture(scope="session")
def arithmetic_model_dir(tmp_path_factory):
    """A 3-block tied-embedding Llama whose tokenizer was trained on the arithmetic problems."""
    train, _ = arithmetic_dataset(num_train=300, num_eval=0, seed=7)
    texts = [m.content for ex in train for m in ex.messages] + ["Question: Answer: ####"]
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), texts)


def tiny_config(model_dir, run_dir, *extra: str):
    """The run config for a tiny CPU run on the embedded arithmetic data."""
    return load_config(None, [f"model.config_path={model_dir}", f"train.run_dir={run_dir}",
                              "data.seq_len=160", "data.num_eval=4", "train.micro_batch=2",
                              "train.steps=4", "train.lr=3e-3", "train.warmup_steps=1",
                              "planner.policy=megatrain", "planner.megatrain_k=2",
                              "runtime.device=cpu", *extra])


@pytest.fixture(scope="session")
def tiny_plan(arithmetic_model_dir, tmp_path_factory):
    """The MegaTrain K=2 plan for `tiny_config` (made once; no LP bound, to keep tests fast)."""
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.policy import plan_with_policy

    cfg = tiny_config(arithmetic_model_dir, tmp_path_factory.mktemp("plan_run"))
    return plan_with_policy(problem_from_config(cfg), "megatrain", megatrain_k=2, lp_bound=False)
