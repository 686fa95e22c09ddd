"""The training loop above the streaming engine: plan, preflight, train, evaluate, checkpoint.

`train(cfg, run_dir=...)` reads as: set up the run directory, resolve the model, plan (or load
the given / the run's plan), preflight, load weights and data, build the `Engine`, restore a
checkpoint when resuming, evaluate, run the steps, save, evaluate, write the summary.

Files in RUN_DIR: `config.yaml` (resolved config), `plan.json`, `metrics.jsonl` (one JSON object
per optimizer step: step, loss, tokens, label_tokens, step_s, tokens_per_s, model_tflops, lr,
grad_norm, peak_bytes per store accounting key), `windows.jsonl` (one JSON object per step and
micro-batch: every window's wall, compute, waits and bytes per channel; schema in
`runtime/instrument.py`), `summary.json`, `checkpoints/step-N/` (see
`checkpoint.py`), `nvme/` (the NVMe tier's scratch; with runtime.nvme_dir set, the job's own
subdirectory `job-<run name>-<hash>` there, locked through `<that>.lock` so that a second job
is refused: `setup.job_nvme_dir`), `tensorboard/` and `wandb/` when `train.report_to` names
them (`tracking.py`). `summary.json` records the NVMe directory and whether O_DIRECT or
buffered I/O ran there.

Run directory: a fresh run (no `resume`) refuses a directory that already holds a run's state
(checkpoints, metrics, windows, summary) unless `overwrite` is set, which deletes exactly those
files first (`prepare_run_dir`). `config.yaml` and `plan.json` are written only after the config,
the model source, the data paths and the plan have been checked, so a rejected config never
replaces the saved one.

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

import json
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lazytrain.atomic import read_jsonl, write_text_atomic
from lazytrain.config import RunConfig, apply_overrides, save_config
from lazytrain.planner.plan import Plan
from lazytrain.train import checkpoint as ckpt
from lazytrain.train import setup
from lazytrain.train.evaluate import build_eval_model, evaluate, load_weights, sample_lines
from lazytrain.train.preflight import preflight
from lazytrain.train.tracking import Trackers, check_trackers, step_scalars

CHECKPOINT_BYTES_PER_PARAM = 12
"""fp32 weights (4 B) + fp32 Adam moments (8 B) per parameter: one checkpoint's size."""
EVAL_BYTES_PER_PARAM = 4
"""The fp32 evaluation copy of the weights (`evaluate.py`)."""


def step_record(step: int, stats, batches: list[dict], *, flops_params: float) -> dict:
    """The metrics.jsonl record of one optimizer step (single-process and data-parallel).

    Args:
        step: the step number just completed (1-based).
        stats: the engine's `StepStats`.
        batches: every micro-batch of the step (all ranks' under data parallelism), so tokens
            and model TFLOPS count the global batch; real tokens exclude padding.
        flops_params: N of the model-FLOPs rule 6 * N * tokens (ModelSpec.model_flops_params).
    """
    from lazytrain.data import real_token_count  # padded or packed batches

    real_tokens = sum(real_token_count(b) for b in batches)
    return {"step": step, "loss": stats.loss, "tokens": real_tokens,
            "label_tokens": stats.tokens, "step_s": stats.step_s,
            "tokens_per_s": real_tokens / stats.step_s,
            "model_tflops": 6 * flops_params * real_tokens / stats.step_s / 1e12,
            "lr": stats.lr, "grad_norm": stats.grad_norm,
            "peak_bytes": dict(stats.peak_bytes)}


def resolve_epochs(cfg: RunConfig, stream, *, world_size: int, log) -> RunConfig:
    """`cfg` with `train.steps` set to the steps that draw `train.epochs` passes over
    `stream` (`data.batching.steps_for_epochs`: world_size x grad_accum micro-batches a step);
    says the result in one line."""
    from lazytrain.data.batching import steps_for_epochs

    tc = cfg.train
    steps = steps_for_epochs(stream, epochs=tc.epochs,
                             micro_batches_per_step=tc.grad_accum * world_size)
    log(f"train.epochs={tc.epochs:g}: {steps} steps over {len(stream.examples)} training "
        f"samples (train.steps={tc.steps} is not used)")
    return apply_overrides(cfg, [f"train.steps={steps}"])


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainHooks:
    """Test hooks (all optional)."""

    on_step_end: Callable[[int, Any], None] | None = None
    """Called with (steps completed, StepStats) after each step's metrics are written."""
    before_marker: Callable[[Path], None] | None = None
    """Passed to `save_checkpoint` (raise there to simulate a crash mid-save)."""
    fault_hook: Callable[[Any], None] | None = None
    """NVMe fault injector for the engine's checkpoint store (`runtime.nvme.FaultInjector`)."""


STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
"""Signals that stop training after the step in flight, with a checkpoint."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, I/O error); the previous checkpoint is kept.
    An OSError: the CLI exits 1 with its one-line message."""


@contextmanager
def stop_flag():
    """Yield a dict whose "set" becomes "SIGTERM" or "SIGINT" when that signal arrives (main
    thread only; the previous handlers are restored after). After the first SIGINT the default
    handler is back, so a second Ctrl-C raises KeyboardInterrupt at once."""
    flag: dict[str, Any] = {"set": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {}

    def handler(signum, frame):
        flag["set"] = flag["set"] or STOP_SIGNALS[signum]
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, previous[signal.SIGINT])
            print("\nCtrl-C: finishing this step and saving a checkpoint (Ctrl-C again to "
                  "abort without one)", file=sys.stderr, flush=True)

    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, handler)
    try:
        yield flag
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


RUN_STATE = ("checkpoints", "metrics.jsonl", "windows.jsonl", "summary.json", "tensorboard",
             "wandb")
"""What a run leaves in its directory that a new run must not mix with: the files a fresh run
refuses to write over without `--overwrite`, and exactly what `--overwrite` deletes (with
`plan.json`, `config.yaml` and the default `nvme/` scratch)."""


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, clear: bool = True) -> None:
    """Check (and with `overwrite`, clear) the run directory before anything is planned.

    Args:
        run_dir: the run directory (need not exist).
        resume: `--resume`: the directory's state is continued, nothing is checked here.
        overwrite: `--overwrite`: delete the previous run's files (`RUN_STATE`, plan.json,
            config.yaml, nvme/) instead of refusing; other files in the directory stay.
        clear: False on ranks > 0 of a data-parallel job (rank 0 deletes).

    Raises:
        ValueError: a fresh run into a directory holding a run's state (names what it holds
            and the two fixes), or both `resume` and `overwrite`.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: --resume continues "
                         "the run, --overwrite deletes it; pass one")
    if resume or not run_dir.is_dir():
        return
    held = [name for name in RUN_STATE if (run_dir / name).exists()]
    if not held:
        return
    if not overwrite:
        raise ValueError(f"train.run_dir: {run_dir} already holds a run ({', '.join(held)}); "
                         f"continue it with --resume {run_dir}, start it again with "
                         f"--overwrite, or pick another --run-dir")
    if clear:
        for name in (*RUN_STATE, "plan.json", "config.yaml", "nvme"):
            target = run_dir / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()


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


def _device(choice: str) -> str:
    """The device API backend of `runtime.device` (auto: cuda when torch sees one, else cpu).

    Raises:
        ValueError: cuda requested without a CUDA device.
    """
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("runtime.device: cuda requested but torch sees no CUDA device; "
                         "use runtime.device=cpu")
    return choice


def device_type(kind: str) -> str:
    """torch device type of a backend: "cuda" for cuda, "cpu" for the three CPU backends."""
    return "cuda" if kind == "cuda" else "cpu"


def _get_plan(cfg: RunConfig, run_dir: Path, *, plan: Plan | None, resuming: bool) -> Plan:
    """The given plan, the run's own plan.json when resuming, or a new plan from the config."""
    if plan is None and resuming and (run_dir / "plan.json").is_file():
        plan = Plan.load(run_dir / "plan.json")
        dist = plan.provenance.get("dist") or {}
        planned = (dist.get("nproc_per_node", 1), dist.get("nnodes", 1))
        if planned != (cfg.dist.nproc_per_node, cfg.dist.nnodes):  # another share of a node
            print(f"note: {run_dir / 'plan.json'} was planned for {planned[1]} node(s) x "
                  f"{planned[0]} ranks; this job has {cfg.dist.nnodes} x "
                  f"{cfg.dist.nproc_per_node}: planning again", file=sys.stderr)
            plan = None
    if plan is None:
        plan = setup.make_plan(cfg, run_dir=run_dir)
    plan.check_matches(seq_len=cfg.data.seq_len, micro_batch=cfg.train.micro_batch)
    return plan


