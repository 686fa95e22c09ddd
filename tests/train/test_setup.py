"""A bare architecture file as `model.config_path` (the shipped tiny config) trains from scratch:
its config is read from that file and a tokenizer is trained on the run's data."""

from __future__ import annotations

from lazytrain.config import load_config
from lazytrain.data import corpus_texts
from lazytrain.train import model_source


def test_bare_config_file_gives_its_architecture_and_a_tokenizer_trained_on_the_data(repo_root):
    cfg = load_config(repo_root / "configs" / "tiny-llama-cpu.yaml")
    source = model_source.resolve_model_source(cfg.model.config_path)
    assert source.config_file is not None and not source.has_weights
    hf_config = model_source.load_hf_config(source)
    assert (hf_config.model_type, hf_config.num_hidden_layers, hf_config.hidden_size) == \
        ("llama", 4, 64)
    tokenizer = model_source.load_tokenizer(source, vocab_size=hf_config.vocab_size,
                                     corpus=lambda: corpus_texts(cfg.data, seed=0))
    assert tokenizer.is_fast and len(tokenizer) <= hf_config.vocab_size
    ids = tokenizer("What is 12 + 7?")["input_ids"]
    assert tokenizer.decode(ids) == "What is 12 + 7?"
