"""GRPO steps: rollouts from the engine's current weights, rewards, advantages, old (and
reference) log-probs, and the micro-batches the engine trains on with `GRPOObjective`.

Per rollout batch (every `grpo.updates_per_rollout` steps; module `grpo_loss` has the loss):

1. prompts: `grpo.prompts_per_step` training examples, in an order shuffled once by
   `train.seed` and walked by step (a resumed run draws the same prompts);
2. rollouts: `grpo.n` completions of each through `StreamedLM.generate` over the live
   engine's masters and weight slots (the evaluation's model, `eval_plans.heldout_lm`: no
   second copy), sampled at `grpo.temperature` / `grpo.top_p` with seed `grpo.seed` + step;
3. rewards (`rewards.score` over `grpo.rewards`) and group-normalized advantages;
4. old log-probs: a forward-only pass of the same weights over prompt + completion
   (`StreamedLM.token_logprobs`); with `grpo.kl_coef` > 0, reference log-probs from a frozen
   copy of the initial weights in the compute dtype in host DRAM (`ReferenceModel`);
5. `train.grad_accum` micro-batches of at most `train.micro_batch` rows: prompt + completion
   cut at `data.seq_len`, labels on the completion only, right-padded to the micro-batch's
   longest row, with `advantages` [B], `old_logp` [B, W] (and `ref_logp`) aligned with the
   shifted targets. With `grpo.skip_flat_groups` (and no KL term) the rollouts of a group
   whose rewards are all equal are left out: their advantage is 0, so their gradient is 0,
   and training them would only cost time (`micro_batches`).

Knows nothing about plans or windows; the trainer hands the batches to `Engine.step`.

Legend: B = rows of a micro-batch, S = `data.seq_len`, W <= S its width, P = prompts per step,
n = group size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from lazytrain.config import RunConfig
from lazytrain.config.grpo import check_grpo_rows
from lazytrain.data import IGNORE_INDEX, Example, encode_prompt
from lazytrain.evaluation.streamed_lm import StreamedLM
from lazytrain.models.adapter import ModelAdapter
from lazytrain.models.host_params import HostParams
from lazytrain.planner.grpo_phase import grpo_summary_lines
from lazytrain.runtime.micro_batch import FILLER
from lazytrain.train import eval_plans, model_source
from lazytrain.train.grpo_loss import GRPOObjective, group_advantages
from lazytrain.train.rewards import exact_match, load_reward, score

COMPUTE_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
"""Compute dtype -> the `HostParams` master dtype name of the reference copy."""


def check_grpo_config(cfg: RunConfig, *, world_size: int = 1) -> None:
    """The cross-section rules of a GRPO run, each one error naming the keys and the fix.

    Raises:
        ValueError: prompts_per_step x n != micro_batch x grad_accum, several ranks, packing
            on, online re-planning on (`planner.replan_every_steps`: the cut micro-batches'
            windows hold less work than the plan's shape, so the re-planner would fit a
            faster machine), or a reward name that does not resolve (`rewards.load_reward`).
    """
    g = cfg.grpo
    for name in g.rewards:
        load_reward(name)
    check_grpo_rows(cfg)
    if world_size > 1:
        raise ValueError("train.method: grpo runs in one process; launch it without torchrun")
    if cfg.data.packing:
        raise ValueError("data.packing: a GRPO row is one rollout; set data.packing: false")
    if cfg.planner.replan_every_steps:
        raise ValueError("planner.replan_every_steps: a GRPO run's micro-batches are cut to "
                         "their rollouts, so its measured windows hold less work than the "
                         "plan's shape and would re-plan for a faster machine; set "
                         "planner.replan_every_steps: 0")


class ReferenceModel:
    """A frozen copy of the initial weights in the compute dtype, in host DRAM (P x b bytes,
    b = 2 or 4), and the streamed forward pass that scores rollouts with it.

    Shares the policy adapter's module skeleton; its own host store holds the copy. On the
    cpu backend the pass runs on the copy itself (`host` mode); on a GPU it streams through
    its own two weight slots (the policy's slots load by block index from the policy's
    paths).
    """

    def __init__(self, policy: ModelAdapter, tokenizer, *, device, compute_dtype: torch.dtype,
                 batch_size: int, initial: HostParams | None = None) -> None:
        src = initial if initial is not None else policy.params
        params = HostParams([{s.name: s.shape for s in g.slots} for g in src.blocks],
                            [g.prefix for g in src.blocks],
                            {s.name: s.shape for s in src.ends.slots},
                            master_dtype=COMPUTE_DTYPE_NAMES[compute_dtype])
        for mine, theirs in zip(params.groups, src.groups):
            mine.master.copy_(theirs.master)
            mine.grad = torch.empty(0, dtype=mine.master.dtype)  # never trained
        self.bytes = sum(g.master.numel() * g.master.element_size() for g in params.groups)
        """Host DRAM the copy holds, bytes."""
        adapter = ModelAdapter.__new__(ModelAdapter)
        adapter.__dict__.update(policy.__dict__)  # the same skeleton, masks and rotaries
        adapter.params = params
        mode = "streamed" if device.is_cuda else "host"
        self.lm = StreamedLM(adapter, tokenizer, device=device, compute_dtype=compute_dtype,
                             weights=mode, batch_size=batch_size)

    def token_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """`StreamedLM.token_logprobs` under the reference weights."""
        return self.lm.token_logprobs(sequences)

    def close(self) -> None:
        self.lm.close()


@dataclass(kw_only=True)
class Rollouts:
    """One rollout batch: the micro-batches and what the step's metrics report."""

    batches: list[dict]
    """`train.grad_accum` micro-batches (module docstring, step 5)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward_mean, reward_std, rollout_exact_match, completion_tokens (mean per rollout),
    trained_rows (rollouts the step trains on: `grpo.skip_flat_groups`)."""


