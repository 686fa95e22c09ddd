"""The streaming engine: one training step that executes a Plan on a `ModelAdapter`.

Owns the schedule of one step: forward over blocks, head and loss in sequence chunks, backward
per segment in reverse (recompute, re-forward, backward), gradient drain to the host store, and
handing per-block AdamW updates to the optimizer worker. It decides nothing: boundary tiers,
segments, kept blocks, resident weights and every transfer's window come from the Plan
(docs/execution_model.md is the contract). Every boundary byte moves through the
`ActivationStore`; weights and gradients move through `runtime.streams`; the embedding, final
norm, head and their gradient (resident for the step) through `runtime.ends`.

Windows per micro-batch: `pre` (embedding; block 0's weight load and the step's ends load in the
first micro-batch's), f0..f{L-1}, turn, b{L-1}..b0, `post` (embedding backward; the next
micro-batch's block 0 load; the ends gradient, accumulated on the device, drains once, in the
last micro-batch's). Gradient
accumulation repeats them per micro-batch; the loss is normalised by the label tokens of the
whole step so that accumulation equals the big-batch gradient.

Dropout: the RNG state is saved before each block's forward and replayed by the recompute and
the re-forward (`runtime.block_autograd`), so both see the same masks as the forward.

Legend: B = micro-batch, S = sequence length, H = hidden size, L = number of blocks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, suppress

import torch

from lazytrain.contract import TRANSFER_ORDER, TURN_WINDOW, backward_window, forward_window
from lazytrain.models.adapter import ModelAdapter
from lazytrain.planner.budgets import plan_budgets
from lazytrain.planner.plan import Plan
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.block_autograd import flat_grad, replay_rng, rng_state
from lazytrain.runtime.engine_config import COMPUTE_DTYPES, EngineSettings, StepStats
from lazytrain.runtime.ends import ResidentEnds
from lazytrain.runtime.instrument import Instrument
from lazytrain.runtime.levels import BlockLevels
from lazytrain.runtime.micro_batch import (MicroBatch, check_planned_shape, label_tokens,
                                           prepare_micro_batch)
from lazytrain.runtime.optim import BlockOptimizer, clip_scale, global_grad_norm
from lazytrain.runtime.saved_store import SavedStore
from lazytrain.runtime.streams import DeviceWeights, GradDrain, WindowMeter


class Engine:
    """Executes a Plan, step by step, on one device (`runtime.build.make_engine` builds one).

    Args:
        adapter: the model (weights in `adapter.params`: fp32 or bf16 masters and gradients;
            bf16 masters are upcast to the compute dtype on load and stepped through the
            optimizer's fp32 scratch, `runtime/optim.py`).
        plan: the Plan; refused (PlanValidationError) if its provenance names another model,
            and at the first step another seq_len or micro_batch.
        store: the activation store; its device (`store.dev`, `runtime/device.py`) is the
            engine's: every stream, event, copy and allocation goes through it.
        optimizer: `BlockOptimizer` or one with its interface (data parallel:
            `lazytrain.dist.sharding.ShardedOptimizer`), bound to the device here.
        grad_sync: data parallel hook (`lazytrain.dist.reducer.GradReducer`): `all_sum(x)` sums a
            float over ranks (label tokens, loss), `grads_final(group)` starts the cross-rank
            reduction of a group once its host gradient is final (last micro-batch), and
            `global_grad_norm()` replaces the local norm. None: one process.
        settings: dtype, learning rate, clipping, accumulation, seed, chunking, instrumentation,
            budgets and the expected model hash (`EngineSettings`).
        owns_device: `close` also closes the device (the factory made it from a name).

    Raises:
        ValueError: a plan with another number of blocks.
        PlanValidationError: a plan of another model.
    """

    def __init__(self, adapter: ModelAdapter, plan: Plan, *, store: ActivationStore,
                 optimizer: BlockOptimizer, grad_sync=None, settings: EngineSettings,
                 owns_device: bool = False) -> None:
        if plan.num_blocks != adapter.num_blocks:
            raise ValueError(f"plan has {plan.num_blocks} blocks, model has {adapter.num_blocks}")
        plan.check_matches(
            model_config_sha256=settings.model_config_sha256 or adapter.hf_config_sha256)
        torch.manual_seed(settings.seed)
        self.adapter, self.plan, self.L = adapter, plan, plan.num_blocks
        self._owns_device = owns_device
        self.dev = store.dev
        self.device = self.dev.torch_device
        self.dtype = COMPUTE_DTYPES[settings.compute_dtype]
        self.params = adapter.params
        for g in self.params.groups:  # host DRAM: the checker logs their accesses as host work
            self.dev.host_tensor(g.master, name=f"{g.name} master")
            self.dev.host_tensor(g.grad, name=f"{g.name} gradient accumulator")
        self.weights = DeviceWeights(self.params, self.dev, self.dtype)
        self.ends = ResidentEnds(adapter, self.dev, dtype=self.dtype,
                                 head_chunk_tokens=settings.head_chunk_tokens)
        self.ledger = self.dev.ledger
        self.budgets = settings.budgets
        # compute allocations in the ledger (a dispatch mode on the CPU backends) when they are
        # checked or reported: budgets on, or instrumented (windows.jsonl carries the ledger)
        self.track_compute = settings.budgets or settings.instrument
        if settings.budgets:
            self._set_budgets(plan)
        self.drain = GradDrain(self.dev, self.params.max_block_numel(), dtype=self.dtype,
                               land_all=settings.grad_accum == 1)
        self.meter = WindowMeter(self.dev)
        self.store = store
        self.optimizer = optimizer
        self.optimizer.bind_device(self.dev)
        if grad_sync is not None and hasattr(grad_sync, "bind_device"):
            grad_sync.bind_device(self.dev)  # its async reductions, declared to the checker
        self.optimizer.set_q8_blocks(plan.q8_blocks)  # the plan's 8-bit Adam states
        self.weights.set_paths(plan.weight_paths, self.optimizer)  # how weights reach the device
        self.grad_sync = grad_sync
        self.lr = settings.lr
        self.clip = settings.clip_grad_norm or None
        self.grad_accum = settings.grad_accum
        self.resident = set(plan.resident_weights) | set(plan.keep_internals)
        self.keep = set(plan.keep_internals)
        self.saved = SavedStore(self.dev)  # L1/L2 blocks' saved internals (runtime/levels.py)
        self.levels = BlockLevels(self)
        self.instrument: Instrument | None = None
        if settings.instrument:
            self.instrument = Instrument(device=self.dev, store=self.store, plan=plan)
            self.instrument.attach(self)

    def set_plan(self, plan: Plan) -> None:
        """Run `plan` from the next step on (online re-planning; call between steps only).

        Plans change placement, never the math: weights, RNG and data position are untouched;
        optimizer moments are kept, re-quantized or de-quantized when a block enters or leaves
        the plan's `q8_blocks`; with budgets on, the ledger's limits become the new plan's
        (`plan_budgets`). The new plan must match the model (provenance) and, once the
        first step has run, the batch shape it checked.

        Raises:
            PlanValidationError: another model / seq_len / micro_batch.
            ValueError: another number of blocks.
            RuntimeError: called while the store still holds boundaries (inside a step).
        """
        if plan.num_blocks != self.L:
            raise ValueError(f"plan has {plan.num_blocks} blocks, model has {self.L}")
        plan.check_matches(model_config_sha256=self.plan.provenance.get("model_config_sha256")
                           or self.adapter.hf_config_sha256)
        shape = {k: self.plan.provenance.get(k) for k in ("seq_len", "micro_batch")}
        plan.check_matches(**{k: v for k, v in shape.items() if v is not None})
        if self.store.stored():
            raise RuntimeError("set_plan inside a step: the store still holds "
                               f"{len(self.store.stored())} boundaries")
        self.plan = plan
        self.resident = set(plan.resident_weights) | set(plan.keep_internals)
        self.keep = set(plan.keep_internals)
        self.levels.set_plan(plan)
        if self.budgets:  # its 8-bit blocks change the pageable host states, so the pinned room
            self._set_budgets(plan)
        self.optimizer.set_q8_blocks(plan.q8_blocks)  # converts moments of blocks that change
        self.weights.set_paths(plan.weight_paths, self.optimizer)
        # the store's per-window HBM limits come from the plan (constructor argument)
        self.store.set_hbm_limits({w.name: w.hbm_checkpoint_bytes for w in plan.windows})
        if self.instrument is not None:
            self.instrument.set_plan(plan)

    # --- the step ------------------------------------------------------------------------------

    def step(self, micro_batches: list[dict], lr: float | None = None) -> StepStats:
        """One optimizer step over `micro_batches` (len == grad_accum).

        Reads as: per micro-batch forward_blocks, head_and_loss, backward_segments; then
        queue_optimizer. Updates run on the worker thread and overlap the next step's
        forward (block j's next weight load waits for block j's update).
        """
        t0 = time.perf_counter()
        lr = self.lr if lr is None else lr
        early = self.clip is None  # without clipping a block steps once its grads are final
        with self.dev.compute_scope(allocations=self.track_compute):
            loss, tokens = self._run(micro_batches, step_lr=lr if early else None)
            grad_norm = self.queue_optimizer(lr)
        return self._stats(loss, tokens, time.perf_counter() - t0, lr, grad_norm)

    def compute_gradients(self, micro_batches: list[dict]) -> float:
        """Forward + backward only; the gradients are left in the host store (master dtype).
        Returns the loss."""
        with self.dev.compute_scope(allocations=self.track_compute):
            loss, _ = self._run(micro_batches, step_lr=None)
        return loss

    def _run(self, micro_batches: list[dict], *, step_lr: float | None) -> tuple[float, int]:
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"got {len(micro_batches)} micro-batches; grad_accum is "
                             f"{self.grad_accum}")
        self.store.reset_peaks()
        self.saved.reset()
        self.ledger.reset()
        self.meter.reset()
        if self.instrument is not None:
            self.instrument.begin_step()  # also: this thread's waits are the engine's
        # label tokens and the objective's normaliser (SFT: the same label tokens) from the
        # host batches, before their H2D (no device sync)
        tokens = sum(label_tokens(b) for b in micro_batches)
        scale = sum(self.ends.objective.denominator(b) for b in micro_batches)
        mbs = [self._prepare(m, b) for m, b in enumerate(micro_batches)]
        if self.grad_sync is not None:  # normalise by the global batch's label tokens
            tokens = int(self.grad_sync.all_sum(tokens))
            scale = type(scale)(self.grad_sync.all_sum(scale))
        loss = 0.0  # a device tensor after the first micro-batch: read once, at the step's end
        try:
            for mb in mbs:
                if self.instrument is not None:
                    self.instrument.begin_micro_batch(mb.index)
                final = mb.index == len(mbs) - 1
                with self.dev.sync_audit("micro_batch"):
                    # boundary L and d loss / d boundary L are handed from call to call, never
                    # held by a local here: the plan stops counting them after turn and b{L-1}
                    loss_mb, *grad = self.head_and_loss(mb, self.forward_blocks(mb), scale)
                    self.backward_segments(mb, grad.pop(), step_lr=step_lr if final else None,
                                           next_mb=None if final else mbs[mb.index + 1])
                    mb.kwargs = []  # its masks and rotary tables (the plan counts one mb's)
                    loss = loss + loss_mb
        except BaseException:
            self._release_weights(mbs)  # a failed step gives its weight slots back
            raise
        self.drain.flush()
        with self.dev.sync_audit("step_end"):
            loss = float(loss)  # the step's one explicit sync for the loss
        if self.grad_sync is not None:
            loss = self.grad_sync.all_sum(loss)
        return loss, tokens

    def forward_blocks(self, mb: MicroBatch) -> torch.Tensor:
        """pre + f0..f{L-1}: returns boundary L [B, S, H] (not yet stored)."""
        with self._timed_window("pre"):
            self.ends.reset_gradient(first=mb.index == 0)  # accumulated over the step
            if mb.index == 0:  # the step's one ends load, queued after the zeroing above
                self.optimizer.wait(self.params.ends)  # the ends' pending update
                self.ends.load(self.weights)
            h = self.ends.embed(mb.input_ids)
            mb.kwargs = self.adapter.block_kwargs(mb.input_ids, h, **mb.mask_inputs)
            if 0 not in mb.weights:  # else the previous micro-batch's post loaded it
                mb.weights[0] = self.prefetch_weights(0)
                self.collect_load(mb, 0)
        for j in range(self.L):
            with self.window(forward_window(j)):
                if self.plan.is_materialized(j):
                    self.store.put(j, h, self.plan.tiers[j], micro_batch=mb.index)  # produced
                self.issue_transfers(forward_window(j), mb)
                h = self.run_forward(mb, j, h)  # queued first; the host waits come after it
                self.issue_transfers(forward_window(j), mb, after_compute=True)
                if j + 1 < self.L:
                    mb.weights[j + 1] = self.prefetch_weights(j + 1)  # waits for its update
                    self.collect_load(mb, j + 1)
                if j not in self.resident:
                    self.weights.release(mb.weights.pop(j))
        return h

    def head_and_loss(self, mb: MicroBatch, h: torch.Tensor, tokens: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """turn: final norm, LM head and loss in sequence chunks, and their backward; `tokens`
        is the step's normaliser of the ends' objective (SFT: label tokens).

        Returns:
            (this micro-batch's share of the step loss, a 0-dim fp32 device tensor,
            d loss / d boundary L [B, S, H]).
        """
        L = self.L
        with self.window(TURN_WINDOW):
            self.store.put(L, h, "hbm", micro_batch=mb.index)
            self.issue_transfers(TURN_WINDOW, mb)
            if L - 1 not in self.resident:
                mb.weights[L - 1] = self.prefetch_weights(L - 1)
            with self._owner("head and loss"):
                loss, grad = self.ends.head_and_loss(self.store.get(L, micro_batch=mb.index),
                                                     mb.targets, tokens, extras=mb.extras)
            self.store.release(L, micro_batch=mb.index)
            self.issue_transfers(TURN_WINDOW, mb, after_compute=True)
            self.collect_load(mb, L - 1)
        if mb.aux is not None:
            loss += mb.aux.loss()  # HF: loss += coef * aux (every block has run forward)
        return loss, grad

    def backward_segments(self, mb: MicroBatch, grad: torch.Tensor, *,
                          step_lr: float | None, next_mb: MicroBatch | None = None) -> None:
        """b{L-1}..b0 segment by segment (last first), then the embedding backward (post).

        `step_lr` set: the last micro-batch of a step without clipping; each block's update is
        queued as soon as its gradient is in the host accumulator. Block j+1's gradient drains
        in window b{j} (while block j computes) and block 0's in post, as the plan counts them.
        `next_mb` (the step's next micro-batch, if any): post then also starts the H2D of its
        block 0, after the embedding backward is queued, so that its `pre` waits for nothing
        (docs/execution_model.md, "Step time": block 0's weights do not change within a step).
        """
        for s, e in self.plan.segments_backward():
            for j in range(e - 1, s - 1, -1):
                with self.window(backward_window(j)):
                    if mb.pending_drain is not None:
                        self.drain_gradients(mb)  # block j+1's
                    self.issue_transfers(backward_window(j), mb)
                    if j >= 1 and j - 1 not in self.resident:
                        mb.weights[j - 1] = self.prefetch_weights(j - 1)
                    if j == e - 1:
                        self.recompute_segment(mb, s, e)
                    grad = self.backward_block(mb, j, grad, step_lr=step_lr)
                    self.issue_transfers(backward_window(j), mb, after_compute=True)
                    self.store.release(j, micro_batch=mb.index)
                    self.weights.release(mb.weights.pop(j))
                    self.collect_load(mb, j - 1)
                    self.drain.make_room()  # the next window's drain finds a landing buffer
        with self._timed_window("post"):
            self.drain_gradients(mb)  # block 0's
            self.ends.embed_backward(mb.input_ids, grad)
            if next_mb is not None:  # its block 0, beside block 0's drain
                next_mb.weights[0] = self.prefetch_weights(0)
                self.collect_load(next_mb, 0)
            if mb.index == self.grad_accum - 1:  # the ends gradient: one D2H per step
                self.ends.drain_gradient(
                    self.drain, on_done=self._on_grads_final(self.params.ends, step_lr))

    def queue_optimizer(self, lr: float) -> float | None:
        """With clipping: the exact global norm is known now (every gradient is final), so
        queue the ends and then blocks 0, 1, ... (the next step needs them in that order).
        Without clipping the updates were queued during backward. Returns the norm or None."""
        if self.clip is None:
            return None
        norm = (global_grad_norm(self.params) if self.grad_sync is None
                else self.grad_sync.global_grad_norm())
        scale = clip_scale(norm, self.clip)
        self.optimizer.submit(self.params.ends, lr=lr, grad_scale=scale)
        for j in range(self.L):
            self.optimizer.submit(self.params.blocks[j], lr=lr, grad_scale=scale)
        return norm

    # --- phase verbs ---------------------------------------------------------------------------

    def prefetch_weights(self, j: int):
        """Start block j's H2D after its pending optimizer update (sync point with the worker)."""
        group = self.params.blocks[j]
        self.optimizer.wait(group)
        return self.weights.load(group, j, resident=j in self.resident)

    def collect_load(self, mb: MicroBatch, j: int) -> None:
        """Wait for the host job that queues block j's H2D (`DeviceWeights.event_of`) at the
        end of the window that started the load, after that window's compute is queued, so
        the window that uses the weights starts by queueing its kernels."""
        if j in mb.weights:
            self.weights.event_of(mb.weights[j])

    def issue_transfers(self, window: str, mb: MicroBatch, *, after_compute: bool = False
                        ) -> None:
        """The transfers the plan names for `window`, kinds in the store's required order.

        Before the window's compute: the h2d of dram boundaries (no host wait). After it
        (`after_compute`): the rest, whose host waits would come before the kernels: a d2h
        may wait for a pool buffer (it waits on the device for the compute before its
        boundary's put only), an nvme_read for its write, an nvme boundary's h2d for its read,
        and an h2d chained to another transfer of its boundary in the window (their h2d
        buffers are allocated before the compute, `ActivationStore.reserve_h2d`); a prefetch
        is never used in its own window."""
        self.levels.issue(window, mb, after_compute=after_compute)  # saved internals
        transfers = sorted(self.plan.transfers_in(window), key=lambda t: TRANSFER_ORDER.index(t.kind))
        chained = {t.boundary for t in transfers if t.kind != "h2d"}
        for t in transfers:
            waits = (t.kind != "h2d" or self.plan.tiers[t.boundary] == "nvme"
                     or t.boundary in chained)
            if waits == after_compute:
                self.store.transfer(t.boundary, t.kind, t.fraction, micro_batch=mb.index)
            elif t.kind == "h2d":
                self.store.reserve_h2d(t.boundary, micro_batch=mb.index)

    def run_forward(self, mb: MicroBatch, j: int, h: torch.Tensor) -> torch.Tensor:
        """Block j's forward; a kept or L1/L2 block runs with autograd (`runtime/levels.py`)
        and keeps its graph or its saved internals until b{j}."""
        mb.rng[j] = rng_state(self.device, is_cuda=self.dev.is_cuda)
        flat = self.weights.ready(mb.weights[j])
        logits = None if mb.aux is None else []  # router logits, counted once per forward
        if j in self.keep or self.levels.saves(j):
            out = self.levels.forward(mb, j, h, flat, logits)
        else:
            with torch.no_grad(), self._owner(f"block {j} forward"):
                out = self._block(mb, j, h, flat, router_logits=logits)
        if mb.aux is not None:
            mb.aux.observe(logits)
        return out

    def recompute_segment(self, mb: MicroBatch, s: int, e: int) -> None:
        """Blocks s..e-2 without autograd from boundary s; outputs go to the recompute cache."""
        if s == 0 and self.plan.tiers[0] == "recompute":
            self.store.put(0, self.ends.embed(mb.input_ids), "recompute",
                           micro_batch=mb.index)  # re-embedded
        h = self.store.get(s, micro_batch=mb.index)
        load = lambda k: mb.weights[k] if k in self.resident else self.prefetch_weights(k)
        upcoming = load(s) if s < e - 1 else None
        for k in range(s, e - 1):
            handle = upcoming
            if k + 1 < e - 1:
                upcoming = load(k + 1)  # block k+1 loads while block k recomputes (4th slot)
            replay = replay_rng(mb.rng[k], self.device, is_cuda=self.dev.is_cuda)
            with torch.no_grad(), replay, self._owner(f"recompute of block {k}"):
                h = self._block(mb, k, h, self.weights.ready(handle))
            if k not in self.resident:
                self.weights.release(handle)
            self.store.put(k + 1, h, "recompute", micro_batch=mb.index)

    def backward_block(self, mb: MicroBatch, j: int, grad: torch.Tensor, *,
                       step_lr: float | None) -> torch.Tensor:
        """Block j's backward as its level says (`runtime/levels.py`: kept graph, re-forward
        truncated or in full, saved internals); drain its grads.

        Returns:
            d loss / d boundary j [B, S, H].
        """
        with self._owner(f"block {j} backward"):
            return self._backward_block(mb, j, grad, step_lr=step_lr)

    def _backward_block(self, mb: MicroBatch, j: int, grad: torch.Tensor, *,
                        step_lr: float | None) -> torch.Tensor:
        grad_x, leaves, leaf_grads = self.levels.backward(mb, j, grad)
        group = self.params.blocks[j]
        grad_w = flat_grad(group, leaves, leaf_grads)
        self.optimizer.note_gradients(group, dict(zip(leaves, leaf_grads)), first=mb.index == 0)
        on_done = self._on_grads_final(group, step_lr) if mb.index == self.grad_accum - 1 else None
        mb.pending_drain = (group, grad_w, on_done)  # drained in the next window
        return grad_x

    def drain_gradients(self, mb: MicroBatch) -> None:
        """Start the D2H of the last backward block's gradient (GradDrain)."""
        group, grad_w, on_done = mb.pending_drain
        mb.pending_drain = None
        self.drain.drain(group, grad_w, first=mb.index == 0, on_done=on_done)

    def _on_grads_final(self, group, step_lr: float | None):
        """Callback for the drain of `group`'s last micro-batch: start its cross-rank reduction
        (async; the group's update waits for it), then queue its update when `step_lr` is set
        (no clipping). None when neither applies."""
        if self.grad_sync is None and step_lr is None:
            return None

        def done() -> None:
            if self.grad_sync is not None:
                self.grad_sync.grads_final(group)
            if step_lr is not None:
                self.optimizer.submit(group, lr=step_lr)
        return done

    # --- helpers -------------------------------------------------------------------------------

    @contextmanager
    def window(self, name: str):
        """One plan window: store barrier semantics + the meter. On an error inside it (an
        NVMe fault, a budget check) the window is closed and the step's stored boundaries are
        released before the error propagates, so the engine can run another step."""
        self.store.begin_window(name)
        self.saved.begin_window(name)
        try:
            with self._timed_window(name):
                yield
                self.store.end_window()
                self.saved.end_window()
        except BaseException:
            self._abandon_step()
            raise

    def _release_weights(self, mbs: list[MicroBatch]) -> None:
        """Return every weight slot a failed step still holds (after its conversion job, whose
        error is dropped: the step's first error propagates)."""
        for mb in mbs:
            for handle in mb.weights.values():
                with suppress(BaseException):
                    self.weights.release(handle)
            mb.weights.clear()

    def _set_budgets(self, plan: Plan) -> None:
        """The ledger's hard limits: the HBM and pinned bytes `plan` was made to fit."""
        hbm, pinned = plan_budgets(plan)
        self.ledger.set_limits(hbm_limits=None if hbm is None else {"*": hbm},
                               pinned_limit_bytes=pinned)

    def _abandon_step(self) -> None:
        """Close the store's open window (waiting for its I/O) and release every stored
        boundary of the failed step; secondary errors are dropped (the first one propagates)."""
        with suppress(Exception):  # RuntimeError when end_window already closed it
            self.store.end_window()
        for boundary, micro_batch in self.store.stored():
            with suppress(Exception):
                self.store.release(boundary, micro_batch=micro_batch)
        with suppress(Exception):
            self.levels.abandon()  # the saved internals it left

    @contextmanager
    def _timed_window(self, name: str):
        """The meter, the ledger's window and the instrument when on, around one window (its
        barrier included)."""
        self.ledger.begin_window(name)
        try:
            with self.meter.window(name):
                if self.instrument is None:
                    yield
                else:
                    with self.instrument.window(name):
                        yield
        finally:
            self.ledger.end_window()

    @contextmanager
    def _owner(self, owner: str):
        """Book the compute allocations made inside to `owner` (the ledger's compute owner)."""
        prev, self.ledger.compute_owner = self.ledger.compute_owner, owner
        try:
            yield
        finally:
            self.ledger.compute_owner = prev

    def _block(self, mb: MicroBatch, j: int, h: torch.Tensor, flat: torch.Tensor, *,
               router_logits: list | None = None) -> torch.Tensor:
        return self.adapter.forward_block(j, h, self.params.blocks[j].views(flat), mb.kwargs[j],
                                          router_logits=router_logits)

    def _prepare(self, m: int, batch: dict) -> MicroBatch:
        """Micro-batch m on the device, within the plan's shape (`check_planned_shape`)."""
        check_planned_shape(m, batch, self.plan.provenance)
        return prepare_micro_batch(m, batch, adapter=self.adapter, dev=self.dev,
                                   extra_keys=tuple(self.ends.objective.extra_keys))

    def _stats(self, loss: float, tokens: int, step_s: float, lr: float,
               grad_norm: float | None) -> StepStats:
        peaks: dict[str, int] = {}
        for p in self.store.peak_by_window().values():
            for k, v in p.items():
                peaks[k] = max(peaks.get(k, 0), v)
        windows = () if self.instrument is None else tuple(self.instrument.take_records())
        return StepStats(loss=loss, tokens=tokens, step_s=step_s, peak_bytes=peaks,
                         window_ms=self.meter.times_ms(), lr=lr, grad_norm=grad_norm,
                         windows=windows)

    # --- state ---------------------------------------------------------------------------------

    def gradients(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> accumulated gradient (views in the master dtype, fp32 or bf16;
        tied head not repeated)."""
        self.drain.flush()
        self._host_reads("gradient", "gradients()")
        return self.params.named_grads()

    def named_masters(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> master weight in the master dtype (views, no copy), after every
        queued update: what checkpoints save (bf16 masters are written as bf16) and the
        evaluation model loads (`load_state_dict` upcasts)."""
        self.optimizer.wait_all()
        self._host_reads("master", "named_masters()")
        return self.params.named_master()

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> fp32 master weight, after every queued update.

        fp32 masters: views of the masters (no copy). bf16 masters: fp32 copies (exact
        upcasts; 4 B per parameter of new host memory while the caller holds them), so
        checkpoints and the evaluation model read fp32 either way and a bf16 run resumes from
        them bit for bit (fp32 -> bf16 of an upcast value is exact).
        """
        self.optimizer.wait_all()
        self._host_reads("master", "named_parameters_fp32()")
        return {name: (t if t.dtype == torch.float32 else t.float())
                for name, t in self.params.named_master().items()}

    def _host_reads(self, what: str, caller: str) -> None:
        """Declare the calling thread's read of every group's `what` ("master" or "gradient")
        to the device API (`host_access`): the caller reads them next (a checkpoint save, the
        evaluation model), so `cpu-checked` checks that every update and accumulation writing
        them is ordered before it."""
        for g in self.params.groups:
            self.dev.host_access(g.master if what == "master" else g.grad, write=False,
                                 what=f"{what} read by {caller}")

    def state_dict(self) -> dict:
        """Optimizer states (per group) and RNG states; weights are saved by `save_hf_dir`."""
        rng = {"cpu": torch.get_rng_state()}
        if self.dev.is_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"optimizer": self.optimizer.state_dict(), "rng": rng}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if self.dev.is_cuda and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def close(self) -> None:
        """Finish queued updates, stop the worker, remove NVMe files, stop stream threads."""
        self.drain.close()
        self.weights.close()
        self.optimizer.close()
        self.saved.close()
        self.store.close()
        if self._owns_device:
            self.dev.close()
