"""Experiment trackers: the per-step metrics sent to TensorBoard and Weights & Biases.

Owns `train.report_to` (HF TrainingArguments' name): which trackers a run opens, the check that
each one's package is installed (before any weights load), and the scalars logged per
optimizer step, flattened from the metrics.jsonl record and the step's window records:

| scalar                               | unit    | source                                        |
|--------------------------------------|---------|-----------------------------------------------|
| train/loss, train/lr, train/grad_norm | -       | metrics.jsonl record                          |
| perf/tokens_per_s, perf/model_tflops | 1/s, TF | metrics.jsonl record (6 N tokens / step)      |
| perf/step_ms_measured                | ms      | the step's wall time                          |
| perf/step_ms_predicted               | ms      | the plan's predicted step (`plan.predicted`)  |
| exposed_ms/<channel>                 | ms      | sum of the step's window waits on the channel |
| memory/peak_hbm_checkpoint_bytes     | bytes   | store accounting: activations held in HBM     |
| memory/peak_host_checkpoint_bytes    | bytes   | store accounting: dram tier + staging (pinned on CUDA) |
| memory/peak_hbm_allocated_bytes      | bytes   | `torch.cuda.max_memory_allocated` (CUDA only) |

metrics.jsonl stays the record of the run; trackers are views of it. W&B runs offline unless
the environment sets `WANDB_MODE` (a run syncs later with `wandb sync <run_dir>/wandb`).
Knows nothing of plans beyond the predicted step time it is given.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Iterable

EXTRAS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Tracker name -> (the Python package it imports, the pyproject extra that installs it)."""

EXPOSED_CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
"""Channels whose waits are logged (`runtime.instrument.CHANNELS`, restated here so that the
tracker list reads without importing the runtime)."""


def check_trackers(report_to: Iterable[str]) -> tuple[str, ...]:
    """The trackers to open ("none" removed), after checking each one's package is installed.

    Raises:
        ValueError: a tracker's package is missing; names the extra to install.
    """
    names = tuple(n for n in report_to if n != "none")
    for name in names:
        if importlib.util.find_spec(EXTRAS[name]) is None:
            raise ValueError(f"train.report_to: {name} needs the {EXTRAS[name]} package; "
                             f"pip install 'lazytrain[{name}]' or remove {name} from "
                             f"train.report_to")
    return names


def step_scalars(record: dict, *, windows: list[dict], predicted_step_ms: float | None,
                 hbm_allocated_bytes: int | None = None) -> dict[str, float]:
    """The scalars of one optimizer step (module docstring table).

    Args:
        record: the step's metrics.jsonl record (`loop.step_record`).
        windows: the step's window records, one per micro-batch (`StepStats.windows`,
            windows.jsonl schema in `runtime/instrument.py`).
        predicted_step_ms: the plan's predicted step time, ms (None: not logged).
        hbm_allocated_bytes: CUDA peak allocated bytes this step (None on CPU: not logged).

    Returns:
        name -> value; the exposed time of a channel is the sum over micro-batches and windows
        of the time the compute waited for it, ms.
    """
    out = {"train/loss": record["loss"], "train/lr": record["lr"],
           "perf/tokens_per_s": record["tokens_per_s"],
           "perf/model_tflops": record["model_tflops"],
           "perf/step_ms_measured": record["step_s"] * 1e3}
    if record.get("grad_norm") is not None:
        out["train/grad_norm"] = record["grad_norm"]
    if predicted_step_ms is not None:
        out["perf/step_ms_predicted"] = predicted_step_ms
    for channel in EXPOSED_CHANNELS:
        out[f"exposed_ms/{channel}"] = sum(w["wait_ms"].get(channel, 0.0)
                                           for mb in windows for w in mb["windows"])
    peaks = record.get("peak_bytes") or {}
    out["memory/peak_hbm_checkpoint_bytes"] = peaks.get("hbm", 0)
    out["memory/peak_host_checkpoint_bytes"] = peaks.get("dram", 0) + peaks.get("dram_staging", 0)
    if hbm_allocated_bytes is not None:
        out["memory/peak_hbm_allocated_bytes"] = hbm_allocated_bytes
    return {k: float(v) for k, v in out.items()}


class Trackers:
    """The open trackers of one run (none: every call does nothing).

    Args:
        names: trackers to open, checked by `check_trackers`.
        run_dir: the run directory; TensorBoard writes `<run_dir>/tensorboard`, W&B
            `<run_dir>/wandb`.
        config: the resolved run config as a dict (W&B's run config, TensorBoard's text).
    """

    def __init__(self, names: Iterable[str], *, run_dir: Path, config: dict) -> None:
        self.names = tuple(names)
        self.run_dir, self.config = Path(run_dir), config
        self._tb = None
        self._wandb = None

    def _open(self, first_step: int) -> None:
        """Open on first use, so a rank that never logs (data parallel, rank > 0) opens none.

        TensorBoard: events of an earlier process at steps >= `first_step` (a resumed run
        redoes the steps after its last checkpoint) are purged, as metrics.jsonl drops them."""
        if "tensorboard" in self.names and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency (the [all] extra)
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                     purge_step=first_step)
        if "wandb" in self.names and self._wandb is None:
            import wandb  # lazy: optional dependency (the [all] extra)
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "lazytrain"),
                                     name=self.run_dir.name, dir=str(self.run_dir),
                                     config=self.config,
                                     mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Send one step's scalars to every open tracker (x axis: the optimizer step)."""
        if not self.names:
            return
        self._open(step)
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close every open tracker (W&B: finish the run)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
