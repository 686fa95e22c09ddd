"""A DPO run (`train.method: dpo`) inside the trainer: its data, reference log-probs, objective
and metrics. `trainer.py` calls `preference_data` in place of `data.build_data`, plans
`planning_config` (2 rows per pair), and `start_dpo` once the engine exists.

Data: `data.path` holds preference records (`data.preference`: prompt/chosen/rejected as text
or messages, LlamaFactory ranking records), names a `"ranking": true` entry of the
`data.registry_path` registry (`preference.read_registry_pairs`), or is `embedded:arithmetic`
(the embedded problems, the worked answer against one with a wrong step); held out as for SFT
(`data.eval_path` / `data.eval_split` (not with a registry), else the last `data.num_eval`
pairs). No packing, no `data.mix`.

Reference: computed before the first step with the initial weights through the trainer's
evaluation model (`train.reference`), cached in the run directory; a resume reads the table
its checkpoint names (it cannot be recomputed once the weights have moved).

Metrics (`dpo_*` in metrics.jsonl, per step; `eval_dpo_*` per evaluation and in
summary.json): rewards of the chosen and rejected responses, accuracy, margin (`train.dpo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lazytrain.config.dpo import planning_config  # the trainer plans through it
from lazytrain.data import EMBEDDED_PREFIX, _resolver, corpus_texts
from lazytrain.data.formats import Example
from lazytrain.data.preference import (PreferencePair, PreferenceStream, arithmetic_pairs,
                                       encode_pair, encode_pairs, pairs_fingerprint, read_pairs,
                                       read_registry_pairs)
from lazytrain.data.templates import template_of, use_template
from lazytrain.train import eval_plans
from lazytrain.train.dpo import DPOObjective, pair_loss, summarize
from lazytrain.train.reference import (cache_path, model_hash, reference_key, reference_logps,
                                       row_logps)

EMBEDDED_PAIRS = 128
"""Training pairs generated for `embedded:arithmetic` under DPO: every one is tokenized twice
and scored for the reference before the first step (a few minutes for SmolLM2-135M on this
2-core machine when it is busy), and 128 covers 32 steps of 4 pairs without a repeat."""


@dataclass(kw_only=True, slots=True)
class PreferenceData:
    """What the trainer reads from its data (as `data.DataBundle`), for preference pairs."""

    train: PreferenceStream
    """Micro-batches of `train.micro_batch` pairs (2 x rows)."""
    eval_pairs: list
    """Held-out pairs, encoded: (chosen, rejected) `Encoded`s."""
    eval_examples: tuple[Example, ...]
    """The held-out prompts with their chosen responses (loss and exact match, as SFT)."""
    source: str
    format: str = "preference"
    """"arithmetic" for the embedded pairs (its generation length, `train.evaluate`), else
    "preference"."""
    notes: tuple[str, ...] = ()


def read_configured_pairs(cfg, *, seed: int, base_dir=None
                          ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs of a `DataConfig` (module docstring), relative paths resolved
    against `base_dir` (default: the cwd): what `preference_data` encodes and `lazytrain data`
    previews.

    Raises:
        ValueError: `data.mix` set, an unknown embedded name, a record that is not a preference
            pair, a registry entry without `"ranking": true`, too few pairs for
            `data.num_eval`.
        FileNotFoundError, ConnectionError: as `sources.load_table`.
    """
    resolve = _resolver(base_dir)
    if cfg.mix:
        raise ValueError("data.mix: not read with train.method: dpo; give the preference file "
                         "(or Hub id, or registry entry) as data.path")
    if cfg.path.startswith(EMBEDDED_PREFIX) and not cfg.registry_path:
        if cfg.path != f"{EMBEDDED_PREFIX}arithmetic":
            raise ValueError(f"data.path: unknown embedded dataset {cfg.path!r}; the embedded "
                             f"one is embedded:arithmetic")
        return arithmetic_pairs(num_train=EMBEDDED_PAIRS, num_eval=cfg.num_eval, seed=seed)
    if cfg.registry_path:
        train = read_registry_pairs(resolve(cfg.registry_path), cfg.path,
                                    dataset_dir=resolve(cfg.dataset_dir) if cfg.dataset_dir
                                    else None)
    else:
        train = read_pairs(resolve(cfg.path), subset=cfg.subset, split=cfg.split)
    if cfg.eval_path or (cfg.eval_split and not cfg.registry_path):
        held = read_pairs(resolve(cfg.eval_path or cfg.path), subset=cfg.subset,
                          split=cfg.eval_split or "train")[: cfg.num_eval]
        return train, held
    if cfg.num_eval and len(train) <= cfg.num_eval:
        raise ValueError(f"data.num_eval: {cfg.path} has {len(train)} pairs, not more than "
                         f"num_eval={cfg.num_eval}; lower data.num_eval or set data.eval_path")
    return (train[: -cfg.num_eval], train[-cfg.num_eval:]) if cfg.num_eval else (train, [])