class GrpoRun:
    """The GRPO side of a run: prompt order, rollouts, rewards and the objective.

    Args:
        cfg: the run config (`grpo`, `train`, `data.seq_len`).
        examples: the training examples (prompts with reference answers).
        tokenizer: the run's tokenizer (its chat template renders the prompts).
        adapter: the policy's model (its masters are the engine's).
        lm_factory: () -> the `StreamedLM` over the live engine (`eval_plans.heldout_lm`),
            called once, at the first rollout.
        initial: the run's initial weights, which the KL reference copies (`initial_params`:
            a resumed run's adapter holds the checkpoint's); None: the adapter's masters.
        wait_updates: () -> None, called before each rollout batch: waits for the optimizer
            updates still queued on the engine's worker (`Engine.named_masters`), whose
            masters the rollouts and old log-probs read. None: nothing queued (tests).
        device, compute_dtype: the engine's (for the reference pass).

    Raises:
        ValueError: a bad reward name (`rewards.load_reward`) or an example without a prompt.
    """

    def __init__(self, cfg: RunConfig, *, examples: list[Example], tokenizer,
                 adapter: ModelAdapter, lm_factory, device, compute_dtype: torch.dtype,
                 wait_updates=None, initial: HostParams | None = None) -> None:
        self.cfg, self.g = cfg, cfg.grpo
        self.tokenizer, self.examples = tokenizer, list(examples)
        if not self.examples:
            raise ValueError("train.method: grpo needs training prompts; the data has none")
        self.reward_fns = [load_reward(name) for name in self.g.rewards]
        self.objective = GRPOObjective(clip_eps=self.g.clip_eps, kl_coef=self.g.kl_coef)
        self.order = list(range(len(self.examples)))
        random.Random(f"lazytrain-grpo-prompts-{cfg.train.seed}").shuffle(self.order)
        self._lm_factory, self._lm = lm_factory, None
        self._wait_updates = wait_updates
        self.reference = (ReferenceModel(adapter, tokenizer, device=device,
                                         compute_dtype=compute_dtype,
                                         batch_size=cfg.train.micro_batch, initial=initial)
                          if self.g.kl_coef > 0 else None)
        self._current: Rollouts | None = None

    @property
    def lm(self) -> StreamedLM:
        if self._lm is None:
            self._lm = self._lm_factory()
        return self._lm

    def batches(self, step: int) -> Rollouts:
        """The micro-batches of optimizer step `step` (0-based): new rollouts every
        `grpo.updates_per_rollout` steps, else the last ones again (their old log-probs are
        still the rollout policy's). Leaves the global RNG as it was (generation draws from
        its own seeded generator). Generation runs in batches of the decode plan's rows (a
        step's rollouts when they fit) on every torch thread: at 64 rows two threads decode
        1.4x faster than one on 2 CPU cores."""
        if self._current is None or step % self.g.updates_per_rollout == 0:
            if self._wait_updates is not None:  # the last step's updates run on the worker
                self._wait_updates()
            try:
                with torch.random.fork_rng(devices=[]):
                    self._current = self._rollout(step)
            finally:
                self.lm.refresh()
        return self._current

    def state_dict(self, step: int) -> dict:
        """What a checkpoint after `step` optimizer steps needs to resume bit for bit: inside a
        rollout batch (`step` not a multiple of `grpo.updates_per_rollout`) the rollouts the
        next steps reuse, {"batches": [micro-batch dicts], "metrics": {...}}; they came from
        weights the checkpoint no longer has, so they cannot be generated again. Else {}."""
        if self._current is None or step % self.g.updates_per_rollout == 0:
            return {}
        return {"batches": self._current.batches, "metrics": self._current.metrics}

    def load_state_dict(self, state: dict) -> None:
        """Take the rollouts of a checkpoint's `state_dict` ({}: the next step rolls out)."""
        if state:
            self._current = Rollouts(batches=list(state["batches"]),
                                     metrics=dict(state["metrics"]))

    def prompts_of(self, step: int) -> list[Example]:
        """The `grpo.prompts_per_step` examples of step `step` (the shuffled order, walked by
        rollout batch and wrapped around)."""
        k = step // self.g.updates_per_rollout * self.g.prompts_per_step
        return [self.examples[self.order[(k + i) % len(self.order)]]
                for i in range(self.g.prompts_per_step)]

    def _rollout(self, step: int) -> Rollouts:
        g, seq_len = self.g, self.cfg.data.seq_len
        examples = self.prompts_of(step)
        prompts = [encode_prompt(self.tokenizer, ex)[:seq_len - 1] for ex in examples]
        rows_prompt = [p for p in prompts for _ in range(g.n)]
        completions = self.lm.generate(rows_prompt, max_new_tokens=g.max_new_tokens,
                                       temperature=g.temperature, top_p=g.top_p,
                                       seed=g.seed + step)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        questions = [ex.prompt_messages[-1].content for ex in examples for _ in range(g.n)]
        answers = [ex.answer for ex in examples for _ in range(g.n)]
        rewards = torch.tensor(score(self.reward_fns, texts, prompts=questions,
                                     answers=answers), dtype=torch.float32)
        advantages = group_advantages(rewards, n=g.n, eps=g.std_eps,
                                      scale_by_std=g.scale_by_std)
        sequences = [(p + c)[:seq_len] for p, c in zip(rows_prompt, completions)]
        scored = [s if len(s) >= 2 else s + [self.lm.pad_id] for s in sequences]
        old = self.lm.token_logprobs(scored)
        ref = self.reference.token_logprobs(scored) if self.reference is not None else None
        rows = [_row(seq, len(p), seq_len=seq_len, pad_id=self.lm.pad_id, old=o,
                     ref=None if ref is None else ref[i])
                for i, (seq, p, o) in enumerate(zip(sequences, rows_prompt, old))]
        trained = kept_rows(rewards, n=g.n, skip_flat=g.skip_flat_groups and g.kl_coef == 0)
        batches = micro_batches([rows[i] for i in trained], advantages[trained],
                                count=self.cfg.train.grad_accum, pad_id=self.lm.pad_id)
        hits = [exact_match(t, prompt="", answer=a) for t, a in zip(texts, answers)]
        metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                   "rollout_exact_match": sum(hits) / len(hits),
                   "completion_tokens": sum(map(len, completions)) / len(completions),
                   "trained_rows": float(len(trained))}
        return Rollouts(batches=batches, metrics=metrics)

    def step_metrics(self) -> dict[str, float]:
        """The metrics of the step just trained: the rollouts' and the objective's
        (clip_fraction, kl), prefixed `grpo/`."""
        out = dict(self._current.metrics if self._current else {})
        out.update(self.objective.take_metrics())
        return {f"grpo/{k}": v for k, v in out.items()}

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()


