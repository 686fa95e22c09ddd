"""One training run's state and its step: `Trainer(cfg, ctx, ...)` for one process and for every
rank of a data-parallel job alike; `train.loop.train` drives it.

The rank context `ctx` (`lazytrain.train.rank`) says what differs between ranks: the main rank
(rank 0, or the one process) plans and the others receive its plan; it alone logs, evaluates
and writes metrics.jsonl, the run's plan.json and the summary; every rank writes its own
windows.jsonl and plan.json under `ctx.subdir` ("" for one process: the run directory itself)
and keeps its NVMe files there. A step draws world_size x grad_accum micro-batches and trains
on this rank's share; metrics count the global batch. Checkpoints go through one protocol
(`checkpoint.save_checkpoint`, per-rank shards when there are several ranks); a resume needs
the same world size. A failed collective (a peer died, `dist.timeout_s` passed) becomes the
context's rank failure, naming the rank, the step and the last checkpoint. The engine is built
by `runtime.build.engine_from_config`, with the context's data-parallel parts.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from lazytrain.atomic import append_jsonl, read_jsonl, write_text_atomic
from lazytrain.config import RunConfig, apply_overrides, save_config
from lazytrain.data import build_data, real_token_count
from lazytrain.data.batching import steps_for_epochs
from lazytrain.models.families import text_model_config
from lazytrain.models.host_params import MASTER_DTYPES
from lazytrain.planner.build import rank_problem_from_config
from lazytrain.planner.plan import Plan
from lazytrain.planner.policy import planner_options
from lazytrain.profile.calibrate import config_for_plan
from lazytrain.runtime.build import device_type, engine_from_config, resolve_device
from lazytrain.runtime.instrument import write_windows_jsonl
from lazytrain.runtime.optim import lr_at, refit_note
from lazytrain.spec.model import ModelSpec
from lazytrain.train import checkpoint as ckpt
from lazytrain.train import checks, dpo_run, eval_plans, locks, model_source, setup
from lazytrain.train.dpo_run import DPORun, pairs_line, planning_config, preference_data
from lazytrain.train.evaluate import eval_line, evaluate_shared
from lazytrain.train.grpo import start_grpo
from lazytrain.train.plan_preflight import host_floor, run_preflight
from lazytrain.train.rank import RankContext
from lazytrain.train.replan import OnlineReplanner, resolve
from lazytrain.train.rundir import clear_run_dir, run_state_bytes
from lazytrain.train.tracking import Trackers, check_trackers, step_scalars


def step_record(step: int, stats, batches: list[dict], *, flops_params: float) -> dict:
    """The metrics.jsonl record of one optimizer step (single-process and data-parallel).

    Args:
        step: the step number just completed (1-based).
        stats: the engine's `StepStats`.
        batches: every micro-batch of the step (all ranks' under data parallelism), so tokens
            and model TFLOPS count the global batch; real tokens exclude padding.
        flops_params: N of the model-FLOPs rule 6 * N * tokens (ModelSpec.model_flops_params).
    """
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
    tc = cfg.train
    steps = steps_for_epochs(stream, epochs=tc.epochs,
                             micro_batches_per_step=tc.grad_accum * world_size)
    log(f"train.epochs={tc.epochs:g}: {steps} steps over {len(stream.examples)} training "
        f"samples (train.steps={tc.steps} is not used)")
    return apply_overrides(cfg, [f"train.steps={steps}"])


def stderr_log(msg: str) -> None:
    """The default `log` of a run: one line on stderr, flushed. The run's notes and results go
    through `log` (a caller may collect them); stdout carries the plan table only."""
    print(msg, file=sys.stderr, flush=True)


def _truncate_metrics(path: Path, *, last_step: int) -> None:
    """Drop metric lines after `last_step` (steps redone after a resume)."""
    if path.is_file():  # a crash mid-append may have torn the last line: read_jsonl skips it
        keep = [r for r in read_jsonl(path) if r["step"] <= last_step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


class Trainer:
    """One run on one rank: everything `train` sets up, and the step loop's actions over it."""

    def __init__(self, cfg: RunConfig, ctx: RankContext, *, run_dir: Path, plan: Plan | None,
                 resume: bool, hooks, log, overwrite: bool = False,
                 verify_checkpoint: bool = True) -> None:
        """Check, plan, load and build (module docstring); rank 0 plans, the others receive.

        Args:
            cfg: the run config (with this rank's share of the node: `rank.join_job`).
            ctx: the rank context (`lazytrain.train.rank`).
            run_dir: the run directory (created and locked by `train`).
            plan: a plan to use instead of planning; resume: continue from the newest
                checkpoint; hooks: `loop.TrainHooks`; log: one-line messages.
            overwrite: delete the run directory's previous run (`rundir.clear_run_dir`) once
                everything that can refuse the job has passed, before the first file is
                written.
            verify_checkpoint: on resume, check every checkpoint file against its xxh3 digest
                (False: sizes only, said in one line).

        Raises:
            as `loop.train`.
        """
        self.cfg, self.ctx, self.run_dir, self.hooks, self.log = cfg, ctx, run_dir, hooks, log
        self._failed = False
        self.device_kind = resolve_device(cfg.runtime.device)
        self.device = device_type(self.device_kind)  # "cpu" or "cuda"
        tracker_names = check_trackers(cfg.train.report_to)  # a missing extra fails first
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        # Everything that can reject the job runs before a file is written or a weight loaded.
        saved_state = self._check_resume(resume, verify=verify_checkpoint)
        checks.check_data_paths(cfg.data)
        locks.check_nvme_dir(cfg.runtime.nvme_dir)  # before a calibration times NVMe there
        # the host states fit, before a calibration builds the model (`plan_preflight`)
        host_floor(cfg, resumed_from=self.resumed_from.path if self.resumed_from else None)
        self.plan = self._agreed_plan(plan)
        if self.resumed_from is not None:
            source = model_source.ModelSource(directory=self.resumed_from.path, has_weights=True)
        else:  # after planning: a hub id downloads its weights here
            source = model_source.resolve_model_source(cfg.model.config_path, weights=True)
            # a cut download: refused before a file is touched
            model_source.check_weight_files(source)
        # the plan table is the run's result on stdout, as `lazytrain plan` prints it
        print(setup.plan_summary(self.plan, source=str(cfg.model.config_path)), flush=True)
        self.eval_plans = eval_plans.start_eval_plans(
            cfg, config_source=self.resumed_from.path if self.resumed_from else None,
            show=self.is_main, log=self.log)
        self.nvme_dir = locks.job_nvme_dir(cfg.runtime.nvme_dir, run_dir=run_dir)
        self._load_data(source, saved_state, overwrite=overwrite)
        # every check passed: the old run goes (--overwrite) and the new one's files come
        if ctx.is_main:
            if overwrite:
                clear_run_dir(run_dir)
            save_config(cfg, run_dir / "config.yaml")  # train.epochs as given
        ctx.barrier()  # the other ranks write only into a cleared run directory
        self._save_plan()
        eval_plans.save_eval_plans(self.eval_plans, self.run_dir / self.ctx.subdir)
        self.trackers = Trackers(tracker_names, run_dir=run_dir, config=cfg.to_dict())
        self.adapter = self._load_adapter(source)
        # one lock per job and node: local rank 0 takes it, the node's other ranks share the
        # dir; nodes lock their own file (the directory may be on a file system they share)
        if ctx.local_rank == 0:
            self._nvme_lock = locks.lock_nvme_dir(
                self.nvme_dir, node=f"node{ctx.node_rank}" if ctx.nnodes > 1 else "")
        try:
            self.engine = self._make_engine()
        except BaseException:
            self._release_nvme_lock()
            raise
        self.log(f"device: {self.device_kind} (runtime.device); nvme: {self.nvme_dir} "
                 f"({self.nvme_io_mode()} I/O)")
        self.replanner = self._make_replanner()
        # the objective on the head and, before step 1, the reference log-probs (dpo_run.py)
        self.dpo = DPORun(self) if cfg.train.method == "dpo" else None
        self.grpo = start_grpo(self) if cfg.train.method == "grpo" else None  # rollouts
        self.step = 0
        if saved_state is not None:
            self._restore(saved_state)

    def _check_resume(self, resume: bool, *, verify: bool) -> dict | None:
        """With `resume`: the newest checkpoint (`self.resumed_from`; with `verify` its files
        checked against their digests), checked against this job (world size, model, shapes);
        returns its trainer state. Else None.

        Raises:
            CheckpointError, ValueError: as `checkpoint.resume_checkpoint`, another world size,
                another model or shape.
        """
        self.resumed_from = (ckpt.resume_checkpoint(self.run_dir, verify=verify) if resume
                             else None)
        if self.resumed_from is None:
            return None
        if not verify:
            self.log(f"checkpoint {self.resumed_from.path}: file digests not checked "
                     f"(--no-verify-checkpoint): sizes only, a same-size corruption would pass")
        ckpt.check_world_size(self.resumed_from, world_size=self.ctx.world_size)
        state = self.resumed_from.load_state()  # weights_only: refuses code objects
        checks.check_same_model(self.cfg, state.get("config"), self.resumed_from.path)
        checks.check_same_shape(self.cfg, state.get("config"), self.resumed_from.path)
        self._own_state = self._agreed_shard(state)
        return state

    def _agreed_shard(self, state: dict) -> dict:
        """This rank's own state of the resumed checkpoint (`checkpoint.load_shard`), loaded
        before any work; every rank learns (one collective) whether another rank's shard was
        refused, so no rank evaluates or trains for a job that cannot resume.

        Raises:
            CheckpointError: this rank's shard is missing, damaged or holds code objects, or
                another rank's is (its own error names the file).
        """
        try:
            own, error = ckpt.load_shard(self.resumed_from, self.ctx, state=state), None
        except ckpt.CheckpointError as exc:
            own, error = None, exc
        refused = int(self.ctx.all_sum(0.0 if error is None else 1.0))
        if error is not None:
            raise error
        if refused:
            raise ckpt.CheckpointError(
                f"--resume: {refused} other rank(s) refused their shard of checkpoint "
                f"{self.resumed_from.path} (their error names the file); no rank trains")
        return own

    def _agreed_plan(self, plan: Plan | None) -> Plan:
        """The main rank's plan (`setup.plan_for_run`) on every rank: every rank runs one plan,
        even where a time-limited MILP would not be repeatable."""
        mine = None
        if self.ctx.is_main:
            mine = setup.plan_for_run(planning_config(self.cfg), self.run_dir, plan=plan,
                                      resuming=self.resumed_from is not None,
                                      log=self.log).to_dict()
        agreed = Plan.from_dict(self.ctx.broadcast_object(mine))
        self.ctx.barrier()
        return agreed

    def _load_data(self, source, saved_state: dict | None, *, overwrite: bool) -> None:
        """Preflight (`plan_preflight.run_preflight`; with `overwrite`, the previous run's
        bytes count as free in the run directory), then the tokenizer and the data (read,
        templated; on resume its saved position, which refuses other data or another seed);
        `train.epochs` becomes `train.steps` here (the same on every resume). Writes nothing
        and loads no weight."""
        cfg, tc = self.cfg, self.cfg.train
        hf_config = text_model_config(model_source.load_hf_config(source))  # a VLM trains its text
        spec = ModelSpec.from_hf_config(hf_config.to_dict())
        self.flops_params = spec.model_flops_params  # N of 6 * N * tokens
        run_preflight(cfg, self.plan, device=self.device, nvme_dir=self.nvme_dir,
                      run_dir=self.run_dir, num_params=spec.total_params,
                      freed_bytes=run_state_bytes(self.run_dir) if overwrite else 0,
                      saves=None if tc.epochs else tc.steps - (
                          self.resumed_from.step if self.resumed_from is not None else 0))
        self.tokenizer = model_source.load_tokenizer(
            source, vocab_size=hf_config.vocab_size,
            corpus=lambda: dpo_run.training_corpus(cfg, seed=tc.seed))
        read = preference_data if tc.method == "dpo" else build_data  # pairs: dpo_run.py
        self.data = read(cfg.data, self.tokenizer, micro_batch=tc.micro_batch, seed=tc.seed,
                         **({} if tc.method == "dpo" else {"hf_config": hf_config}))
        for note in self.data.notes:  # e.g. chatml chosen for a tokenizer without a template
            self.log(note)
        if tc.epochs:
            self.cfg = resolve_epochs(cfg, self.data.train, world_size=self.ctx.world_size,
                                      log=self.log)
        if saved_state is not None:
            self.data.train.load_state_dict(saved_state["data"])
        self.data.train.check_usable()  # no sample fits data.seq_len: refused before a write

    @property
    def is_main(self) -> bool:
        """Writes the run's files (metrics, summary, plan.json); logs and evaluates."""
        return self.ctx.is_main

    @property
    def world_size(self) -> int:
        """Ranks of this job."""
        return self.ctx.world_size

    @property
    def windows_path(self) -> Path:
        """This rank's windows.jsonl (`runtime/instrument.py` records)."""
        return self.run_dir / self.ctx.subdir / "windows.jsonl"

    def _save_plan(self) -> None:
        """The plan in this rank's directory and, on the main rank, the run's plan.json."""
        paths = {self.run_dir / self.ctx.subdir / "plan.json"}
        if self.is_main:
            paths.add(self.run_dir / "plan.json")
        for path in sorted(paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            self.plan.save(path)

    def _load_adapter(self, source):
        """The model with its weights in the host store (`model_source.load_adapter`; on resume the
        checkpoint's exact masters when it exported a narrower `model.dtype`); with
        `dist.shared_masters` and several ranks on the node the masters live in the node's
        shared mapping: local rank 0 writes them and the others wait for it."""
        tc, dc = self.cfg.train, self.cfg.dist
        store = self.ctx.master_store(shared=dc.shared_masters, shm_dir=dc.shm_dir)
        adapter = model_source.load_adapter(source, compute_dtype=tc.compute_dtype,
                                     master_dtype=tc.master_dtype, seed=tc.seed, **store)
        if self.resumed_from is not None and store.get("fills_masters", True):
            ckpt.load_masters(self.resumed_from, adapter.params)  # under a narrower model.dtype
        self.masters_shared = bool(store)
        if self.masters_shared:
            self.ctx.barrier()  # local rank 0 has written the node's masters
        return adapter

    def _make_engine(self):
        tc = self.cfg.train
        parts = self.ctx.engine_parts(self.adapter, lr=tc.lr,
                                      betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                                      weight_decay=tc.weight_decay,
                                      shared_masters=self.masters_shared)
        return engine_from_config(
            self.cfg, self.adapter, self.plan, device_kind=self.device_kind,
            device_index=self.ctx.device_index, nvme_dir=self.nvme_dir / self.ctx.subdir,
            seed=self.ctx.seed(tc.seed), fault_hook=self.hooks.fault_hook,
            model_config_sha256=model_source.model_config_sha256(self.adapter.config), **parts)

    def _restore(self, state: dict) -> None:
        own, self._own_state = self._own_state, None  # loaded and agreed on by `_check_resume`
        self.engine.load_state_dict(own["engine"])  # the data's position: `_load_data`
        self.step = int(state["step"])
        if self.grpo is not None:
            self.grpo.load_state_dict(state.get("grpo") or {})
        if self.is_main:
            _truncate_metrics(self.run_dir / "metrics.jsonl", last_step=self.step)
        _truncate_metrics(self.windows_path, last_step=self.step)
        self.log(f"resumed from {self.resumed_from.path} at step {self.step}")
        tc = self.cfg.train
        note = refit_note(step=self.step, old_total=((state.get("config") or {}).get("train")
                                                     or {}).get("steps", tc.steps),
                          new_total=tc.steps, base_lr=tc.lr, warmup_steps=tc.warmup_steps,
                          schedule=tc.schedule, min_lr_ratio=tc.min_lr_ratio)
        if note:  # --resume --steps N: the schedule follows the new total
            self.log(note)

    @contextmanager
    def _collective(self):
        """A failed collective inside (RuntimeError) becomes the context's rank failure
        (`RankContext.failure`); one process re-raises it as it is."""
        try:
            yield
        except RuntimeError as exc:
            last = ckpt.latest_checkpoint(self.run_dir)
            failure = self.ctx.failure(exc, step=self.step + 1,
                                       last_checkpoint=last.path if last else None)
            if failure is None:
                raise
            self._failed = True
            raise failure from exc

    # --- actions -------------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        tc = self.cfg.train
        return lr_at(step, base_lr=tc.lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps,
                     schedule=tc.schedule, min_lr_ratio=tc.min_lr_ratio)

    def train_step(self) -> dict:
        """One global step: this rank's share of world_size x grad_accum micro-batches; returns
        its metrics record (appended to metrics.jsonl by the main rank)."""
        tc = self.cfg.train
        batches = (self.grpo.batches(self.step).batches if self.grpo is not None else
                   [self.data.train.next_micro_batch()
                    for _ in range(tc.grad_accum * self.world_size)])
        mine = self.ctx.local_share(batches, grad_accum=tc.grad_accum)
        with self._collective():
            stats = self.engine.step(mine, lr=self.lr_at(self.step))
        self.step += 1
        record = {**step_record(self.step, stats, batches, flops_params=self.flops_params),
                  "world_size": self.world_size,
                  **(self.grpo.step_metrics() if self.grpo is not None else {})}
        if self.dpo is not None:
            record.update(self.dpo.step_metrics())  # the step's pairs: rewards, accuracy
        write_windows_jsonl(self.windows_path, step=self.step, records=stats.windows)
        if self.is_main:
            append_jsonl(self.run_dir / "metrics.jsonl", [record])
            self.track(record, stats)
        if self.cfg.planner.replan_every_steps:
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
        """Checkpoint the current step (weights after every queued update); every rank."""
        state = {"data": self.data.train.state_dict(), "step": self.step,
                 "config": self.cfg.to_dict()}
        if self.grpo is not None:  # mid rollout batch: the rollouts the next steps reuse
            state["grpo"] = self.grpo.state_dict(self.step)
        with self._collective():
            saved = ckpt.save_checkpoint(
                self.run_dir, step=self.step, weights=self.engine.named_masters(),
                hf_config=self.adapter.config, tokenizer=self.tokenizer, state=state,
                shard={"engine": self.engine.state_dict()}, ranks=self.ctx,
                export_dtype=MASTER_DTYPES[self.cfg.model.dtype],
                keep=self.cfg.train.keep_checkpoints, before_marker=self.hooks.before_marker)
        self.log(f"saved checkpoint {saved.path}")
        return saved

    def should_stop(self, flag: bool) -> bool:
        """Whether to stop after this step given the stop-signal flag: True when it is set on
        any rank (one collective; also used to agree on a wall-clock checkpoint, since the
        ranks' clocks differ)."""
        with self._collective():
            return self.ctx.all_sum(1.0 if flag else 0.0) > 0

    def evaluate(self):
        """Loss and exact match on the held-out examples with the current weights, through the
        engine's weight path (`eval_plans.heldout_lm`); every rank evaluates its share
        (`evaluate.evaluate_shared`). The main rank gets the result; None elsewhere or without
        held-out examples."""
        if not self.data.eval_examples:
            return None
        if self.eval_lm is None:
            self.eval_lm = eval_plans.heldout_lm(self.adapter, self.tokenizer, self.engine,
                                                 self.eval_plans)
        self.engine.named_masters()  # waits for every queued optimizer update
        # any sampling must not move the training RNG, or a resumed run's dropout would differ
        devices = [torch.cuda.current_device()] if self.device == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), self._collective():
                result = evaluate_shared(
                    self.eval_lm, list(self.data.eval_examples), rank=self.ctx.rank,
                    world_size=self.world_size, all_sum=self.ctx.all_sum,
                    seq_len=self.cfg.data.seq_len, data_format=self.data.format)
        finally:  # the device copies (ends, resident blocks) go before training resumes
            self.eval_lm.refresh()
        if self.dpo is not None and self.is_main:  # held-out pairs: rewards, accuracy, margin
            self.log(pairs_line(f"at step {self.step}", self.dpo.evaluate_pairs()))
        return result if self.is_main else None

    def evaluate_and_record(self, log) -> None:
        """A periodic evaluation (`train.eval_every`): its line in the log, an `"event":
        "eval"` record in metrics.jsonl and eval/* scalars for the trackers (rank 0)."""
        result = self.evaluate()
        if result is None or not self.is_main:
            return
        log(eval_line(f"at step {self.step}", result, seq_len=self.cfg.data.seq_len))
        record = {"step": self.step, "event": "eval", "eval_loss": result.loss,
                  "exact_match": result.exact_match, "num_correct": result.num_correct,
                  "num_scored": result.num_scored}
        append_jsonl(self.run_dir / "metrics.jsonl", [record])
        self.track_eval(result)

    def track_eval(self, result) -> None:
        """An evaluation's eval/loss and eval/exact_match to the trackers, at this step."""
        self.trackers.log(self.step, {f"eval/{k}": v for k, v in
                                      (("loss", result.loss), ("exact_match", result.exact_match))
                                      if v is not None})

    def _make_replanner(self):
        """The main rank's online re-planner when `planner.replan_every_steps` > 0
        (train/replan.py), fed with its measured windows; the other ranks get None and follow
        its switches (`_maybe_switch_plan`). Rank 0 stands for the node: the ranks run the
        same plan on links of the same kind."""
        pc = self.cfg.planner
        if not pc.replan_every_steps or not self.is_main:
            return None
        options = planner_options(pc)

        def solve(problem, current):
            return resolve(problem, current, options)

        # the plan's own costs (its calibration file), so a re-plan compares like with like
        problem = rank_problem_from_config(config_for_plan(self.cfg, self.plan.provenance))
        return OnlineReplanner(problem, self.plan,
                               every=pc.replan_every_steps, threshold=pc.drift_threshold,
                               patience=pc.drift_patience_steps, solve=solve, log=self.log)

    def _maybe_switch_plan(self, records) -> None:
        """At a step boundary (a collective with several ranks): the main rank's finished
        re-plan (if any) reaches every rank, which all run it from the next step on; the main
        rank logs the event to metrics.jsonl."""
        switch = self.replanner.after_step(self.step, records) if self.is_main else None
        box = None
        if switch is not None:
            box = (switch.plan.to_dict() if switch.event.get("switched") else None, switch.event)
        with self._collective():
            box = self.ctx.broadcast_object(box)
        if box is None:
            return
        plan_dict, event = box
        if plan_dict is not None:
            self.plan = Plan.from_dict(plan_dict)
            self.engine.set_plan(self.plan)
            self._save_plan()
        if self.is_main:
            append_jsonl(self.run_dir / "metrics.jsonl", [event])

    def close(self) -> None:
        """Finish the engine, the trackers and the re-planner, and leave the job. After a rank
        failure the engine's pending updates fail too (their broadcasts have no peer); that
        second error is not raised over the first."""
        failed_before = self._failed
        try:
            with self._collective():
                try:
                    if self.replanner is not None:
                        self.replanner.close()
                    self.trackers.close()
                    if self.grpo is not None:
                        self.grpo.close()  # the KL reference's copy and slots
                    if self.eval_lm is not None:
                        self.eval_lm.close()  # its weight slots and conversion worker
                    self.engine.close()
                    self.engine.dev.close()  # made by engine_from_config: its threads
                finally:
                    self._release_nvme_lock()  # after the store deleted its files
        except RuntimeError:
            if not failed_before:
                raise
        finally:
            if not self._failed:
                self.ctx.shutdown()

    _nvme_lock = None
    grpo = None  # the GRPO rollouts and objective (`grpo.start_grpo`) with train.method grpo
    eval_lm = None  # the evaluation's StreamedLM (`evaluate`), made at the first evaluation
    """The open lock file of this job's NVMe directory (`locks.lock_nvme_dir`), or None."""

    def _release_nvme_lock(self) -> None:
        if self._nvme_lock is not None:
            self._nvme_lock.close()
            self._nvme_lock = None

    def nvme_io_mode(self) -> str:
        """"O_DIRECT" or "buffered": how the NVMe tier's files are read and written here (the
        fallback to buffered I/O when the filesystem refuses O_DIRECT is silent otherwise)."""
        return "O_DIRECT" if self.engine.store.io.direct else "buffered"