def training_corpus(cfg, *, seed: int, base_dir=None) -> list[str]:
    """Every message text of the run's training data, to train a tokenizer on for a model
    that ships none: the pairs' prompt, chosen and rejected turns with `train.method: dpo`,
    else `data.corpus_texts`. Errors as `preference_data` / `corpus_texts`."""
    if cfg.train.method != "dpo":
        return corpus_texts(cfg.data, seed=seed, base_dir=base_dir)
    train, held = read_configured_pairs(cfg.data, seed=seed, base_dir=base_dir)
    return [m.content for p in [*train, *held] for m in (*p.prompt, *p.chosen, *p.rejected)]


def templated_pairs(cfg, tokenizer, *, seed: int, base_dir=None
                    ) -> tuple[list[PreferencePair], list[PreferencePair], str | None]:
    """(train pairs, held-out pairs, the template note or None) of a `DataConfig`, with the
    tokenizer's chat template set as `data.chat_template` says (`templates.use_template`).

    Raises:
        ValueError: `data.packing` on; as `read_configured_pairs`.
        FileNotFoundError, ConnectionError: as `sources.load_table`.
    """
    if cfg.packing:
        raise ValueError("data.packing: DPO pads each pair's two rows (chosen, rejected) to "
                         "data.seq_len; set data.packing: false")
    train, held = read_configured_pairs(cfg, seed=seed, base_dir=base_dir)
    return train, held, use_template(tokenizer, cfg.chat_template, base_dir=base_dir)


