"""Forward-only and decode passes of a model through the streaming engine's weight path.

Owns `StreamedLM`: per-token log-probabilities of whole sequences (held-out loss, lm-eval's
log-likelihoods) and generation with a KV cache (greedy or temperature / top-p sampling,
seeded), run block by block on weights that reach the device the way the engine's do
(`runtime.streams.DeviceWeights`: the host master converted to the compute dtype in a staging
buffer, copied to a device slot on the h2d stream, the next block's copy queued while the
current one runs). No second full copy of the model is built: the host holds the masters, the
device holds two block slots (streamed), every block once (resident, when the decode plan says
the weights fit HBM), or nothing extra (`host`: the cpu backend with masters already in the
compute dtype runs on views of the masters).

Everything runs in the compute dtype of the device weights (fp32 or bf16); log-probabilities
and sampling are computed in fp32 from the head's logits, chunk by chunk along the sequence
(`INFERENCE_HEAD_CHUNK_TOKENS`), so [B, S, V] logits are never materialised.

Knows nothing about plans, trainers or tasks: the caller picks the weight mode, the device
and the batch size. Every pass books its allocations and copies to the ledger window "eval".

Legend: B = rows of a batch, S = sequence length (tokens), H = hidden size, V = vocabulary.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from transformers import AutoTokenizer, DynamicCache

from lazytrain.models.adapter import ModelAdapter
from lazytrain.models.hf_loader import load_adapter_from_dir
from lazytrain.planner.inference_plans import (EVAL_ROWS, FILES, INFERENCE_HEAD_CHUNK_TOKENS,
                                               INFERENCE_PASS_TOKENS, INFERENCE_WEIGHT_SLOTS,
                                               InferencePlan)
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.device import Device
from lazytrain.runtime.streams import DeviceWeights

EVAL_WINDOW = "eval"
"""Ledger window of every evaluation pass (its bytes held and moved)."""
WEIGHT_MODES = ("streamed", "resident", "host")
"""`streamed`: block weights through INFERENCE_WEIGHT_SLOTS device slots, reloaded every
pass; `resident`: every block loaded once and kept (the decode plan's choice when weights fit
HBM); `host`: the cpu backend runs on views of the masters (masters in the compute dtype
only)."""
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class StreamedLM:
    """Forward-only and decode passes of a model through the streaming engine's weight path.

    Args:
        adapter: the model and its host masters (`adapter.params`).
        tokenizer: the HF tokenizer of the run or checkpoint.
        device: the device API (`runtime.backends.make_device`); the engine's own when
            evaluating during training.
        compute_dtype: dtype of the device weights and activations.
        weights: one of `WEIGHT_MODES`.
        batch_size: rows per forward or decode batch.
        eos_token_ids: tokens that end a generation (default: the tokenizer's eos).
        slots: device weight slots to share (the engine's `DeviceWeights`: the trainer
            evaluates between steps, when they are idle; a pass holds two); None: its own
            INFERENCE_WEIGHT_SLOTS slots and staging buffers.
        hbm_limit_bytes: the ledger's budget for the window "eval" (the decode plan's HBM
            budget); None: whatever the ledger applies to other windows.
        book_compute: on the cpu backends, also book every op's fresh output (activations,
            logits, the KV cache) to the ledger (`Device.compute_scope`): a dispatch mode
            that made SmolLM2's greedy decoding 1.35x slower, so off by default; device
            weights, the ends and every copy are booked either way.

    Raises:
        ValueError: an unknown weight mode, or `host` with masters in another dtype or a
            non-cpu device.
    """

    def __init__(self, adapter: ModelAdapter, tokenizer: Any, *, device: Device,
                 compute_dtype: torch.dtype = torch.float32, weights: str = "streamed",
                 batch_size: int = EVAL_ROWS, eos_token_ids: set[int] | None = None,
                 slots: DeviceWeights | None = None, hbm_limit_bytes: int | None = None,
                 book_compute: bool = False) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights: unknown mode {weights!r}; use one of {WEIGHT_MODES}")
        master_dtype = adapter.params.ends.master.dtype
        if weights == "host" and (device.is_cuda or master_dtype != compute_dtype):
            raise ValueError(f"weights=host needs the cpu backend and {compute_dtype} masters "
                             f"(got {device.kind}, {master_dtype}); use weights=streamed")
        self.adapter, self.tokenizer, self.dev = adapter, tokenizer, device
        self.dtype, self.mode, self.batch_size = compute_dtype, weights, batch_size
        self.book_compute = book_compute
        eos = tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set(eos_token_ids if eos_token_ids is not None else
                                           ([] if eos is None else [eos]))
        config = adapter.config
        self.max_length: int = int(getattr(config, "max_position_embeddings", 0) or 2**31 - 1)
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else (eos if eos is not None else 0))
        self._slots: DeviceWeights | None = slots
        self._own_slots = slots is None
        self.hbm_limit_bytes = hbm_limit_bytes
        self._resident: list[torch.Tensor] | None = None
        self._ends: torch.Tensor | None = None

    # --- construction from a run directory ----------------------------------------------------

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, *, checkpoint: str | None = None,
                     device: str = "cpu", weights: str | None = None,
                     batch_size: int = EVAL_ROWS) -> "StreamedLM":
        """The newest complete checkpoint of a run (or `checkpoint`, a step directory name or
        path), with its saved tokenizer and chat template, on `device` in the run's
        `train.compute_dtype`. The host store holds the weights once, in the compute dtype.

        Args:
            weights: a `WEIGHT_MODES` value; None: `host` on cpu, else the run's decode plan's
                (decode_plan.json: resident when the weights fit HBM), else `streamed`.

        Raises:
            FileNotFoundError: no complete checkpoint in the run (names the run dir and the
                fix).
        """
        path = _checkpoint_path(Path(run_dir), checkpoint)
        dtype_name = _run_compute_dtype(Path(run_dir))
        adapter = load_adapter_from_dir(path, master_dtype=dtype_name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        dev = make_device(device)
        mode = weights or ("host" if not dev.is_cuda else _planned_mode(Path(run_dir)))
        return cls(adapter, tokenizer, device=dev, compute_dtype=COMPUTE_DTYPES[dtype_name],
                   weights=mode, batch_size=batch_size)

    # --- the weight path ----------------------------------------------------------------------

    def _prepare(self) -> None:
        """The ends on the device (kept: they are small beside the blocks), the two weight
        slots (streamed) or every block (resident)."""
        params = self.adapter.params
        if self.mode == "host":
            return
        if self._slots is None:
            self._slots = DeviceWeights(params, self.dev, self.dtype,
                                        num_slots=INFERENCE_WEIGHT_SLOTS)
        if self._ends is None:
            self._ends = self.dev.empty(params.ends.numel, self.dtype, name="eval ends weights")
            self.dev.wait_event(self.dev.compute,
                                self._slots.load_flat(self._ends, params.ends.master))
        if self.mode == "resident" and self._resident is None:
            handles = [self._slots.load(g, j, resident=True) for j, g in enumerate(params.blocks)]
            self._resident = [self._slots.ready(h) for h in handles]

    def _ends_views(self) -> dict[str, torch.Tensor]:
        ends = self.adapter.params.ends
        return ends.master_views if self.mode == "host" else ends.views(self._ends)

    def _blocks(self):
        """Yields (j, block j's weights by local name) in order; a streamed block's slot is
        released after the consumer's work on it was queued (the next load waits for it), and
        block j+1's load is queued before block j runs."""
        groups = self.adapter.params.blocks
        if self.mode == "host":
            for j, g in enumerate(groups):
                yield j, g.master_views
            return
        if self.mode == "resident":
            for j, g in enumerate(groups):
                yield j, g.views(self._resident[j])
            return
        handle = self._slots.load(groups[0], 0)
        try:
            for j, g in enumerate(groups):
                nxt = self._slots.load(groups[j + 1], j + 1) if j + 1 < len(groups) else None
                try:
                    yield j, g.views(self._slots.ready(handle))
                finally:
                    self._slots.release(handle)
                    handle = nxt
        finally:  # a pass that stopped early (an error) returns the prefetched slot too
            if handle is not None:
                self._slots.release(handle)

    @contextlib.contextmanager
    def _window(self):
        """No autograd, the ledger window "eval" (compute ops booked with `book_compute`).

        `host` mode runs the blocks on the host masters: the pass is host work of the calling
        thread (`Device.host_scope`), started after a host wait for the compute stream, whose
        earlier work (an engine window's) made tensors the pass reads (the rotary module's
        buffers). Other modes run on the compute stream (`Device.compute_scope`), as the
        engine's windows do."""
        ledger = self.dev.ledger
        if self.hbm_limit_bytes is not None and \
                ledger.hbm_limits.get(EVAL_WINDOW) != self.hbm_limit_bytes:
            ledger.set_limits(hbm_limits={**ledger.hbm_limits, EVAL_WINDOW: self.hbm_limit_bytes},
                              pinned_limit_bytes=ledger.pinned_limit_bytes)
        ledger.begin_window(EVAL_WINDOW)
        try:
            if self.mode == "host":
                self.dev.host_wait(self.dev.record(self.dev.compute))
            scope = self.dev.host_scope if self.mode == "host" else self.dev.compute_scope
            with torch.no_grad(), scope(allocations=self.book_compute):
                self._prepare()
                yield
        finally:
            ledger.end_window()

    def refresh(self) -> None:
        """Free the device copies that outlive a pass (the ends; resident blocks): the next
        pass loads them from the masters again. The trainer calls it after each evaluation,
        so training gets that memory back and the next evaluation reads the updated masters;
        streamed blocks and host views read the masters on every pass anyway."""
        self._resident, self._ends = None, None

    def close(self) -> None:
        """Free the device weights and stop the conversion worker (of its own slots; shared
        slots stay with their owner)."""
        if self._slots is not None and self._own_slots:
            self._slots.close()
            self._slots = None
        self._resident, self._ends = None, None

    # --- forward-only: per-token log-probabilities ------------------------------------------

    def token_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence of n tokens, a float32 [n-1] tensor on the host: log p(x_t | x_<t) for
        t = 1..n-1, computed in the compute dtype (fp32 log-softmax of the head's logits).

        Sequences are batched `batch_size` at a time, right-padded (causal attention: padding
        after a token never changes it), and the batches of one pass (`INFERENCE_PASS_TOKENS`) share
        one load of every block.

        Raises:
            ValueError: a sequence shorter than 2 tokens or longer than `max_length`.
        """
        for k, seq in enumerate(sequences):
            if not 2 <= len(seq) <= self.max_length:
                raise ValueError(f"sequence {k}: {len(seq)} tokens; token_logprobs needs 2.."
                                 f"{self.max_length} (max_length)")
        out: list[torch.Tensor | None] = [None] * len(sequences)
        batches = [list(range(i, min(i + self.batch_size, len(sequences))))
                   for i in range(0, len(sequences), self.batch_size)]
        with self._window():
            for group in _passes(batches, sequences):
                for rows, logprobs in zip(group, self._score_pass(group, sequences)):
                    for r, lp in zip(rows, logprobs):
                        out[r] = lp
        return out

    def _score_pass(self, group: list[list[int]], sequences: list[list[int]]):
        """One load of the weights for every batch in `group`: their log-probabilities."""
        ends = self._ends_views()
        dev = self.dev.torch_device
        inputs, hiddens, kwargs = [], [], []
        for rows in group:
            width = max(len(sequences[r]) for r in rows)
            ids = torch.tensor([sequences[r] + [self.pad_id] * (width - len(sequences[r]))
                                for r in rows], device=dev)
            mask = torch.tensor([[1] * len(sequences[r]) + [0] * (width - len(sequences[r]))
                                 for r in rows], device=dev)
            h = self.adapter.embed(ids, ends[self.adapter.embed_name])
            inputs.append(ids)
            hiddens.append(h)
            kwargs.append(self.adapter.block_kwargs(ids, h, attention_mask=mask))
        for j, w in self._blocks():
            for b in range(len(group)):
                hiddens[b] = self.adapter.forward_block(j, hiddens[b], w, kwargs[b][j])
        results = []
        for rows, ids, h in zip(group, inputs, hiddens):
            lp = self._gather_logprobs(h[:, :-1], ids[:, 1:], ends)
            results.append([lp[k, :len(sequences[r]) - 1].cpu()
                            for k, r in enumerate(rows)])
        return results

    def _gather_logprobs(self, h: torch.Tensor, targets: torch.Tensor,
                         ends: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, S, H] hidden, [B, S] next tokens -> [B, S] fp32 log p(target), chunk by chunk."""
        out = torch.empty(targets.shape, dtype=torch.float32, device=h.device)
        chunk = max(1, INFERENCE_HEAD_CHUNK_TOKENS // h.shape[0])
        for a in range(0, h.shape[1], chunk):
            logits = self._logits(h[:, a:a + chunk], ends)
            # log_softmax as cross_entropy computes it (a second [B, C, V] tensor, counted by
            # the forward plan's head chunk): the held-out loss rounds as the training loss
            out[:, a:a + chunk] = torch.log_softmax(logits, dim=-1).gather(
                -1, targets[:, a:a + chunk, None])[..., 0]
        return out

    def _logits(self, h: torch.Tensor, ends: dict[str, torch.Tensor]) -> torch.Tensor:
        a = self.adapter
        return a.head_logits(h, norm_weight=ends[f"{a.layout.norm}.weight"],
                             head_weight=ends[a.head_name])

    # --- decode: generation with a KV cache -------------------------------------------------

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
        """New tokens per prompt (greedy at temperature 0), ending at EOS (included), at a
        token where stop(new_tokens) is True (included), or at max_new_tokens.

        Prompts are left-padded `batch_size` at a time (every row's next token sits at the
        last column; position ids count each row's own tokens, as HF's `generate`); the KV
        cache lives on the device for the batch. Sampling (temperature > 0) draws from
        softmax(logits / temperature) restricted to the smallest set of tokens whose
        probability reaches top_p (nucleus sampling), with a torch generator seeded by `seed`
        once per call: the same call gives the same tokens.

        Source: nucleus sampling, Holtzman et al., arXiv:1904.09751, section 3.1.

        Raises:
            ValueError: an empty prompt, a prompt plus max_new_tokens over `max_length`,
                temperature < 0, top_p outside (0, 1], or max_new_tokens < 0.
        """
        if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
            raise ValueError(f"generate: temperature {temperature} (>= 0), top_p {top_p} "
                             f"(in (0, 1]), max_new_tokens {max_new_tokens} (>= 0)")
        for k, p in enumerate(prompts):
            if not p or len(p) + max_new_tokens > self.max_length:
                raise ValueError(f"prompt {k}: {len(p)} tokens + max_new_tokens "
                                 f"{max_new_tokens}; needs 1..{self.max_length} (max_length)")
        gen = torch.Generator().manual_seed(seed)
        out: list[list[int]] = []
        with self._window():
            for i in range(0, len(prompts), self.batch_size):
                out += self._generate_batch(prompts[i:i + self.batch_size],
                                            max_new_tokens=max_new_tokens,
                                            pick=_picker(temperature, top_p, gen), stop=stop)
        return out

    def _generate_batch(self, prompts: list[list[int]], *, max_new_tokens: int,
                        pick: Callable[[torch.Tensor], torch.Tensor],
                        stop: Callable[[list[int]], bool] | None) -> list[list[int]]:
        dev = self.dev.torch_device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.adapter.config)
        new: list[list[int]] = [[] for _ in prompts]
        done = [max_new_tokens == 0] * len(prompts)
        while not all(done):
            logits = self._decode_step(ids, mask, positions, cache)
            chosen = pick(logits).tolist()
            for r, token in enumerate(chosen):
                if not done[r]:
                    new[r].append(token)
                    done[r] = (token in self.eos_token_ids or len(new[r]) >= max_new_tokens
                               or (stop is not None and stop(new[r])))
            ids = torch.tensor(chosen, device=dev)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
        return new

    def _decode_step(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                     cache) -> torch.Tensor:
        """One prefill or decode step of every block: [B, q] new tokens (their [B, q]
        positions; `mask` [B, past + q]) -> [B, V] fp32 logits of the last column. Appends
        the new keys and values (or recurrent states) to `cache`."""
        ends = self._ends_views()
        h = self.adapter.embed(ids, ends[self.adapter.embed_name])
        kwargs = self.adapter.block_kwargs(ids, h, attention_mask=mask, position_ids=positions,
                                           cache=cache)
        for j, w in self._blocks():
            h = self.adapter.forward_block(j, h, w, kwargs[j])
        return self._logits(h[:, -1:], ends)[:, 0]


def _picker(temperature: float, top_p: float, gen: torch.Generator):
    """[B, V] fp32 logits -> [B] int64 next tokens: argmax at temperature 0 (the first of
    equal maxima, as HF), else a draw from the top-p renormalised softmax(logits / T)."""
    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1).cpu()
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= top_p] = 0
        choice = torch.multinomial(sorted_p, 1, generator=gen)
        return order.gather(-1, choice)[:, 0]
    return pick