def _run_preflight(cfg: RunConfig, plan: Plan, *, device: str, nvme_dir: Path, run_dir: Path,
                   num_params: int) -> None:
    pred = plan.predicted
    dram = int(pred.dram_bytes) if pred else 16 * num_params
    eval_copy = EVAL_BYTES_PER_PARAM * num_params if cfg.data.num_eval else 0
    # dram-tier checkpoints + staging pools: the plan's DRAM less the host states (which depend
    # on train.master_dtype: 16 or 12 B/param) and the optimizer's pageable scratch
    memory = plan.provenance.get("memory") or {}
    states = memory.get("states_bytes", 16 * num_params)
    pinned = max(0, dram - states - memory.get("optimizer_scratch_bytes", 0))
    preflight(device=device, host_bytes=dram + eval_copy,
              hbm_bytes=int(pred.peak_hbm_bytes) if pred else 0, pinned_bytes=pinned,
              nvme_bytes=int(pred.nvme_bytes) if pred else 0, nvme_dir=nvme_dir,
              checkpoint_bytes=CHECKPOINT_BYTES_PER_PARAM * num_params, run_dir=run_dir)


def _truncate_metrics(path: Path, *, last_step: int) -> None:
    """Drop metric lines after `last_step` (steps redone after a resume)."""
    if path.is_file():  # a crash mid-append may have torn the last line: read_jsonl skips it
        keep = [r for r in read_jsonl(path) if r["step"] <= last_step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


class Trainer:
    """One run: everything `train` sets up, and the step loop over it."""

    def __init__(self, cfg: RunConfig, *, run_dir: Path, plan: Plan | None, resume: bool,
                 hooks: TrainHooks, log) -> None:
        self.cfg, self.run_dir, self.hooks, self.log = cfg, run_dir, hooks, log
        tc = cfg.train
        self.device_kind = _device(cfg.runtime.device)
        self.device = device_type(self.device_kind)  # "cpu" or "cuda"
        tracker_names = check_trackers(tc.report_to)  # a missing extra fails before loading
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        # Everything that can reject the job runs before a file is written or a weight loaded.
        self.resumed_from = ckpt.resume_checkpoint(run_dir) if resume else None
        saved_state = None
        if self.resumed_from is not None:
            self._check_world_size(self.resumed_from)
            saved_state = self.resumed_from.load_state()  # weights_only: refuses code objects
            setup.check_same_model(cfg, saved_state.get("config"), self.resumed_from.path)
            setup.check_same_shape(cfg, saved_state.get("config"), self.resumed_from.path)
            source = setup.ModelSource(directory=self.resumed_from.path, has_weights=True)
        setup.check_data_paths(cfg.data)
        self.plan = _get_plan(cfg, run_dir, plan=plan, resuming=self.resumed_from is not None)
        if self.resumed_from is None:  # after planning: a hub id downloads its weights here
            source = setup.resolve_model_source(cfg.model.config_path, weights=True)
        make_run_dir(run_dir)
        save_config(cfg, run_dir / "config.yaml")
        self.plan.save(run_dir / "plan.json")
        print(setup.plan_summary(self.plan, source=str(cfg.model.config_path)), flush=True)
        self.trackers = Trackers(tracker_names, run_dir=run_dir, config=cfg.to_dict())
        self.nvme_dir = setup.job_nvme_dir(cfg.runtime.nvme_dir, run_dir=run_dir)
        hf_config = setup.load_hf_config(source)
        from lazytrain.spec.model import ModelSpec
        spec = ModelSpec.from_hf_config(hf_config.to_dict())
        _run_preflight(cfg, self.plan, device=self.device, nvme_dir=self.nvme_dir,
                       run_dir=run_dir, num_params=spec.total_params)
        from lazytrain.data import corpus_texts
        self.tokenizer = setup.load_tokenizer(
            source, vocab_size=hf_config.vocab_size,
            corpus=lambda: corpus_texts(cfg.data, seed=tc.seed))
        self.adapter = self._load_adapter(source)
        from lazytrain.data import build_data
        self.data = build_data(cfg.data, self.tokenizer, micro_batch=tc.micro_batch,
                               seed=tc.seed, hf_config=hf_config)
        for note in self.data.notes:  # e.g. chatml chosen for a tokenizer without a template
            log(note)
        if tc.epochs:  # train.epochs -> train.steps, the same on every resume of the run
            self.cfg = cfg = resolve_epochs(cfg, self.data.train, world_size=self.world_size,
                                            log=log)
            tc = cfg.train
        # one lock per job and node: local rank 0 takes it, the node's other ranks share the
        # dir; nodes lock their own file (the directory may be on a file system they share)
        ctx = getattr(self, "ctx", None)
        if getattr(ctx, "local_rank", 0) == 0:
            node = f"node{ctx.node_rank}" if ctx is not None and ctx.nnodes > 1 else ""
            self._nvme_lock = setup.lock_nvme_dir(self.nvme_dir, node=node)
        try:
            self.engine = self._make_engine()
        except BaseException:
            self._release_nvme_lock()
            raise
        self.log(f"device: {self.device_kind} (runtime.device); nvme: {self.nvme_dir} "
                 f"({self.nvme_io_mode()} I/O)")
        self.replanner = self._make_replanner()
        self.step = 0
        if saved_state is not None:
            self._restore(saved_state)
        self.flops_params = spec.model_flops_params  # N of 6 * N * tokens (DESIGN 5)
        self.eval_model = None

    world_size = 1
    """Ranks of this job (the data-parallel trainer sets its own)."""

    def _check_world_size(self, checkpoint) -> None:
        """Refuse a checkpoint written by another number of ranks (its marker says how many).

        Raises:
            ValueError: names the checkpoint, both world sizes and the torchrun fix.
        """
        if checkpoint is None:
            return
        saved = json.loads((checkpoint.path / ckpt.MARKER).read_text()).get("world_size") or 1
        if saved != self.world_size:
            raise ValueError(
                f"checkpoint {checkpoint.path} was written by {saved} rank(s); this job has "
                f"{self.world_size}: resume with the same world size (e.g. torchrun "
                f"--nproc_per_node {saved} -m lazytrain.cli.main train --resume RUN_DIR)")

    def _load_adapter(self, source):
        """The model with its weights in the host store (`setup.load_adapter`)."""
        tc = self.cfg.train
        return setup.load_adapter(source, compute_dtype=tc.compute_dtype,
                                  master_dtype=tc.master_dtype, seed=tc.seed)

    def _make_engine(self):
        from lazytrain.runtime.activations import CheckpointStore
        from lazytrain.runtime.device import make_device
        from lazytrain.runtime.engine import Engine

        tc = self.cfg.train
        store = CheckpointStore(
            device=make_device(self.device_kind, seed=tc.seed), nvme_dir=self.nvme_dir,
            io_threads=self.cfg.runtime.io_threads, fault_hook=self.hooks.fault_hook,
            hbm_limits={w.name: w.hbm_checkpoint_bytes for w in self.plan.windows})
        # before the Engine wraps store.io with its instrument (0: wait without a limit)
        store.io.timeout_s = self.cfg.runtime.nvme_timeout_s or None
        return Engine(self.adapter, self.plan, device=store.dev, nvme_dir=self.nvme_dir,
                      compute_dtype=tc.compute_dtype, lr=tc.lr,
                      betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                      weight_decay=tc.weight_decay, clip_grad_norm=tc.clip_grad_norm or None,
                      grad_accum=tc.grad_accum, seed=tc.seed, io_threads=self.cfg.runtime.io_threads,
                      model_config_sha256=setup.model_config_sha256(self.adapter.config),
                      store=store, instrument=True,
                      head_chunk_tokens=self.cfg.runtime.head_chunk_tokens, budgets=True)

    def _restore(self, state: dict) -> None:
        self.engine.load_state_dict(state["engine"])
        self.data.train.load_state_dict(state["data"])
        self.step = int(state["step"])
        _truncate_metrics(self.run_dir / "metrics.jsonl", last_step=self.step)
        _truncate_metrics(self.run_dir / "windows.jsonl", last_step=self.step)
        self.log(f"resumed from {self.resumed_from.path} at step {self.step}")

    # --- actions -------------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        from lazytrain.runtime.optim import lr_at
        tc = self.cfg.train
        return lr_at(step, base_lr=tc.lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps,
                     schedule=tc.schedule, min_lr_ratio=tc.min_lr_ratio)

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics record (also appended to metrics.jsonl)."""
        batches = [self.data.train.next_micro_batch() for _ in range(self.cfg.train.grad_accum)]
        stats = self.engine.step(batches, lr=self.lr_at(self.step))
        self.step += 1
        record = step_record(self.step, stats, batches, flops_params=self.flops_params)
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.track(record, stats)
        from lazytrain.runtime.instrument import write_windows_jsonl
        write_windows_jsonl(self.run_dir / "windows.jsonl", step=self.step, records=stats.windows)
        if self.replanner is not None:
            self._maybe_switch_plan(stats.windows)
        if self.hooks.on_step_end is not None:
            self.hooks.on_step_end(self.step, stats)
        return record

    def track(self, record: dict, stats) -> None:
        """Send the step's scalars to the `train.report_to` trackers (`tracking.py`)."""
        if not self.trackers.names:
            return
        predicted = self.plan.predicted.step_ms if self.plan.predicted else None
        allocated = (torch.cuda.max_memory_allocated() if self.device == "cuda" else None)
        self.trackers.log(self.step, step_scalars(record, windows=stats.windows,
                                                  predicted_step_ms=predicted,
                                                  hbm_allocated_bytes=allocated))

    def save(self) -> ckpt.Checkpoint:
        """Checkpoint the current step (weights after every queued update)."""
        state = {"engine": self.engine.state_dict(), "data": self.data.train.state_dict(),
                 "step": self.step, "config": self.cfg.to_dict()}
        saved = ckpt.save_checkpoint(self.run_dir, step=self.step,
                                     weights=self.engine.named_masters(),
                                     hf_config=self.adapter.config, tokenizer=self.tokenizer,
                                     state=state, before_marker=self.hooks.before_marker)
        self.log(f"saved checkpoint {saved.path}")
        return saved

    def evaluate(self):
        """Loss and exact match on the held-out examples with the current weights."""
        if not self.data.eval_examples:
            return None
        # The random init of the evaluation model (and any sampling in it) must not move the
        # training RNG, or a resumed run's dropout masks would differ from a straight run's.
        devices = [torch.cuda.current_device()] if self.device == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self.eval_model is None:
                self.eval_model = build_eval_model(self.adapter.config)
            load_weights(self.eval_model, self.engine.named_masters())
            return evaluate(self.eval_model, self.tokenizer, list(self.data.eval_examples),
                            seq_len=self.cfg.data.seq_len, pad_id=self.data.train.pad_id,
                            data_format=self.data.format)

    def evaluate_and_record(self, log) -> None:
        """A periodic evaluation (`train.eval_every`): its line in the log, an `"event":
        "eval"` record in metrics.jsonl and eval/* scalars for the trackers (rank 0)."""
        result = self.evaluate()
        if result is None or not self.is_main:
            return
        log(_eval_line(f"at step {self.step}", result, seq_len=self.cfg.data.seq_len))
        record = {"step": self.step, "event": "eval", "eval_loss": result.loss,
                  "exact_match": result.exact_match, "num_correct": result.num_correct,
                  "num_scored": result.num_scored}
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.trackers.log(self.step, {f"eval/{k}": v for k, v in
                                      (("loss", result.loss), ("exact_match", result.exact_match))
                                      if v is not None})

    def _make_replanner(self):
        """The online re-planner when `planner.replan_every_steps` > 0 (train/replan.py)."""
        pc = self.cfg.planner
        if not pc.replan_every_steps:
            return None
        from lazytrain.planner.build import rank_problem_from_config
        from lazytrain.train.replan import OnlineReplanner, resolve

        def solve(problem, current):
            return resolve(problem, current, policy=pc.policy, backend=pc.backend,
                           time_limit_s=pc.time_limit_s, gap=pc.gap, threads=pc.threads,
                           seed=pc.seed, megatrain_k=pc.megatrain_k)

        from lazytrain.runtime.calibrate import config_for_plan

        # the plan's own costs (its calibration file), so a re-plan compares like with like
        problem = rank_problem_from_config(config_for_plan(self.cfg, self.plan.provenance))
        return OnlineReplanner(problem, self.plan,
                               every=pc.replan_every_steps, threshold=pc.drift_threshold,
                               patience=pc.drift_patience_steps, solve=solve, log=self.log)

    def _maybe_switch_plan(self, records) -> None:
        """At a step boundary: run a finished re-plan from the next step on; log the event."""
        switch = self.replanner.after_step(self.step, records)
        if switch is None:
            return
        if switch.event.get("switched"):
            self.engine.set_plan(switch.plan)
            self.plan = switch.plan
            self.plan.save(self.run_dir / "plan.json")
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(switch.event) + "\n")

    is_main = True
    """Writes summary.json (False on ranks > 0 of a data-parallel job, `lazytrain.dist`)."""

    def should_stop(self, flag: bool) -> bool:
        """Whether to stop after this step given the stop-signal flag (data parallel: True when
        the flag is set on any rank, one collective; also used to agree on a wall-clock
        checkpoint, since the ranks' clocks differ)."""
        return flag

    def close(self) -> None:
        try:
            if self.replanner is not None:
                self.replanner.close()
            self.trackers.close()
            self.engine.close()
            self.engine.dev.close()  # the trainer made the device (make_device): its threads
        finally:
            self._release_nvme_lock()  # after the store deleted its files

    _nvme_lock = None
    """The open lock file of this job's NVMe directory (`setup.lock_nvme_dir`), or None."""

    def _release_nvme_lock(self) -> None:
        if self._nvme_lock is not None:
            self._nvme_lock.close()
            self._nvme_lock = None

    def nvme_io_mode(self) -> str:
        """"O_DIRECT" or "buffered": how the NVMe tier's files are read and written here (the
        fallback to buffered I/O when the filesystem refuses O_DIRECT is silent otherwise)."""
        return "O_DIRECT" if self.engine.store.io.direct else "buffered"


