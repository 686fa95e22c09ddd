"""Offline lm-eval fixtures: local tasks (YAML over a JSONL file) and a plain-HF stand-in with
`StreamedLM`'s interface, so the lm-eval model is tested without the engine and without the Hub.

The stand-in is the simplest correct implementation (one full forward per token, no KV cache,
fp32): a reference, not a copy of the engine's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

QUESTIONS = [("2 + 3", "5"), ("4 + 1", "5"), ("7 - 2", "5"), ("3 * 3", "9"), ("8 - 6", "2"),
             ("1 + 1", "2"), ("6 + 2", "8"), ("9 - 4", "5")]
"""(question, answer) rows of the local tasks' JSONL file."""

TASK_NAMES = ("local_mc", "local_ll", "local_gen", "local_rolling")

_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""

TASK_YAML = {
    "local_mc": """task: local_mc
output_type: multiple_choice
doc_to_text: "Question: {{question}} = ? Answer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "local_ll": """task: local_ll
output_type: loglikelihood
doc_to_text: "Question: {{question}} ="
doc_to_target: "{{answer}}"
metric_list:
  - metric: perplexity
  - metric: acc
""",
    "local_gen": """task: local_gen
output_type: generate_until
doc_to_text: "Question: {{question}} = ? Answer:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    regexes_to_ignore: [" "]
""",
    "local_rolling": """task: local_rolling
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{passage}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}
"""One task per lm-eval request kind: loglikelihood (multiple choice and a plain continuation),
generate_until and loglikelihood_rolling."""


def write_local_tasks(root: Path) -> Path:
    """Write the JSONL rows and one YAML per task of `TASK_YAML` under `root`; returns `root`
    (lm-eval's `include_path`)."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "rows.jsonl"
    rows = []
    for i, (question, answer) in enumerate(QUESTIONS):
        choices = [str(int(answer) + 1), str(int(answer) + 3)]  # lm-eval puts " " before each
        choices.insert(i % 3, answer)
        rows.append({"question": question, "answer": answer, "choices": choices, "gold": i % 3,
                     "passage": " ".join(f"Question: {q} = {a}." for q, a in QUESTIONS[i:])})
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, body in TASK_YAML.items():
        (root / f"{name}.yaml").write_text(_COMMON.format(data=data) + body)
    return root


def fitted_model_dir(root: Path, *, steps: int = 80) -> Path:
    """A tiny Llama (`tiny_models.tiny_model_dir`) fitted on the tasks' own lines, so greedy
    answers, stop strings and greedy continuations occur (a random model never stops early and
    is never greedy on a continuation); returns the HF directory."""
    from tiny_models import tiny_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines = [f"Question: {q} = ? Answer: {a}\nQuestion: {q} = {a}." for q, a in QUESTIONS]
    tiny_model_dir(root, lines * 4)
    tokenizer = AutoTokenizer.from_pretrained(root)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    batch = tokenizer(lines, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
    model.save_pretrained(root)
    return root


def trained_run(model_dir: Path, run_dir: Path) -> Path:
    """A one-step `lazytrain train` run from `model_dir` at a negligible learning rate (its
    checkpoint keeps the fitted model's behaviour, with the run's saved chat template);
    returns the run directory."""
    from lazytrain.config import load_config
    from lazytrain.train.loop import train

    train(load_config(None, [f"model.config_path={model_dir}", f"train.run_dir={run_dir}",
                             "data.seq_len=256", "data.num_eval=0", "train.micro_batch=2",
                             "train.steps=1", "train.lr=1e-9", "train.warmup_steps=0",
                             "planner.policy=megatrain", "planner.megatrain_k=2",
                             "runtime.device=cpu"]), progress=False, log=lambda _: None)
    return run_dir


class HFStandIn:
    """`StreamedLM`'s interface over a plain HF causal LM (fp32, no KV cache).

    Args:
        model_dir: an HF model directory with its tokenizer.
        max_length: tokens per forward, as `StreamedLM.max_length` (default: the config's
            max_position_embeddings).
    """

    def __init__(self, model_dir, *, max_length: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) | {
            self.tokenizer.eos_token_id}
        self.max_length = max_length or self.model.config.max_position_embeddings

    @torch.no_grad()
    def token_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, float32 [n-1]: log p(x_t | x_<t), t = 1..n-1."""
        out = []
        for seq in sequences:
            assert 2 <= len(seq) <= self.max_length, "StreamedLM refuses this length too"
            ids = torch.tensor([seq])
            logits = self.model(ids).logits[0, :-1].float()
            out.append(logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0])
        return out

    @torch.no_grad()
    def generate(self, prompts, *, max_new_tokens, temperature=0.0, top_p=1.0, seed=0,
                 stop=None):
        """New tokens per prompt: greedy at temperature 0, else top-p sampling; ends at EOS
        (kept), where stop(new) is True, or at max_new_tokens."""
        gen = torch.Generator().manual_seed(seed)
        outs = []
        for prompt in prompts:
            assert prompt and len(prompt) + max_new_tokens <= self.max_length, "as StreamedLM"
            new: list[int] = []
            while len(new) < max_new_tokens:
                logits = self.model(torch.tensor([prompt + new])).logits[0, -1].float()
                if temperature == 0.0:
                    token = int(logits.argmax())
                else:
                    probs = (logits / temperature).softmax(-1)
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(0) - sorted_p < top_p
                    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
                    token = int(order[torch.multinomial(kept / kept.sum(), 1, generator=gen)])
                new.append(token)
                if token in self.eos_token_ids or (stop is not None and stop(new)):
                    break
            outs.append(new)
        return outs
