"""The training loop above the streaming engine: plan, preflight, train, evaluate, checkpoint.

`train(cfg, run_dir=...)` reads as: set up the run directory, join the job (`rank.join_job`:
one process, or one rank of a torchrun job), build the `Trainer` (`trainer.py`: resolve the
model, plan or load the given / the run's plan, preflight, load weights and data, build the
`Engine`, restore a checkpoint when resuming), evaluate, run the steps, save, evaluate, refit
this machine's cached calibration when the run's windows contradict it (`recalibrate.py`),
write the summary. Under torchrun every rank runs this same loop (`trainer.py` says what the rank
context changes).

Files in RUN_DIR: `config.yaml` (resolved config), `plan.json`, `metrics.jsonl` (one JSON object
per optimizer step: step, loss, tokens, label_tokens, step_s, tokens_per_s, model_tflops, lr,
grad_norm, peak_bytes per store accounting key, world_size), `windows.jsonl` (one JSON object per step and
micro-batch: every window's wall, compute, waits and bytes per channel; schema in
`runtime/instrument.py`), `summary.json`, `checkpoints/step-N/` (see
`checkpoint.py`), `nvme/` (the NVMe tier's scratch; with runtime.nvme_dir set, the job's own
subdirectory `job-<run name>-<hash>` there, locked through `<that>.lock` so that a second job
is refused: `locks.job_nvme_dir`), `tensorboard/` and `wandb/` when `train.report_to` names
them (`tracking.py`). `summary.json` records the NVMe directory and whether O_DIRECT or
buffered I/O ran there. Data parallel: `rank-R/plan.json` and `rank-R/windows.jsonl` per rank.

Run directory: a fresh run (no `resume`) refuses a directory that already holds a run's state
(checkpoints, metrics, windows, summary) unless `overwrite` is set (`rundir.py`). Everything
that can reject the job (config, model source, data read and tokenized, chat template, plan,
preflight, on resume the checkpoint and its data state) is checked before a file of the run
directory is touched: only then does `overwrite` delete the old run's files and are
`config.yaml` and `plan.json` written, so a refused job leaves an old run byte for byte and a
fresh run directory without them.

Resume: the newest checkpoint must be complete (`checkpoint.resume_checkpoint`: a missing run
directory, no checkpoint or a damaged newest one is an error, never a fresh start); it supplies
the weights, optimizer and RNG states, the data position and the step; the run's own plan.json
is reused. A resume with another model (config path or architecture), seq_len, micro_batch or
data is refused. Bit-identical: with the same config and world size, the losses, gradient norms
and weights of N steps, stopped after k and resumed, equal those of N straight steps, with
dropout and evaluation on: the evaluation model is built and run under a forked RNG
(`torch.random.fork_rng`), so it never moves the training RNG.

Saving: at the end, every `train.checkpoint_every_steps` steps, whenever
`train.checkpoint_every_min` minutes of wall time have passed since the last save, and on
SIGTERM or SIGINT (Ctrl-C): the step in flight finishes, a checkpoint is saved, and `train`
returns with `stopped_by="SIGTERM"` / `"SIGINT"`; a second Ctrl-C interrupts at once. A failed
save (disk full) raises `CheckpointSaveError`; the previous checkpoint stays the newest valid one.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from safetensors import SafetensorError
from tqdm import tqdm

from lazytrain.atomic import write_json_atomic
from lazytrain.config import RunConfig
from lazytrain.errors import JobFailure
from lazytrain.planner.plan import Plan
from lazytrain.planner.refit import load_windows
from lazytrain.profile.calibrate import costs_line_of
from lazytrain.train import checkpoint as ckpt
from lazytrain.train import locks
from lazytrain.train.evaluate import eval_line, sample_lines
from lazytrain.train.grpo import check_grpo_config
from lazytrain.train.preflight import free_bytes
from lazytrain.train.rank import join_job, launched_rank, quiet_unless_main
from lazytrain.train.rundir import check_run_dir
from lazytrain.train.recalibrate import recalibrate_from_run
from lazytrain.train.trainer import Trainer, stderr_log

@dataclass(kw_only=True, frozen=True, slots=True)
class TrainHooks:
    """Test hooks (all optional)."""

    on_step_end: Callable[[int, Any], None] | None = None
    """Called with (steps completed, StepStats) after each step's metrics are written."""
    before_marker: Callable[[Path], None] | None = None
    """Passed to `save_checkpoint` (raise there to simulate a crash mid-save)."""
    fault_hook: Callable[[Any], None] | None = None
    """NVMe fault injector for the engine's activation store (`runtime.nvme.FaultInjector`)."""


STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
"""Signals that stop training after the step in flight, with a checkpoint."""


class CheckpointSaveError(JobFailure, OSError):
    """Writing a checkpoint failed (disk full, I/O error); the previous checkpoint is kept.
    A job failure (the CLI exits 1 with its one-line message), and an OSError."""


@contextmanager
def stop_flag(log: Callable[[str], None]):
    """Yield a dict whose "set" becomes "SIGTERM" or "SIGINT" when that signal arrives (main
    thread only; the previous handlers are restored after). After the first SIGINT the default
    handler is back, so a second Ctrl-C raises KeyboardInterrupt at once; `log` says so."""
    flag: dict[str, Any] = {"set": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {}

    def handler(signum, frame):
        flag["set"] = flag["set"] or STOP_SIGNALS[signum]
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, previous[signal.SIGINT])
            log("\nCtrl-C: finishing this step and saving a checkpoint (Ctrl-C again to "
                "abort without one)")

    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, handler)
    try:
        yield flag
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def make_run_dir(run_dir: Path) -> None:
    """Create the run directory, one line naming the key when it cannot be.

    Raises:
        CheckpointSaveError: it cannot be created or written (permissions, a file in the way,
            a read-only or missing mount).
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".lazytrain-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise CheckpointSaveError(f"train.run_dir: cannot write to {run_dir} "
                                  f"({exc.strerror or exc}); choose a writable --run-dir"
                                  ) from None


@contextmanager
def save_errors(run_dir: Path, *, step: int):
    """Turn a failed checkpoint write into one `CheckpointSaveError` line naming the checkpoint,
    the cause and the checkpoint that stays (safetensors reports a full disk as
    `SafetensorError`, not OSError)."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        if isinstance(exc, CheckpointSaveError):
            raise
        last = ckpt.latest_checkpoint(run_dir)
        cause = _save_failure_cause(exc, ckpt.checkpoints_dir(run_dir))
        then = (f"the previous checkpoint {last.path} is kept; free space and --resume "
                f"{run_dir}" if last else "no checkpoint of this run was saved before, so "
                f"there is nothing to resume; free space and train again with --overwrite")
        raise CheckpointSaveError(
            f"saving checkpoint step-{step:06d} in {ckpt.checkpoints_dir(run_dir)} failed "
            f"({cause}); {then}") from None


