"""lm-eval on the streaming engine (`lazytrain eval`'s model) beside lm-eval's own HF backend,
on the main job's model and local tasks built from its held-out arithmetic problems.

Run:  python benchmarks/lm_eval_backend.py [--model-dir DIR] [--docs 12] [--out lm_eval.json]

Loads SmolLM2-135M-Instruct from the local lazytrain cache (`~/.cache/lazytrain/
smollm2-135m-instruct`, written by the main job's first `lazytrain train`; no download) and
writes two lm-eval tasks over a JSONL file of the held-out arithmetic problems into a temporary
folder: `arith_mc` (multiple choice: the answer among three numbers; acc, acc_norm, and the
greedy flag through exact_match) and `arith_gen` (generate_until "\\n", 8 tokens, exact_match).
Then `simple_evaluate` runs them twice: lm-eval's `HFLM` (fp32 HF model, batch 1) and
`StreamedEvalLM` over a `StreamedLM` on the host store (fp32, cpu). Prints and writes the
scores of each, the largest difference of the per-request log-likelihoods, whether every greedy
flag and every generation is equal, how many generate calls the greedy checks made, the
streamed model's wall s in scoring and in generation, and the wall time of each with their
ratio (streamed / HF). Wall times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

from lazytrain.atomic import write_json_atomic
from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.evaluation.lm_eval_model import StreamedEvalLM
from lazytrain.evaluation.streamed_lm import StreamedLM
from lazytrain.models.hf_loader import load_adapter_from_dir
from lazytrain.runtime.backends import make_device

DEFAULT_MODEL = Path.home() / ".cache" / "lazytrain" / "smollm2-135m-instruct"
TASKS = {
    "arith_mc": """output_type: multiple_choice
doc_to_text: "{{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list: [{metric: acc}, {metric: acc_norm}, {metric: exact_match}]
""",
    "arith_gen": """output_type: generate_until
doc_to_text: "{{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 8, do_sample: false}
metric_list: [{metric: exact_match, regexes_to_ignore: [" "]}]
""",
}


def write_tasks(root: Path, docs: int) -> Path:
    """The JSONL of `docs` held-out problems and one YAML per task of `TASKS` under `root`."""
    _, held_out = arithmetic_dataset(num_train=1, num_eval=docs, seed=7)
    rows = []
    for i, example in enumerate(held_out):
        answer = int(example.answer)
        choices = [str(answer + 1), str(answer + 3)]
        choices.insert(i % 3, str(answer))
        rows.append({"question": example.messages[0].content, "answer": str(answer),
                     "choices": choices, "gold": i % 3})
    data = root / "arith.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, body in TASKS.items():
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
            f"test_split: test\n{body}")
    return root


class CountingLM(StreamedLM):
    """`StreamedLM` counting its generate calls and the wall s of each kind of pass."""

    generate_calls = 0
    seconds = {"token_logprobs": 0.0, "generate": 0.0}

    def generate(self, prompts, **kwargs):
        CountingLM.generate_calls += 1
        start = time.perf_counter()
        try:
            return super().generate(prompts, **kwargs)
        finally:
            CountingLM.seconds["generate"] += time.perf_counter() - start

    def token_logprobs(self, sequences):
        start = time.perf_counter()
        try:
            return super().token_logprobs(sequences)
        finally:
            CountingLM.seconds["token_logprobs"] += time.perf_counter() - start


def timed_evaluate(model, tasks: Path) -> tuple[dict, float]:
    """simple_evaluate of every task of `TASKS` on `model`; (results, wall s)."""
    start = time.perf_counter()
    results = simple_evaluate(model=model, tasks=list(TASKS), log_samples=True,
                              task_manager=TaskManager(include_path=str(tasks),
                                                       include_defaults=False))
    return results, time.perf_counter() - start


def compare(ours: dict, theirs: dict) -> dict:
    """Scores side by side, the largest log-likelihood difference, flags and texts equal."""
    scores = {task: {metric: [ours["results"][task][metric], theirs["results"][task][metric]]
                     for metric in ours["results"][task] if metric.endswith(",none")}
              for task in TASKS}
    pairs = [(a, b) for s_ours, s_theirs in zip(ours["samples"]["arith_mc"],
                                                theirs["samples"]["arith_mc"])
             for [a], [b] in zip(s_ours["resps"], s_theirs["resps"])]
    return {
        "scores [streamed, hf]": scores,
        "loglikelihood_max_abs_diff": max(abs(a[0] - b[0]) for a, b in pairs),
        "greedy_flags_equal": all(a[1] == b[1] for a, b in pairs),
        "greedy_flags_true": sum(b[1] for _, b in pairs),
        "generations_equal": [s["filtered_resps"] for s in ours["samples"]["arith_gen"]] ==
                             [s["filtered_resps"] for s in theirs["samples"]["arith_gen"]],
    }


def main() -> None:
    """Parse the flags, evaluate with both backends, print and write the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--docs", type=int, default=12, help="held-out problems per task")
    parser.add_argument("--out", type=Path, help="write the comparison JSON here")
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"{args.model_dir}: no HF model; run the main job's `lazytrain train` "
                         "once (it converts SmolLM2) or pass --model-dir")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp), args.docs)
        hf, hf_s = timed_evaluate(HFLM(pretrained=str(args.model_dir), device="cpu",
                                       dtype="float32", batch_size=1), tasks)
        lm = CountingLM(load_adapter_from_dir(args.model_dir), AutoTokenizer.from_pretrained(
            args.model_dir), device=make_device("cpu"), weights="host")
        ours, ours_s = timed_evaluate(StreamedEvalLM(lm, batch_size=8), tasks)
    report = {"model": str(args.model_dir), "docs": args.docs, **compare(ours, hf),
              # the rest of the generate calls are arith_gen's, one per batch of 8 prompts
              "greedy_check_generate_calls":
                  CountingLM.generate_calls - math.ceil(args.docs / 8),
              "streamed_pass_s": {k: round(v, 2) for k, v in CountingLM.seconds.items()},
              "wall_s [streamed, hf]": [round(ours_s, 2), round(hf_s, 2)],
              "wall_ratio streamed/hf": round(ours_s / hf_s, 3)}
    print(json.dumps(report, indent=1))
    if args.out:
        print(f"wrote {write_json_atomic(args.out, report)}")


if __name__ == "__main__":
    main()
