"""The training loop's data-parallel variant, used by `lazytrain.train.loop.train` when torchrun
started the process (WORLD_SIZE > 1).

What changes against one process (`lazytrain.train.loop.Trainer`):
- process groups from torchrun's environment (`process_group.init_from_env`, `dist.*` config);
- the plan: rank 0 plans one rank's share of the node (`launch_config` sets
  `dist.nproc_per_node` to torchrun's ranks per node; `planner.topology`), or loads the run's
  plan.json, and broadcasts it, so every rank runs the same plan even when a time-limited MILP
  would not be repeatable; each rank writes `RUN_DIR/rank-R/plan.json` and appends its
  measured windows to `RUN_DIR/rank-R/windows.jsonl` (`lazytrain.runtime.instrument` records);
  online re-planning runs on rank 0 and every rank switches with it at the same step;
- the masters: one copy per node in shared memory, written by local rank 0
  (`shared_masters`, `dist.shared_masters`), or one private copy per rank;
- the engine: `parallel.build_engine` (per-group reduction + ZeRO-1 sharded AdamW), seeded per
  rank (`rank_seed`: independent dropout masks);
- the data: every rank draws world_size x grad_accum micro-batches per step and keeps its share
  (`parallel.local_share`); metrics count the global batch;
- rank 0 alone logs, shows progress, writes metrics.jsonl and summary.json, and evaluates;
- checkpoints are sharded (`dist.checkpoint`); a resume needs the same world size;
- SIGTERM stops all ranks at the same step (the flag is max-reduced over ranks every step);
- a failed collective (a peer died, or `dist.timeout_s` passed) raises `RankFailureError` naming
  this rank and the step, on every surviving rank.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from lazytrain.dist import shared_masters
from lazytrain.dist.shared_masters import OwnerUpdateError
from lazytrain.dist.checkpoint import load_shard, save_sharded_checkpoint
from lazytrain.dist.parallel import build_engine, local_share
from lazytrain.dist.process_group import (DistContext, barrier, broadcast_object,
                                          init_from_env, shutdown)
from lazytrain.errors import JobFailure
from lazytrain.planner.plan import Plan
from lazytrain.train import checkpoint as ckpt
from lazytrain.train import setup
from lazytrain.train.loop import (Trainer, _device, device_type, _get_plan, _truncate_metrics,
                                   step_record)


def rank_seed(seed: int, rank: int) -> int:
    """The engine's RNG seed on `rank`: different per rank, so the ranks' micro-batches get
    independent dropout masks (one seed everywhere would repeat rank 0's masks on every rank).
    Rank 0 keeps `seed`. The model's initial weights use `seed` on every rank (equal masters)."""
    return seed + 1_000_003 * rank


class RankFailureError(JobFailure, RuntimeError):
    """A collective failed on this rank: a peer died or the collective timed out."""


class DataParallelTrainer(Trainer):
    """`Trainer` for one rank of a data-parallel job (module docstring)."""

    def __init__(self, cfg, *, run_dir: Path, plan: Plan | None, resume: bool, hooks, log,
                 ctx: DistContext) -> None:
        self.ctx = ctx
        self.is_main = ctx.is_main
        self.world_size = ctx.world_size
        self._failed = False
        self.windows_path = run_dir / f"rank-{ctx.rank}" / "windows.jsonl"
        quiet = contextlib.redirect_stdout(io.StringIO()) if not ctx.is_main \
            else contextlib.nullcontext()
        with quiet:
            super().__init__(cfg, run_dir=run_dir, plan=plan, resume=resume, hooks=hooks,
                             log=log)
        rank_dir = run_dir / f"rank-{ctx.rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        self.plan.save(rank_dir / "plan.json")

    def _load_adapter(self, source):
        """With `dist.shared_masters` and several ranks on the node: the masters live in the
        node's shared mapping, local rank 0 writes them and the others wait for it."""
        self.masters_shared = shared_masters.enabled(self.ctx, self.cfg.dist.shared_masters)
        if not self.masters_shared:
            return super()._load_adapter(source)
        tc = self.cfg.train
        adapter = setup.load_adapter(source, compute_dtype=tc.compute_dtype,
                                     master_dtype=tc.master_dtype, seed=tc.seed,
                                     **shared_masters.node_store(self.ctx,
                                                                 shm_dir=self.cfg.dist.shm_dir))
        barrier(self.ctx)  # local rank 0 has written the node's masters
        return adapter

    def _make_engine(self):
        tc = self.cfg.train
        from lazytrain.runtime.activations import CheckpointStore

        from lazytrain.runtime.device import make_device

        index = self.ctx.local_rank if self.device == "cuda" else None
        dev = make_device(self.device_kind, index=index, seed=rank_seed(tc.seed, self.ctx.rank))
        store = CheckpointStore(
            device=dev, nvme_dir=self.nvme_dir / f"rank-{self.ctx.rank}",
            io_threads=self.cfg.runtime.io_threads, fault_hook=self.hooks.fault_hook,
            hbm_limits={w.name: w.hbm_checkpoint_bytes for w in self.plan.windows})
        return build_engine(
            self.adapter, self.plan, ctx=self.ctx, lr=tc.lr,
            betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps, weight_decay=tc.weight_decay,
            device=dev, nvme_dir=self.nvme_dir / f"rank-{self.ctx.rank}",
            compute_dtype=tc.compute_dtype, clip_grad_norm=tc.clip_grad_norm or None,
            grad_accum=tc.grad_accum, seed=rank_seed(tc.seed, self.ctx.rank),
            io_threads=self.cfg.runtime.io_threads, shared_masters=self.masters_shared,
            model_config_sha256=setup.model_config_sha256(self.adapter.config), store=store,
            instrument=True, head_chunk_tokens=self.cfg.runtime.head_chunk_tokens, budgets=True)

    def _make_replanner(self):
        """Rank 0's online re-planner (`planner.replan_every_steps`), fed with rank 0's measured
        windows; the other ranks get None and follow rank 0's switches (`_maybe_switch_plan`).
        Rank 0 stands for the node: the ranks run the same plan on links of the same kind."""
        return super()._make_replanner() if self.is_main else None

    def _maybe_switch_plan(self, records) -> None:
        """Collective, every step with re-planning on: rank 0's finished re-plan (if any) is
        broadcast and every rank switches to it from the next step on, so all ranks always run
        one plan; rank 0 logs the event to metrics.jsonl."""
        switch = self.replanner.after_step(self.step, records) if self.is_main else None
        box = None
        if switch is not None:
            box = (switch.plan.to_dict() if switch.event.get("switched") else None, switch.event)
        try:
            box = broadcast_object(self.ctx, box)
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        if box is None:
            return
        plan_dict, event = box
        if plan_dict is not None:
            self.plan = Plan.from_dict(plan_dict)
            self.engine.set_plan(self.plan)
            self.plan.save(self.run_dir / f"rank-{self.ctx.rank}" / "plan.json")
            if self.is_main:
                self.plan.save(self.run_dir / "plan.json")
        if self.is_main:
            with open(self.run_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(event) + "\n")

    def _restore(self, state: dict) -> None:
        shard = load_shard(self.resumed_from, self.ctx)
        self.engine.load_state_dict(shard["engine"])
        self.data.train.load_state_dict(state["data"])
        self.step = int(state["step"])
        if self.is_main:
            _truncate_metrics(self.run_dir / "metrics.jsonl", last_step=self.step)
        _truncate_metrics(self.windows_path, last_step=self.step)
        self.log(f"resumed from {self.resumed_from.path} at step {self.step}")

    def train_step(self) -> dict:
        """One global step: this rank's share of world_size x grad_accum micro-batches."""
        tc = self.cfg.train
        batches = [self.data.train.next_micro_batch()
                   for _ in range(tc.grad_accum * self.ctx.world_size)]
        mine = local_share(batches, ctx=self.ctx, grad_accum=tc.grad_accum)
        try:
            stats = self.engine.step(mine, lr=self.lr_at(self.step))
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        self.step += 1
        record = {**step_record(self.step, stats, batches, flops_params=self.flops_params),
                  "world_size": self.ctx.world_size}
        from lazytrain.runtime.instrument import write_windows_jsonl
        write_windows_jsonl(self.windows_path, step=self.step, records=stats.windows)
        if self.is_main:
            with open(self.run_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            self.track(record, stats)
        if self.cfg.planner.replan_every_steps:
            self._maybe_switch_plan(stats.windows)
        if self.hooks.on_step_end is not None:
            self.hooks.on_step_end(self.step, stats)
        return record

    def should_stop(self, flag: bool) -> bool:
        """SIGTERM on any rank stops every rank after this step."""
        from lazytrain.dist.reducer import GradReducer

        try:
            return GradReducer.all_max_flag(self.ctx, flag)
        except RuntimeError as exc:
            raise self._failure(exc) from exc

    def save(self) -> ckpt.Checkpoint:
        state = {"data": self.data.train.state_dict(), "step": self.step,
                 "config": self.cfg.to_dict()}
        try:
            saved = save_sharded_checkpoint(
                self.run_dir, self.ctx, step=self.step,
                weights=self.engine.named_masters(), hf_config=self.adapter.config,
                tokenizer=self.tokenizer, state=state, shard={"engine": self.engine.state_dict()},
                before_marker=self.hooks.before_marker)
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        self.log(f"saved checkpoint {saved.path}")
        return saved

    def evaluate(self):
        return super().evaluate() if self.is_main else None

    def close(self) -> None:
        """Finish the engine and leave the job. After a failure the engine's pending updates
        fail too (their broadcasts have no peer); that second error is not raised over the
        first (`RankFailureError` stays the one the caller sees)."""
        try:
            super().close()
        except RuntimeError as exc:
            if not self._failed:
                raise self._failure(exc) from exc
        finally:
            if not self._failed:
                shutdown(self.ctx)

    def _failure(self, exc: BaseException) -> RankFailureError:
        self._failed = True
        last = ckpt.latest_checkpoint(self.run_dir)
        cause = ("another rank's optimizer step failed" if isinstance(exc, OwnerUpdateError)
                 else f"a collective failed (a peer rank died, or waited longer than "
                      f"dist.timeout_s={self.cfg.dist.timeout_s:g} s)")
        return RankFailureError(
            f"rank {self.ctx.rank} of {self.ctx.world_size}: {cause} at step "
            f"{self.step + 1}; the last complete checkpoint is "
            f"{last.path if last else 'none'}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}")


def launch_config(cfg, ctx: DistContext, log):
    """`cfg` with `dist.nproc_per_node` and `dist.nnodes` set to what torchrun started (and
    `hardware.gpus_per_node` raised to the ranks per node when the preset has fewer), so each
    rank's plan gets its real share of the node and of the job
    (`planner.build.rank_problem_from_config`)."""
    from lazytrain.config import apply_overrides
    from lazytrain.planner.build import hardware_from_config

    n = ctx.local_world_size
    sets = [] if cfg.dist.nproc_per_node == n else [f"dist.nproc_per_node={n}"]
    if cfg.dist.nnodes != ctx.nnodes:
        sets.append(f"dist.nnodes={ctx.nnodes}")
    if (cfg.hardware.gpus_per_node or hardware_from_config(cfg).gpus_per_node) < n:
        sets.append(f"hardware.gpus_per_node={n}")
    if not sets:
        return cfg
    log(f"note: torchrun started {ctx.nnodes} node(s) x {n} ranks; planning with "
        f"{', '.join(sets)}")
    return apply_overrides(cfg, sets)


def check_shared_run_dir(ctx: DistContext, run_dir: Path) -> None:
    """Collective: every rank must see rank 0's run directory (checkpoints are written there by
    all ranks, metrics by rank 0); on several hosts it must be on a shared file system.

    Raises:
        RuntimeError: on every rank, naming the ranks that do not see it and the fix.
    """
    import uuid

    token = broadcast_object(ctx, uuid.uuid4().hex if ctx.is_main else None)
    probe = run_dir / f".lazytrain-rank0-{token}"
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    barrier(ctx)
    try:
        seen = probe.is_file() and probe.read_text() == token
    except OSError:
        seen = False
    flags: list = [None] * ctx.world_size
    import torch.distributed as dist
    dist.all_gather_object(flags, (ctx.rank, ctx.node_rank, seen), group=ctx.grads_group)
    if ctx.is_main:
        probe.unlink(missing_ok=True)
    blind = [(r, n) for r, n, ok in flags if not ok]
    if blind:
        names = ", ".join(f"rank {r} (node {n})" for r, n in blind)
        raise RuntimeError(f"train.run_dir {run_dir} is not shared: {names} cannot see the file "
                           f"rank 0 wrote there; every rank writes its checkpoint shard into "
                           f"it, so on several hosts put it on a shared file system (NFS, "
                           f"Lustre) and pass the same path on every node")


def start(cfg, *, run_dir: Path, plan: Plan | None, resume: bool, hooks, log):
    """Join the job and build this rank's trainer (rank 0 plans, the others receive the plan).

    Returns:
        (trainer, log, progress_allowed): non-main ranks get a silent log and no progress bar.
    """
    device = device_type(_device(cfg.runtime.device))
    ctx = init_from_env(backend=cfg.dist.backend, device=device, timeout_s=cfg.dist.timeout_s)
    if not ctx.is_main:
        log = lambda msg: None  # noqa: E731  (rank-0 logging)
    cfg = launch_config(cfg, ctx, log)
    check_shared_run_dir(ctx, run_dir)
    resuming = resume and ckpt.latest_checkpoint(run_dir) is not None
    plan_dict = None
    if ctx.is_main:
        plan_dict = _get_plan(cfg, run_dir, plan=plan, resuming=resuming).to_dict()
    plan = Plan.from_dict(broadcast_object(ctx, plan_dict))
    barrier(ctx)
    trainer = DataParallelTrainer(cfg, run_dir=run_dir, plan=plan, resume=resume, hooks=hooks,
                                  log=log, ctx=ctx)
    return trainer, log, ctx.is_main