def _save_failure_cause(exc: Exception, directory: Path) -> str:
    """What failed in a checkpoint write, in words: the file (an OSError's `filename`, else
    the safetensors weights) and, for a full disk (ENOSPC; safetensors says "os error 28"),
    that the disk is full with the errno and the free bytes left on it."""
    oserror = isinstance(exc, OSError)
    text = (exc.strerror if oserror and exc.strerror else
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    what = (Path(exc.filename).name if oserror and exc.filename else
            "the model weights (safetensors)" if not oserror else None)
    full = (exc.errno == errno.ENOSPC) if oserror else f"os error {errno.ENOSPC})" in str(exc)
    if full:
        text = (f"the disk is full: {os.strerror(errno.ENOSPC)}, errno {errno.ENOSPC} ENOSPC, "
                f"{free_bytes(directory)} bytes free on {directory}")
    return f"writing {what}: {text}" if what else text


def _save_due(cfg: RunConfig, *, step: int, since_save_s: float) -> bool:
    """A periodic checkpoint is due after this step (`train.checkpoint_every_steps`,
    `train.checkpoint_every_min`); never after the last step, which always saves."""
    tc = cfg.train
    if step >= tc.steps:
        return False
    by_steps = bool(tc.checkpoint_every_steps) and step % tc.checkpoint_every_steps == 0
    by_time = bool(tc.checkpoint_every_min) and since_save_s >= 60.0 * tc.checkpoint_every_min
    return by_steps or by_time


def train(cfg: RunConfig, *, run_dir: str | Path | None = None, plan: Plan | None = None,
          resume: bool = False, overwrite: bool = False, hooks: TrainHooks | None = None,
          progress: bool = True, log: Callable[[str], None] | None = None,
          clock: Callable[[], float] = time.monotonic, verify_checkpoint: bool = True) -> dict:
    """Run training as configured; returns the summary (also written to RUN_DIR/summary.json).

    Args:
        cfg: the run config (`train.steps` is the total, counting steps before a resume).
        run_dir: overrides `train.run_dir`.
        plan: a plan to use instead of planning (checked against seq_len and micro_batch).
        resume: continue from the newest checkpoint in run_dir, which must be complete.
        overwrite: replace a previous run in run_dir (`rundir.clear_run_dir`, once every
            check has passed); without it a fresh run into a used run_dir is refused.
        hooks: test hooks.
        progress: show the tqdm bar on stderr.
        log: one-line messages (default: print to stderr).
        clock: seconds (monotonic) for `train.checkpoint_every_min` (tests pass a fake one).
        verify_checkpoint: with `resume`, check the checkpoint's files against their xxh3
            digests (False: sizes only, for very large checkpoints; said in one line).

    Returns:
        The summary; `stopped_by` is None, "SIGTERM" or "SIGINT".

    Raises:
        PreflightError: the plan does not fit this machine (numbers in the message).
        PlanInfeasibleError, PlanValidationError: planning failed / the plan does not match.
        CheckpointError: `resume` and the checkpoint is missing, damaged or unsafe.
        NvmeIOError: an NVMe-tier I/O error (the last saved checkpoint stays valid).
        CheckpointSaveError: a checkpoint write failed (the previous one stays valid).
        ValueError, FileNotFoundError: bad config or data, a used run_dir without overwrite,
            a resume with another model.
        RunDirInUseError: another live job trains in `run_dir` (nothing of it was touched).
    """
    run_dir = Path(run_dir or cfg.train.run_dir)
    locking = launched_rank() == 0 and (run_dir.exists() or not resume)  # a missing resume dir: its error
    if locking:
        make_run_dir(run_dir)  # one line naming train.run_dir when it is not a writable dir
    # one job per run directory, before anything in it is checked, deleted or written
    # (rank 0 holds it for the ranks of a data-parallel job)
    run_lock = locks.lock_run_dir(run_dir) if locking else None
    try:
        return _train(cfg, run_dir=run_dir, plan=plan, resume=resume, overwrite=overwrite,
                      hooks=hooks, progress=progress, log=log, clock=clock,
                      verify_checkpoint=verify_checkpoint)
    finally:
        if run_lock is not None:
            run_lock.close()


def _train(cfg: RunConfig, *, run_dir: Path, plan: Plan | None, resume: bool, overwrite: bool,
           hooks: TrainHooks | None, progress: bool, log: Callable[[str], None] | None,
           clock: Callable[[], float], verify_checkpoint: bool) -> dict:
    """`train`'s body, under the run directory's lock."""
    log = log or stderr_log
    hooks = hooks or TrainHooks()
    t_start = time.perf_counter()
    check_run_dir(run_dir, resume=resume, overwrite=overwrite)  # deletes nothing
    ctx, cfg = join_job(cfg, run_dir=run_dir, log=log)  # torchrun: this rank's context
    if cfg.train.method == "grpo":  # refused before a file of the run is written
        check_grpo_config(cfg, world_size=ctx.world_size)
    if not ctx.is_main:
        log = lambda msg: None  # noqa: E731  (rank 0 logs)
        progress = False
    with quiet_unless_main(ctx):
        trainer = Trainer(cfg, ctx, run_dir=run_dir, plan=plan, resume=resume,
                          overwrite=overwrite, hooks=hooks, log=log,
                          verify_checkpoint=verify_checkpoint)
    cfg = trainer.cfg  # train.epochs resolved to train.steps
    stopped_by, records, saved = None, [], None
    timings = {"setup_s": time.perf_counter() - t_start}
    try:
        mark = time.perf_counter()
        before = trainer.evaluate()
        timings["eval_before_s"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if before is not None:
            log(eval_line("before", before, seq_len=cfg.data.seq_len))
            trainer.track_eval(before)  # as the periodic ones: eval/* at the start step
            for line in sample_lines("before", before):  # learning a person can see
                log(line)
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, file=sys.stderr,
                   disable=not progress, desc="train", unit="step")
        last_save = clock()
        with stop_flag(log) as stop:
            while trainer.step < cfg.train.steps:
                rec = trainer.train_step()
                records.append(rec)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                tflops=f"{rec['model_tflops']:.3f}")
                if trainer.should_stop(bool(stop["set"])):
                    stopped_by = stop["set"] or "SIGTERM"  # data parallel: another rank's
                    break
                if (cfg.train.eval_every and trainer.step % cfg.train.eval_every == 0
                        and trainer.step < cfg.train.steps):
                    trainer.evaluate_and_record(log)  # train.eval_every
                due = _save_due(cfg, step=trainer.step, since_save_s=clock() - last_save)
                if cfg.train.checkpoint_every_min:
                    due = trainer.should_stop(due)  # any rank's clock: all save together
                if due:
                    with save_errors(run_dir, step=trainer.step):
                        saved = trainer.save()
                    last_save = clock()
            bar.close()
            timings["train_s"] = time.perf_counter() - mark
            mark = time.perf_counter()
            with save_errors(run_dir, step=trainer.step):
                saved = trainer.save()  # still under stop_flag: a Ctrl-C now does not cut it
        timings["save_s"] = time.perf_counter() - mark
        if trainer.is_main:  # what the stream cut or dropped, which the loss curve hides
            log(trainer.data.train.counts.line(seq_len=cfg.data.seq_len,
                                               overlong=cfg.data.overlong))
        mark = time.perf_counter()
        after = trainer.evaluate() if stopped_by is None else None
        timings["eval_after_s"] = time.perf_counter() - mark
        if after is not None:
            log(eval_line("after", after, seq_len=cfg.data.seq_len))
            trainer.track_eval(after)
            for line in sample_lines("after", after):  # learning a person can see
                log(line)
        refit = _recalibrate(cfg, trainer, run_dir=run_dir, log=log) if trainer.is_main else None
        summary = _summary(trainer, records=records, before=before, after=after, saved=saved,
                           stopped_by=stopped_by, wall_s=time.perf_counter() - t_start)
        summary["calibration_refit"] = refit
        summary["timings_s"] = timings
        if trainer.is_main:  # data parallel: rank 0 writes the run's files
            write_json_atomic(run_dir / "summary.json", summary)
        return summary
    finally:
        trainer.close()


