"""`lazytrain generate RUN_DIR`: completions from a run's newest checkpoint, through the engine.

Each prompt (--prompt TEXT, repeatable, or --prompts FILE: one prompt a line, or a .jsonl file
of {"prompt": TEXT} records) is sent as a user turn rendered with the chat template saved in the
checkpoint (--raw sends the text as it is), and generated through the streaming engine's weight
path (`StreamedLM`: no second copy of the model) in the run's `train.compute_dtype`: greedy at
--temperature 0, else top-p sampling seeded by --seed. A completion ends at EOS, at a --stop
string (cut off) or after --max-new-tokens. Completions go to stdout (--json: one JSON object a
line); which checkpoint, dtype and decoding go to stderr. Exit codes: 0 ok; 2 bad usage, a run
without a checkpoint, a prompt too long for the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lazytrain.evaluation.completions import complete
from lazytrain.evaluation.streamed_lm import COMPUTE_DTYPES, StreamedLM
from lazytrain.train.checkpoint import list_checkpoints

EPILOG = """examples:
  lazytrain generate runs/default --prompt "Ava has 3 apples and buys 4 more. How many?"
  lazytrain generate runs/default --prompts prompts.txt --temperature 0.7 --top-p 0.9 --json
"""

DTYPE_NAMES = {dtype: name for name, dtype in COMPUTE_DTYPES.items()}


def register(subparsers) -> None:
    """Add the `generate` subcommand."""
    p = subparsers.add_parser("generate", description=__doc__.split("\n\n")[1], epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with a checkpoint")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE",
                   help="prompts, one a line (or a .jsonl file of {\"prompt\": TEXT} records)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="tokens generated at most per prompt (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy (default); above 0: sample at this temperature")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this mass (default 1)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a completion at this string, cut off (repeatable; \\n and \\t "
                        "are a newline and a tab)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as plain text, without the chat template")
    add_model_flags(p)
    p.add_argument("--json", action="store_true",
                   help='print one {"prompt", "completion"} JSON object a line')
    p.set_defaults(func=run)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that pick the checkpoint and where it runs (shared with `lazytrain eval`)."""
    p.add_argument("--checkpoint", metavar="STEP",
                   help="a checkpoint of the run (step-000012, or 12; default: the newest)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where the blocks run (default: cuda when there is one, else cpu)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="sequences per forward or decode batch (default 8)")


def run(args: argparse.Namespace) -> int:
    """Load the prompts and the model, generate, print; returns the exit code."""
    check_sampling(args)
    prompts = read_prompts(args.prompt, args.prompts)
    lm = open_model(args)
    decoding = ("greedy" if args.temperature == 0 else
                f"sampling at temperature {args.temperature}, top-p {args.top_p}, "
                f"seed {args.seed}")
    template = "as plain text" if args.raw else "with the checkpoint's chat template"
    print(f"generate: {len(prompts)} prompt(s) {template}, {decoding}", file=sys.stderr)
    completions = complete(lm, prompts, chat=not args.raw, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                           stops=[unescape(s) for s in args.stop])
    for prompt, completion in zip(prompts, completions):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": completion}))
        else:
            print(f">>> {prompt}\n{completion}\n")
    return 0


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse out-of-range decoding flags, naming the flag.

    Raises:
        ValueError: --max-new-tokens below 1, --temperature below 0, --top-p outside (0, 1].
    """
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy); got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1]; got {args.top_p}")


def unescape(text: str) -> str:
    """`text` with the two characters \\n and \\t read as a newline and a tab (a shell passes
    them literally)."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def read_prompts(texts: list[str], path: str | None) -> list[str]:
    """The --prompt texts, then the --prompts file's: one a line (blank lines skipped), or the
    "prompt" of each record of a .jsonl file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: no prompt at all, or a .jsonl record without a "prompt" string.
    """
    prompts = list(texts)
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"--prompts: {file} does not exist")
        lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if file.suffix == ".jsonl":
            prompts += [_record_prompt(line, n, file) for n, line in enumerate(lines, start=1)]
        else:
            prompts += lines
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts FILE")
    return prompts


def _record_prompt(line: str, n: int, file: Path) -> str:
    """The "prompt" string of record `n` of a .jsonl prompts file.

    Raises:
        ValueError: the line is no JSON object with a "prompt" string.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f"--prompts: {file} record {n} has no \"prompt\" string; write one "
                         '{"prompt": TEXT} object a line')
    return record["prompt"]


def open_model(args: argparse.Namespace) -> StreamedLM:
    """The run's checkpoint (--checkpoint, else the newest valid one) as a `StreamedLM` on
    --device; says on stderr which checkpoint and dtype.

    Raises:
        FileNotFoundError: RUN_DIR holds no valid checkpoint, or not the one --checkpoint names
            (the valid ones are listed).
        ValueError: --batch-size below 1.
    """
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1; got {args.batch_size}")
    path = checkpoint_path(Path(args.run_dir), args.checkpoint)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = StreamedLM.from_run_dir(args.run_dir, checkpoint=str(path), device=device,
                                 batch_size=args.batch_size)
    print(f"model: {path} on {device}, computing in {DTYPE_NAMES.get(lm.dtype, lm.dtype)} "
          "(the run's train.compute_dtype)", file=sys.stderr)
    return lm


def checkpoint_path(run_dir: Path, step: str | None) -> Path:
    """The directory of the run's checkpoint `step` (step-000012 or 12), or of its newest
    valid one.

    Raises:
        FileNotFoundError: no valid checkpoint, or none of that step (the valid ones named).
    """
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint under "
                                f"{run_dir / 'checkpoints'}; give the run directory of a "
                                "`lazytrain train` that saved one")
    if step is None:
        return found[-1].path
    wanted = step.removeprefix("step-")
    for ckpt in found:
        if wanted.isdigit() and ckpt.step == int(wanted):
            return ckpt.path
    raise FileNotFoundError(f"--checkpoint: {run_dir} has no valid checkpoint {step}; its "
                            f"checkpoints are {', '.join(c.path.name for c in found)}")