def kept_rows(rewards: torch.Tensor, *, n: int, skip_flat: bool) -> list[int]:
    """Indices of the rollouts the training phase trains, of [P * n] rewards grouped by prompt:
    all, or with `skip_flat` (`grpo.skip_flat_groups` without a KL term) those of the groups
    whose rewards are not all equal. A group is left out whole or kept whole: a kept group's
    rollout whose advantage is 0 (its reward the group's mean) stays in the step's completion
    tokens, as in a run without skipping."""
    if not skip_flat:
        return list(range(rewards.numel()))
    groups = rewards.view(-1, n)
    spread = (groups != groups[:, :1]).any(dim=1)
    return [i for i in range(rewards.numel()) if bool(spread[i // n])]


def _row(seq: list[int], prompt_len: int, *, seq_len: int, pad_id: int, old: torch.Tensor,
         ref: torch.Tensor | None) -> dict:
    """One rollout as a row of seq_len: ids right-padded, labels on the completion tokens,
    old/ref log-probs at the shifted positions of those labels (0 elsewhere)."""
    n = len(seq)
    ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    ids[:n] = torch.tensor(seq)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    labels[prompt_len:n] = ids[prompt_len:n]
    mask = torch.zeros(seq_len, dtype=torch.long)
    mask[:n] = 1
    trained = (labels[1:] != IGNORE_INDEX).float()  # shifted targets t -> label t + 1

    def aligned(lp: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(seq_len, dtype=torch.float32)
        out[:seq_len - 1] = torch.cat([lp[:n - 1].float(), torch.zeros(seq_len - n)])
        out[:seq_len - 1] *= trained
        return out

    row = {"input_ids": ids, "labels": labels, "attention_mask": mask, "old_logp": aligned(old)}
    if ref is not None:
        row["ref_logp"] = aligned(ref)
    return row


def micro_batches(rows: list[dict], advantages: torch.Tensor, *, count: int,
                  pad_id: int) -> list[dict]:
    """`count` micro-batches (`train.grad_accum`; the engine runs exactly that many) over
    `rows` (`_row`, each padded to S) with their advantages [R].

    Rows are sorted by length and split into `count` runs of near-equal size, each cut to its
    longest row (padding costs compute and trains nothing). With fewer rows than `count`,
    the rest are filler micro-batches of one 2-token row without labels: no loss, no gradient
    and no completion token in the step's normaliser. Each micro-batch holds at most
    ceil(R / count) rows, so at most `train.micro_batch` when R <= micro_batch x grad_accum.
    """
    order = sorted(range(len(rows)), key=lambda i: int(rows[i]["attention_mask"].sum()))
    size, extra = divmod(len(order), count)
    out, start = [], 0
    for m in range(count):
        part = order[start:start + size + (m < extra)]
        start += len(part)
        out.append(_stack([rows[i] for i in part], advantages[part]) if part
                   else _filler(rows[0] if rows else None, pad_id=pad_id))
    return out


def _stack(rows: list[dict], advantages: torch.Tensor) -> dict:
    """Rows -> one micro-batch dict of [B, W] tensors plus `advantages` [B] and `FILLER`
    False; W: the longest row's tokens (at least 2: one target)."""
    width = max(2, max(int(r["attention_mask"].sum()) for r in rows))
    batch = {k: torch.stack([r[k][:width] for r in rows]) for k in rows[0]}
    batch["advantages"] = advantages.clone()
    batch[FILLER] = False
    return batch


def _filler(like: dict | None, *, pad_id: int) -> dict:
    """A micro-batch that trains nothing: one row of 2 pad tokens, every label IGNORE_INDEX,
    advantage 0, log-probs 0 (the keys of `like`, a row, when given), marked
    `micro_batch.FILLER` so that an MoE model adds no router aux loss for it either."""
    keys = like.keys() if like is not None else ("input_ids", "labels", "attention_mask",
                                                  "old_logp")
    row = {"input_ids": torch.full((1, 2), pad_id, dtype=torch.long),
           "labels": torch.full((1, 2), IGNORE_INDEX, dtype=torch.long),
           "attention_mask": torch.ones((1, 2), dtype=torch.long)}
    batch = {k: row.get(k, torch.zeros((1, 2), dtype=torch.float32)) for k in keys}
    batch["advantages"] = torch.zeros(1)
    batch[FILLER] = True
    return batch


def initial_params(cfg: RunConfig) -> HostParams:
    """The run's initial weights as a fresh run loads them (`model.config_path`: its weights,
    or the random init seeded by `train.seed`), in `train.master_dtype`: a resumed run's KL
    reference is the initial policy, not the checkpoint's. Holds one more copy of the masters
    in host memory until the reference has copied them (on resume only).

    Raises:
        FileNotFoundError, ValueError: the model source is gone (`resolve_model_source`).
    """
    tc = cfg.train
    source = model_source.resolve_model_source(cfg.model.config_path, weights=True)
    return model_source.load_adapter(source, compute_dtype=tc.compute_dtype,
                                     master_dtype=tc.master_dtype, seed=tc.seed).params


def start_grpo(trainer) -> GrpoRun:
    """The `GrpoRun` of a `train.Trainer` with `train.method: grpo`: checks the config
    (`check_grpo_config`), sets the engine head's objective, and rolls out through the
    trainer's evaluation model (made here when the trainer has none yet).

    Raises:
        ValueError: as `check_grpo_config` and `GrpoRun`.
    """
    check_grpo_config(trainer.cfg, world_size=trainer.world_size)

    def lm() -> StreamedLM:
        if trainer.eval_lm is None:
            trainer.eval_lm = eval_plans.heldout_lm(trainer.adapter, trainer.tokenizer,
                                                    trainer.engine, trainer.eval_plans)
        return trainer.eval_lm

    resumed = getattr(trainer, "resumed_from", None) is not None
    initial = initial_params(trainer.cfg) if resumed and trainer.cfg.grpo.kl_coef > 0 else None
    run = GrpoRun(trainer.cfg, examples=list(trainer.data.train.examples),
                  tokenizer=trainer.tokenizer, adapter=trainer.adapter, lm_factory=lm,
                  device=trainer.engine.dev, compute_dtype=trainer.engine.dtype,
                  wait_updates=trainer.engine.named_masters, initial=initial)
    del initial  # the reference holds its copy
    trainer.engine.ends.objective = run.objective
    g = trainer.cfg.grpo
    if trainer.is_main:  # the plan summary's GRPO lines, under the inference plans' lines
        predicted = trainer.plan.predicted.step_ms if trainer.plan.predicted else 0.0
        print("\n".join(grpo_summary_lines(
            trainer.eval_plans, training_step_ms=predicted, grpo=g,
            total_params=trainer.adapter.params.total_numel(),
            compute_dtype=trainer.cfg.train.compute_dtype)), flush=True)
    ref = (f", KL {g.kl_coef:g} to the initial weights ({run.reference.bytes / 1e9:.3g} GB "
           f"in DRAM)" if run.reference is not None else "")
    trainer.log(f"grpo: {g.prompts_per_step} prompts x {g.n} rollouts per step, up to "
                f"{g.max_new_tokens} new tokens at temperature {g.temperature:g}, rewards "
                f"{'+'.join(g.rewards)}, clip {g.clip_eps:g}{ref}")
    return run