def _recalibrate(cfg: RunConfig, trainer: Trainer, *, run_dir: Path, log) -> dict | None:
    """This run's windows replace the cached calibration they contradict
    (`recalibrate.recalibrate_from_run`); a cache that cannot be rewritten or a damaged
    windows.jsonl is a warning, never a failed run."""
    if not trainer.windows_path.is_file():
        return None
    try:
        return recalibrate_from_run(cfg, trainer.plan, load_windows(trainer.windows_path),
                                    run_dir=run_dir, log=log)
    except (OSError, ValueError) as exc:
        log(f"warning: the calibration cache could not be refit from this run ({exc})")
        return None


def _summary(trainer: Trainer, *, records, before, after, saved, stopped_by, wall_s) -> dict:
    steps_s = [r["step_s"] for r in records]
    return {
        "run_dir": str(trainer.run_dir), "steps_completed": trainer.step,
        "steps_this_run": len(records), "stopped_by": stopped_by,
        "resumed_from": str(trainer.resumed_from.path) if trainer.resumed_from else None,
        "checkpoint": str(saved.path) if saved else None,
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
        "mean_step_s": sum(steps_s) / len(steps_s) if steps_s else None,
        "mean_tokens_per_s": (sum(r["tokens"] for r in records) / sum(steps_s)) if steps_s
        else None,
        "eval_before": before.to_dict() if before else None,
        "eval_after": after.to_dict() if after else None,
        "data": {"source": trainer.data.source, "format": trainer.data.format,
                 **trainer.data.train.counts.to_dict()},
        "plan": {"solver": trainer.plan.solver.backend if trainer.plan.solver else None,
                 "tiers": list(trainer.plan.tiers),
                 "predicted_step_s": trainer.plan.predicted.step_ms / 1e3
                 if trainer.plan.predicted else None,
                 "costs": costs_line_of(trainer.plan.provenance)},
        "nvme": {"dir": str(trainer.nvme_dir), "io": trainer.nvme_io_mode()},
        "device": trainer.device, "device_backend": trainer.device_kind,
        "model_flops_params": trainer.flops_params, "wall_s": wall_s,
        **({"dpo_eval": trainer.dpo.evals} if getattr(trainer, "dpo", None) else {}),
    }