@contextmanager
def save_errors(run_dir: Path, *, step: int):
    """Turn a failed checkpoint write into one `CheckpointSaveError` line naming the checkpoint,
    the cause and the checkpoint that stays (safetensors reports a full disk as
    `SafetensorError`, not OSError)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        if isinstance(exc, CheckpointSaveError):
            raise
        last = ckpt.latest_checkpoint(run_dir)
        cause = (exc.strerror if isinstance(exc, OSError) and exc.strerror
                 else str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise CheckpointSaveError(
            f"saving checkpoint step-{step:06d} in {ckpt.checkpoints_dir(run_dir)} failed "
            f"({cause}); the previous checkpoint {last.path if last else '(none)'} is kept; "
            f"free space and --resume {run_dir}") from None


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
          clock: Callable[[], float] = time.monotonic) -> dict:
    """Run training as configured; returns the summary (also written to RUN_DIR/summary.json).

    Args:
        cfg: the run config (`train.steps` is the total, counting steps before a resume).
        run_dir: overrides `train.run_dir`.
        plan: a plan to use instead of planning (checked against seq_len and micro_batch).
        resume: continue from the newest checkpoint in run_dir, which must be complete.
        overwrite: delete a previous run's files in run_dir first (`prepare_run_dir`);
            without it a fresh run into a used run_dir is refused.
        hooks: test hooks.
        progress: show the tqdm bar on stderr.
        log: one-line messages (default: print to stderr).
        clock: seconds (monotonic) for `train.checkpoint_every_min` (tests pass a fake one).

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
    rank0 = int(os.environ.get("RANK", "0")) == 0
    locking = rank0 and (run_dir.exists() or not resume)  # a missing resume dir: its error
    if locking:
        make_run_dir(run_dir)  # one line naming train.run_dir when it is not a writable dir
    # one job per run directory, before anything in it is checked, deleted or written
    # (rank 0 holds it for the ranks of a data-parallel job)
    run_lock = setup.lock_run_dir(run_dir) if locking else None
    try:
        return _train(cfg, run_dir=run_dir, plan=plan, resume=resume, overwrite=overwrite,
                      hooks=hooks, progress=progress, log=log, clock=clock)
    finally:
        if run_lock is not None:
            run_lock.close()


