"""A multimodal Gemma-3 model directory (the layout of the real 4B+ checkpoints: a `gemma3`
config nesting `text_config`, the text tower's tensors under `model.language_model.`, a vision
tower beside it) trains its text tower: the checkpoint is the text model, and a resume goes
on from it."""

from __future__ import annotations

import json

import pytest
import torch

from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.data.tiny_tokenizer import train_tokenizer
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


def _gemma3_vlm_dir(root):
    import transformers as tf
    from safetensors.torch import load_file, save_file

    examples, _ = arithmetic_dataset(num_train=200, num_eval=0, seed=7)
    tokenizer = train_tokenizer([m.content for ex in examples for m in ex.messages],
                                vocab_size=384)
    text = tf.Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"],
                               max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(text, dtype=torch.float32).save_pretrained(root)
    flat = load_file(str(root / "model.safetensors"))
    vlm = {k.replace("model.", "model.language_model.", 1): v for k, v in flat.items()}
    vlm["model.vision_tower.patch.weight"] = torch.zeros(3)
    vlm["model.multi_modal_projector.norm.weight"] = torch.zeros(2)
    save_file(vlm, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(tf.Gemma3Config(text_config=text.to_dict())
                                                 .to_dict()))
    tokenizer.save_pretrained(root)
    return root


def test_a_multimodal_gemma3_directory_trains_its_text_tower_and_resumes(tmp_path):
    model = _gemma3_vlm_dir(tmp_path / "gemma3")
    assert json.loads((model / "config.json").read_text())["model_type"] == "gemma3"
    run = tmp_path / "run"
    sets = ("data.num_eval=0", "planner.megatrain_k=1")
    first = train(tiny_config(model, run, "train.steps=1", *sets), progress=False)
    assert first["steps_completed"] == 1
    saved = ckpt.latest_checkpoint(run).path
    assert json.loads((saved / "config.json").read_text())["model_type"] == "gemma3_text"
    resumed = train(tiny_config(model, run, "train.steps=2", *sets), resume=True,
                    progress=False)
    assert resumed["steps_completed"] == 2 and resumed["steps_this_run"] == 1
