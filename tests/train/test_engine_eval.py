"""The trainer's held-out evaluation runs through the streaming engine (no HF copy of the model):
its loss and greedy generations equal a plain HF model loaded from the run's final checkpoint,
the evaluations before and after training reach the trackers as the periodic ones do, the
ledger's bytes of an evaluation are the model's bytes once, and forward/decode plans are
written beside plan.json."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lazytrain.contract import IGNORE_INDEX
from lazytrain.data import build_data, encode, encode_prompt, stop_token_ids
from lazytrain.planner.inference_plans import InferencePlan
from lazytrain.train.loop import train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


def _hf_reference(run_dir, cfg):
    """(mean loss over the trained tokens, greedy texts of the scored examples) of an HF model
    loaded from the run's newest checkpoint, on the held-out examples the run drew."""
    [step] = sorted((run_dir / "checkpoints").glob("step-*"))
    model = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(step)
    examples = build_data(cfg.data, tok, micro_batch=cfg.train.micro_batch,
                          seed=cfg.train.seed).eval_examples
    total, count = 0.0, 0
    for ex in examples:
        e = encode(tok, ex, seq_len=cfg.data.seq_len, overlong="truncate")
        with torch.no_grad():
            logits = model(torch.tensor([e.input_ids])).logits[0, :-1].float()
        targets = torch.tensor(e.labels[1:])
        total += float(torch.nn.functional.cross_entropy(
            logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((targets != IGNORE_INDEX).sum())
    texts = []
    for ex in [ex for ex in examples if ex.answer is not None]:
        ids = torch.tensor([encode_prompt(tok, ex)])
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=48, do_sample=False,
                                 eos_token_id=stop_token_ids(tok),
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return total / count, texts


def test_after_training_the_evaluation_equals_an_hf_model_of_the_checkpoint(
        arithmetic_model_dir, tiny_plan, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run_dir, "train.steps=2")
    summary = train(cfg, plan=tiny_plan, progress=False)
    loss, texts = _hf_reference(run_dir, cfg)
    after = summary["eval_after"]
    assert after["loss"] == pytest.approx(loss, abs=1e-5)
    assert [s["generated"] for s in after["samples"]] == texts[:len(after["samples"])]
    for kind in ("forward", "decode"):  # written beside plan.json, valid
        assert InferencePlan.load(run_dir / f"{kind}_plan.json").kind == kind


def test_before_and_after_evaluations_reach_tensorboard_and_the_ledger_counts_the_model(
        arithmetic_model_dir, tiny_plan, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = tmp_path / "run"
    # bf16 compute over fp32 masters: the blocks stream through the device slots
    cfg = tiny_config(arithmetic_model_dir, run_dir, "train.steps=2",
                      "train.compute_dtype=bf16", "train.master_dtype=fp32",
                      "train.report_to=[tensorboard]")
    summary = train(cfg, plan=tiny_plan, progress=False)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("eval/loss")}
    assert loss[0] == pytest.approx(summary["eval_before"]["loss"], rel=1e-6)
    assert loss[2] == pytest.approx(summary["eval_after"]["loss"], rel=1e-6)
    # one load of every weight in bf16: the ends once, every block once per pass (one
    # token_logprobs pass) and once per decode step of the generation; 2 B per parameter
    config = json.loads((arithmetic_model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(arithmetic_model_dir)
    ends = sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    blocks = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    assert config["tie_word_embeddings"]  # the head is the embedding: counted once
    before = summary["eval_before"]
    passes = (before["h2d_bytes"] - 2 * ends) / (2 * blocks)
    assert passes == int(passes) and passes >= 2  # whole loads only: loss pass + decode steps
    assert before["device_peak_bytes"] >= 2 * ends + 2 * 2 * max(
        sum(p.numel() for n, p in model.named_parameters() if f".layers.{j}." in n)
        for j in range(config["num_hidden_layers"]))  # the ends and the two weight slots
