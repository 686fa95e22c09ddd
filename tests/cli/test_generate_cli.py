"""`lazytrain generate`: completions through the streaming engine equal HF `generate` on the
checkpoint's weights (greedy), with the checkpoint's chat template, stop strings cut off, and
one-line errors for a run without a checkpoint and for bad flags."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lazytrain.cli.main import main
from lazytrain.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = ["Question: 2 + 3 = ? Answer:", "Question: 9 - 4 = ?"]


def _hf_greedy(checkpoint, prompt_ids: list[int], max_new_tokens: int) -> str:
    """HF's own greedy decode of the checkpoint (the reference), special tokens dropped."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _generate(capsys, *argv) -> list[dict]:
    assert main(["generate", *argv, "--json", "--device", "cpu"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_greedy_completions_with_the_chat_template_equal_hf_generate(fitted_run, capsys):
    out = _generate(capsys, str(fitted_run), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                    "--max-new-tokens", "10")
    checkpoint = latest_checkpoint(fitted_run).path
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    expected = []
    for prompt in PROMPTS:
        chat = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        expected.append(_hf_greedy(checkpoint, tokenizer.encode(text), 10))
    assert out == [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, expected)]


def test_raw_prompts_from_a_file_stop_at_the_stop_string(fitted_run, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    out = _generate(capsys, str(fitted_run), "--prompts", str(prompts), "--raw",
                    "--max-new-tokens", "10", "--stop", "\\n")
    checkpoint = latest_checkpoint(fitted_run).path
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    full = [_hf_greedy(checkpoint, tokenizer.encode(p), 10) for p in PROMPTS]
    assert all("\n" in text for text in full)  # the stop string occurs: the cut is tested
    assert [o["completion"] for o in out] == [text.split("\n")[0] for text in full]


def test_a_run_without_a_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no complete checkpoint" in err


@pytest.mark.parametrize("flags, named", [(["--top-p", "0"], "--top-p"),
                                          (["--temperature", "-1"], "--temperature"),
                                          (["--max-new-tokens", "0"], "--max-new-tokens"),
                                          ([], "--prompt")])
def test_bad_decoding_flags_are_one_line_naming_the_flag(tmp_path, capsys, flags, named):
    prompt = [] if not flags else ["--prompt", "hi"]
    assert main(["generate", str(tmp_path), *prompt, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err


def test_sampling_flags_reach_the_sampler(fitted_run, capsys):
    """The same seed gives the same samples; a top-p too small to keep a second token is
    greedy (the reference: the greedy completion of the same prompt)."""
    run = str(fitted_run)
    args = ["--prompt", PROMPTS[1], "--raw", "--max-new-tokens", "8", "--temperature", "1.5"]
    first = _generate(capsys, run, *args, "--seed", "3")
    assert _generate(capsys, run, *args, "--seed", "3") == first
    seeds = [_generate(capsys, run, *args, "--seed", str(s))[0]["completion"] for s in range(4)]
    assert len(set(seeds)) > 1  # sampling at temperature 1.5 is not greedy
    greedy = _generate(capsys, run, "--prompt", PROMPTS[1], "--raw", "--max-new-tokens", "8")
    assert _generate(capsys, run, *args, "--top-p", "1e-6") == greedy


def test_jsonl_prompts_and_a_named_checkpoint(fitted_run, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    out = _generate(capsys, str(fitted_run), "--prompts", str(prompts), "--raw",
                    "--max-new-tokens", "4", "--checkpoint", "step-000001")
    assert [o["prompt"] for o in out] == [PROMPTS[0]]
    assert main(["generate", str(fitted_run), "--prompt", "hi", "--checkpoint", "7"]) == 2
    assert capsys.readouterr().err.endswith("has no valid checkpoint 7; its checkpoints are "
                                            "step-000001\n")


def test_a_jsonl_record_without_a_prompt_is_one_line_naming_the_record(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    assert main(["generate", str(tmp_path), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "record 2 has no \"prompt\" string" in err