def _train(cfg: RunConfig, *, run_dir: Path, plan: Plan | None, resume: bool, overwrite: bool,
           hooks: TrainHooks | None, progress: bool, log: Callable[[str], None] | None,
           clock: Callable[[], float]) -> dict:
    """`train`'s body, under the run directory's lock."""
    from tqdm import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    hooks = hooks or TrainHooks()
    t_start = time.perf_counter()
    prepare_run_dir(run_dir, resume=resume, overwrite=overwrite,
                    clear=int(os.environ.get("RANK", "0")) == 0)
    from lazytrain.dist.process_group import env_world_size
    if env_world_size() > 1:  # started by torchrun: one rank of a data-parallel job
        from lazytrain.dist import trainer as dp
        trainer, log, main = dp.start(cfg, run_dir=run_dir, plan=plan, resume=resume,
                                      hooks=hooks or TrainHooks(), log=log)
        progress = progress and main
    else:
        if cfg.dist.nproc_per_node > 1 or cfg.dist.nnodes > 1:  # one process holds it all
            log(f"note: not started by torchrun: one process plans the whole node "
                f"(dist.nproc_per_node {cfg.dist.nproc_per_node} -> 1, dist.nnodes "
                f"{cfg.dist.nnodes} -> 1)")
            cfg = apply_overrides(cfg, ["dist.nproc_per_node=1", "dist.nnodes=1"])
        trainer = Trainer(cfg, run_dir=run_dir, plan=plan, resume=resume,
                          hooks=hooks or TrainHooks(), log=log)
    cfg = trainer.cfg  # train.epochs resolved to train.steps
    stopped_by, records, saved = None, [], None
    timings = {"setup_s": time.perf_counter() - t_start}
    try:
        mark = time.perf_counter()
        before = trainer.evaluate()
        timings["eval_before_s"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if before is not None:
            log(_eval_line("before", before, seq_len=cfg.data.seq_len))
            for line in sample_lines("before", before):  # learning a person can see
                log(line)
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, file=sys.stderr,
                   disable=not progress, desc="train", unit="step")
        last_save = clock()
        with stop_flag() as stop:
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
                if trainer.world_size > 1 and cfg.train.checkpoint_every_min:
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
        mark = time.perf_counter()
        after = trainer.evaluate() if stopped_by is None else None
        timings["eval_after_s"] = time.perf_counter() - mark
        if after is not None:
            log(_eval_line("after", after, seq_len=cfg.data.seq_len))
            for line in sample_lines("after", after):  # learning a person can see
                log(line)
        summary = _summary(trainer, records=records, before=before, after=after, saved=saved,
                           stopped_by=stopped_by, wall_s=time.perf_counter() - t_start)
        summary["timings_s"] = timings
        if trainer.is_main:  # data parallel: rank 0 writes the run's files
            setup.write_json_atomic(run_dir / "summary.json", summary)
        return summary
    finally:
        trainer.close()


def _eval_line(when: str, result, *, seq_len: int) -> str:
    """"eval before: loss 1.2345, exact match 0.25"; a loss of None (no held-out example keeps
    a trained token within seq_len) is said in words, with the fix."""
    loss = (f"{result.loss:.4f}" if result.loss is not None else
            f"n/a (no held-out example keeps an answer token within data.seq_len={seq_len}; "
            f"raise data.seq_len)")
    match = (f"{result.exact_match} ({result.num_correct}/{result.num_scored})"
             if result.exact_match is not None else "n/a (no checkable answers)")
    return f"eval {when}: loss {loss}, exact match {match}"


def _summary(trainer: Trainer, *, records, before, after, saved, stopped_by, wall_s) -> dict:
    from lazytrain.runtime.calibrate import costs_line_of

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
    }