def _passes(batches: list[list[int]], sequences: list[list[int]]) -> list[list[list[int]]]:
    """Batches grouped so that a group's padded tokens stay under INFERENCE_PASS_TOKENS (at
    least one batch per group)."""
    groups: list[list[list[int]]] = []
    tokens = 0
    for rows in batches:
        size = len(rows) * max(len(sequences[r]) for r in rows)
        if not groups or tokens + size > INFERENCE_PASS_TOKENS:
            groups.append([])
            tokens = 0
        groups[-1].append(rows)
        tokens += size
    return groups


def _checkpoint_path(run_dir: Path, checkpoint: str | None) -> Path:
    """The checkpoint directory to load: `checkpoint` (a step directory name under
    RUN_DIR/checkpoints, or a path), else the newest complete one (its COMPLETE marker
    written last).

    Raises:
        FileNotFoundError: no such checkpoint (names the run dir and the fix).
    """
    root = run_dir / "checkpoints"
    if checkpoint is not None:
        path = Path(checkpoint) if Path(checkpoint).is_dir() else root / checkpoint
        if not (path / "COMPLETE").is_file():
            raise FileNotFoundError(f"--checkpoint: {path} is not a complete checkpoint; "
                                    f"pick one of {sorted(p.name for p in root.glob('step-*'))}")
        return path
    done = sorted(p for p in root.glob("step-*") if (p / "COMPLETE").is_file())
    if not done:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint under {root}; train the run "
                                f"(lazytrain train) until it saves one")
    return done[-1]


def _planned_mode(run_dir: Path) -> str:
    """`resident` when the run's decode plan keeps the weights in HBM, else `streamed`."""
    path = run_dir / FILES["decode"]
    if path.is_file() and InferencePlan.load(path).weights == "resident":
        return "resident"
    return "streamed"


def _run_compute_dtype(run_dir: Path) -> str:
    """`train.compute_dtype` of the run (its config.yaml, read as plain YAML), fp32 when the
    run has no config file."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return "fp32"
    raw = yaml.safe_load(path.read_text()) or {}
    value = (raw.get("train") or {}).get("compute_dtype", "fp32")
    if value not in COMPUTE_DTYPES:
        raise ValueError(f"{path}: train.compute_dtype {value!r}; use one of "
                         f"{sorted(COMPUTE_DTYPES)}")
    return value