def preference_data(cfg, tokenizer, *, micro_batch: int, seed: int, base_dir=None
                    ) -> PreferenceData:
    """Read, template and encode the preference pairs of a `DataConfig` (module docstring).

    Args:
        cfg: `data.*`; micro_batch: pairs per micro-batch; seed: `train.seed`.
        tokenizer: the model's fast tokenizer (its chat template set as `data.chat_template`
            says, `templates.use_template`).

    Raises:
        ValueError: `data.packing` on, as `read_configured_pairs`, no pair that fits
            `data.seq_len`.
        FileNotFoundError, ConnectionError: as `sources.load_table`.
    """
    train, held, note = templated_pairs(cfg, tokenizer, seed=seed, base_dir=base_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    per_pair, counts = encode_pairs(tokenizer, train, seq_len=cfg.seq_len, overlong=cfg.overlong)
    encoded = [enc for enc in per_pair if enc is not None]
    held_enc = [(p, e) for p in held if (e := encode_pair(tokenizer, p, seq_len=cfg.seq_len,
                                                          overlong="truncate")) is not None]
    stream = PreferenceStream(pairs=encoded, micro_batch=micro_batch, seq_len=cfg.seq_len,
                              pad_id=pad_id, seed=seed, counts=counts)
    return PreferenceData(train=stream, eval_pairs=[e for _, e in held_enc],
                          eval_examples=tuple(p.example("chosen") for p, _ in held_enc),
                          source=cfg.path, notes=(note,) if note else (),
                          format="arithmetic" if cfg.path.startswith(EMBEDDED_PREFIX)
                          else "preference")


class DPORun:
    """The DPO parts of a running trainer: the objective on the engine's head, the reference
    log-probs on the stream, and the held-out pair metrics."""

    def __init__(self, trainer) -> None:
        dc = trainer.cfg.dpo
        self.trainer = trainer
        self.data: PreferenceData = trainer.data
        self.objective = DPOObjective(beta=dc.beta, loss_type=dc.loss)
        trainer.engine.ends.objective = self.objective
        self.evals: list[dict[str, Any]] = []
        stream = self.data.train
        if stream.reference_key is None:  # a fresh run: the initial weights are the reference
            stream.reference_key = reference_key(
                data_fingerprint=pairs_fingerprint(stream.pairs + self.data.eval_pairs),
                model=model_hash(trainer.adapter), template=template_of(trainer.tokenizer))
        elif not cache_path(trainer.run_dir, stream.reference_key).is_file():
            raise FileNotFoundError(
                f"--resume: the reference log-probs of this run "
                f"({cache_path(trainer.run_dir, stream.reference_key)}) are gone; they come "
                f"from the initial weights and cannot be recomputed after training started")
        lm = self._lm()
        try:
            table = reference_logps(stream.pairs + self.data.eval_pairs,
                                    token_logprobs=lm.token_logprobs, run_dir=trainer.run_dir,
                                    key=stream.reference_key, log=trainer.log)
        finally:
            lm.refresh()  # its device copies go before training
        stream.ref_logp = table[: len(stream.pairs)]
        self.eval_ref = table[len(stream.pairs):]

    def _lm(self):
        """The trainer's evaluation model (`eval_plans.heldout_lm`), made here when needed."""
        t = self.trainer
        if t.eval_lm is None:
            t.eval_lm = eval_plans.heldout_lm(t.adapter, t.tokenizer, t.engine, t.eval_plans)
        t.engine.named_masters()  # waits for every queued optimizer update
        return t.eval_lm

    def step_metrics(self) -> dict[str, float]:
        """The last step's training pairs' metrics, `dpo_` prefixed (one read per step)."""
        return {f"dpo_{k}": v for k, v in self.objective.take_metrics().items()}

    def evaluate_pairs(self) -> dict[str, float]:
        """Held-out pair metrics with the current weights (`eval_dpo_` prefixed: loss,
        rewards, accuracy, margin), from per-row log-probs of a streamed forward pass; kept in
        `evals` for the summary. Empty without held-out pairs."""
        pairs = self.data.eval_pairs
        if not pairs:
            return {}
        lm = self._lm()
        try:
            rows = [c for c, _ in pairs] + [r for _, r in pairs]
            pi = row_logps(lm.token_logprobs, rows)
        finally:
            lm.refresh()
        ref = torch.cat([self.eval_ref[:, 0], self.eval_ref[:, 1]])
        counts = torch.tensor([sum(t != -100 for t in r.labels[1:]) for r in rows],
                              dtype=torch.float32)
        losses, stats = pair_loss(pi, ref, counts, beta=self.objective.beta,
                                  loss=self.objective.loss_type)
        out = {"loss": float(losses.mean()), **summarize([stats])}
        result = {f"eval_dpo_{k}": v for k, v in out.items()}
        self.evals.append({"step": self.trainer.step, **result})
        return result


def pairs_line(when: str, metrics: dict[str, float]) -> str:
    """The log line of a held-out pair evaluation: "eval pairs before: accuracy 0.5 (16
    pairs), margin 0.000, rewards chosen 0.000 / rejected 0.000, loss 0.6931"."""
    m = {k.removeprefix("eval_dpo_"): v for k, v in metrics.items()}
    return (f"eval pairs {when}: accuracy {m['accuracy']:.3f} ({m['pairs']} pairs), margin "
            f"{m['margin']:.3f}, rewards chosen {m['rewards_chosen']:.3f} / rejected "
            f"{m['rewards_rejected']:.3f}, loss {m['loss']:.4f}")
