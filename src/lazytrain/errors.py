"""The two kinds of error the project raises, and the exit code each one means.

Every exception class of the project derives from exactly one of these two:

- `UserError`: the input is wrong (usage, config key or value, a missing or damaged file the
  user named, a plan that does not match the model); the CLI prints one line and exits 2.
- `JobFailure`: the input was fine but the job could not be done (no plan fits the budgets,
  preflight refused, an NVMe or checkpoint write failed, the runtime held more memory than the
  plan allows, a peer rank died); the CLI prints one line and exits 1.

A class may also derive from the builtin exception that describes it (`OSError` for a failed
file operation, `ValueError` for a bad value, `FileNotFoundError` for a missing input), so that
callers that catch the builtin keep working; the project's base comes first in the bases.

Owns the base classes, the config loader's errors (`ConfigError` and its two refinements, here
because every package reads the config) and `EXIT_CODES`; imports nothing, so every package
(the torch-free planner included) can derive from it.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad usage, config or input: the message names the key or file and the fix (exit 2)."""


class JobFailure(Exception):
    """The job failed at run time although its input was valid (exit 1)."""


class ConfigError(UserError, ValueError):
    """A config key, value, override or file the config loader refuses (`lazytrain.config`):
    unknown key, value out of range, malformed YAML. The message names the dotted key (or the
    file) and the fix. Also a `ValueError`, so callers that catch that keep working."""


class ConfigTypeError(ConfigError, TypeError):
    """A config value of the wrong type (`train.steps must be an int; got 'many'`); also a
    `TypeError`."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The config file named on the command line does not exist; also a `FileNotFoundError`."""


EXIT_CODES = {UserError: 2, JobFailure: 1}
"""Base class -> the `lazytrain` exit status for it (docs in `lazytrain.cli.main`)."""
