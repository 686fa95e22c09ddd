"""`lazytrain` console entry point: one argparse subparser per verb, one module per verb.

Each verb module exposes `register(subparsers)` (adds its parser, sets `func=run`) and
`run(args) -> int`, and imports what it needs at its top. Only the verb being run is imported
(`verb_module`, the one lazy import of the CLI): `lazytrain plan`, `simulate` and `report`
then load neither torch nor transformers, and `lazytrain --help` loads no verb at all; the
other verbs get a parser holding their one-line help. Exit codes, the same for every verb
(docs/design.md, "The parts"):

- 0 ok (also when the reader of stdout went away: `lazytrain report --json | head`);
- 1 the job failed at run time: an infeasible budget, a preflight refusal, an I/O error or a
  full disk, a failed download, the plan's HBM accounting exceeded, a dead peer rank;
- 2 bad input: usage, config (unknown key, wrong type, out of range), a missing file, a used
  run directory, a missing or damaged checkpoint on --resume;
- 130 / 143 interrupted by Ctrl-C / SIGTERM (`lazytrain train` saves a checkpoint first).

Errors print one line `error: ...`; a traceback only with --debug. The code follows the
error's class (`lazytrain.errors`: `UserError` 2, `JobFailure` 1); any other exception is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lazytrain import __version__
from lazytrain.errors import EXIT_CODES, JobFailure, UserError

# Verb -> (module, one-line help). Plain dict, read top to bottom (no registration side
# effects).
COMMANDS = {
    "plan": ("lazytrain.cli.plan",
             "choose where each block-boundary activation lives and print the plan"),
    "simulate": ("lazytrain.cli.simulate",
                 "re-evaluate a plan with both the window evaluator and the event simulator"),
    "train": ("lazytrain.cli.train", "train a model with a planned streaming schedule"),
    "report": ("lazytrain.cli.report",
               "compare a run's measured windows with its plan's predictions"),
    "profile": ("lazytrain.cli.profile",
                "measure block times and transfer rates (or refit them from a run's measured "
                "windows)"),
    "convert": ("lazytrain.cli.convert",
                "convert another trainer's config to a LazyTrain run config"),
    "data": ("lazytrain.cli.data",
             "show rendered training samples with their trained tokens marked, and what "
             "data.seq_len cuts"),
    "generate": ("lazytrain.cli.generate",
                 "print completions of prompts from a run's checkpoint, through the engine"),
    "eval": ("lazytrain.cli.eval",
             "run lm-eval tasks on a run's checkpoint, through the engine (the eval extra)"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser: the verb `argv` names registered by its module, every other verb
    of `COMMANDS` by its one-line help (argparse then parses only the named verb's flags)."""
    parser = argparse.ArgumentParser(
        prog="lazytrain",
        description="Plan and run CPU-master layer-streaming training of LLMs larger than HBM.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"lazytrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    verb = verb_of(sys.argv[1:] if argv is None else argv)
    for name, (_, summary) in COMMANDS.items():
        if name == verb:
            verb_module(name).register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def verb_of(argv: list[str]) -> str | None:
    """The verb `argv` runs: its first word that is not an option (the top-level options take
    no value), when it names a verb of `COMMANDS`; else None."""
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words and words[0] in COMMANDS else None


def verb_module(name: str):
    """The module of verb `name` (`COMMANDS`), imported on first use."""
    return importlib.import_module(COMMANDS[name][0])  # lazy: loads only the verb being run


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the verb.

    Errors print one line `error: ...` (a traceback only with --debug): a `JobFailure` (an
    infeasible budget, an I/O error) exits 1, a `UserError` (bad usage or config) exits 2
    (`lazytrain.errors`). Any other exception is a bug and keeps its traceback, except the
    builtin ones Python and the libraries raise on bad input or a failing machine
    (`_builtin_exit_code`).
    """
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader closed stdout (`| head`): not an error of ours
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except UserError as exc:
        if args.debug:
            raise
        return _one_line(exc, EXIT_CODES[UserError])
    except JobFailure as exc:
        if args.debug:
            raise
        return _one_line(exc, EXIT_CODES[JobFailure])
    except Exception as exc:
        code = _builtin_exit_code(exc)
        if args.debug or code is None:
            raise
        return _one_line(exc, code)


def _one_line(exc: Exception, code: int) -> int:
    """Print `error: <the message on one line>` to stderr; returns `code`."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"error: {text}", file=sys.stderr)
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured in tests)
        pass
    finally:
        os.close(devnull)


def _builtin_exit_code(exc: Exception) -> int | None:
    """The exit code of an exception that is neither a `UserError` nor a `JobFailure`: 2 for the
    builtin errors of bad input (`ValueError`, `TypeError`, `FileNotFoundError`: a value the
    config loader refuses, a path `open()` cannot find), 1 for a failing machine (`OSError`:
    disk full; `RuntimeError`: CUDA out of memory, a failed collective), None for a bug.
    """
    if isinstance(exc, (ValueError, TypeError, FileNotFoundError)):
        return 2
    if isinstance(exc, (OSError, RuntimeError)):
        return 1
    return None


if __name__ == "__main__":
    sys.exit(main())
