"""Forward-only and decode plans: what evaluation and generation hold in HBM, and how fast.

Owns two plan kinds beside the training Plan, both made from the same costed
`PlanningProblem` at run start and written beside plan.json:

- `forward` (held-out loss, log-likelihoods): blocks run without autograd and save nothing, so
  HBM holds the weights, the ends, the hidden states of one pass (INFERENCE_PASS_TOKENS, or
  one batch) and one block output, one block's transient workspace and one head chunk's
  logits;
- `decode` (generation): the same plus the KV cache of `batch` rows of `context_tokens`
  tokens, on the device for the whole generation:

      KV bytes = 2 * layers_with_kv * kv_heads * head_dim * b * tokens

  (keys and values; b the compute dtype's bytes; tokens = batch * context, capped at the
  window for sliding layers; MLA caches its latent, kv_lora_rank + qk_rope_head_dim per
  token), plus each linear-attention layer's recurrent state and conv inputs
  ((heads * k_dim * v_dim + channels * kernel) * b per row).

Each plan keeps the weights resident in HBM when all of it fits the budget
(`PlanningProblem.hbm_bytes`), and streams them through INFERENCE_WEIGHT_SLOTS slots otherwise.
Predicted time per micro-batch (forward) or per decode step, ms:

      t = embed + max(head_fwd, E_head / hbm) + sum_j (w_j + o),  head_fwd = head_ms / 3
      c_j = max(F_j, (P_j + K / L) / hbm)   the block's kernels: FLOPs or HBM reads
      w_j = c_j                        resident
      w_j = max(c_j, P_j / h2d)        streamed, copies beside compute (GPU)
      w_j = c_j + P_j / h2d            streamed, copies contend for the cores (CPU)

with F_j the block's forward ms (`fwd_ms`, per micro-batch of `tokens_per_micro_batch`
tokens, scaled linearly to the pass's tokens; a decode step runs `batch` tokens: F_j * batch
/ tokens_per_micro_batch) and the head's forward a third of its forward + backward (backward
~ 2 x forward: Kaplan et al., arXiv:2001.08361, section 2.1). Linear scaling holds while the
kernels are compute-bound; a decode step of a few rows is bound by memory instead: every
block reads all its weights P_j from device memory (`hbm_bytes_per_s`, the hardware's HBM
bandwidth; on a CPU its DRAM) for only `batch` tokens, plus its share of the KV cache K (the
plan's whole cache, spread evenly over the L blocks: an upper bound, a step's context grows
to context_tokens), and the head reads its weight E_head (vocab x hidden in the compute
dtype). Without a bandwidth (0) the memory terms are left out. A weight load is capped by
the host conversion rate too when it is known (`host_convert_bytes_per_s`). o is the
engine's fixed cost per window (`window_overhead_ms`: Python, hand-offs), paid once per
block call. Not modelled: kernel launch latency and attention's own FLOPs over the cache.

Knows nothing of torch or a solver; the runtime (`evaluation/streamed_lm.py`) reads the weight
mode and the slot and chunk constants from here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from lazytrain.atomic import write_text_atomic
from lazytrain.planner.plan_checks import PlanValidationError
from lazytrain.planner.problem import PlanningProblem
from lazytrain.spec.model import ModelSpec
from lazytrain.units import GB

INFERENCE_WEIGHT_SLOTS = 2
"""Device weight slots of a streamed forward or decode pass: block j+1 loads while j runs
(no recompute loads, unlike training's `contract.DEVICE_WEIGHT_SLOTS`)."""
INFERENCE_HEAD_CHUNK_TOKENS = 1024
"""Flattened tokens per head chunk of a forward pass (training's `contract.HEAD_CHUNK_TOKENS`
too): its fp32 logits and their log-softmax (2 x 4 B per logit) are the head's workspace."""
HEAD_FORWARD_SHARE = 1 / 3
"""Share of `head_ms` (forward + backward) that is the forward: backward ~ 2 x forward
(Kaplan et al., arXiv:2001.08361, section 2.1)."""
EVAL_ROWS = 8
"""Rows per forward or decode batch of an evaluation (`StreamedLM.batch_size`): the default
rows of both plans."""
INFERENCE_PASS_TOKENS = 65536
"""Padded tokens of the batches one forward pass runs per load of the weights
(`StreamedLM.token_logprobs`): their hidden states stay on the device between blocks."""
KINDS = ("forward", "decode")
WEIGHT_MODES = ("resident", "streamed")
FILES = {"forward": "forward_plan.json", "decode": "decode_plan.json"}
"""File of each kind in the run directory, beside plan.json."""


@dataclass(kw_only=True, frozen=True, slots=True)
class KvLayout:
    """What one token and one row leave in the decode cache, bytes (compute dtype)."""

    kv_bytes_per_token: tuple[int, ...]
    """Per softmax-attention layer: keys + values of one token, 2 * kv_heads * head_dim * b
    (MLA as HF caches it: the compressed latent, (kv_lora_rank + qk_rope_head_dim) * b)."""
    windows: tuple[int, ...]
    """Per softmax-attention layer: its sliding window in tokens (0: unbounded; HF keeps
    window - 1 tokens, so this is an upper bound)."""
    state_bytes_per_row: int
    """All linear-attention layers' states of one row: the recurrent state (heads * k_dim *
    v_dim) and the causal conv's last inputs (channels * kernel), bytes."""

    def cache_bytes(self, *, batch: int, context_tokens: int) -> int:
        """KV cache + recurrent states of `batch` rows of `context_tokens` tokens, bytes."""
        kv = sum(per * batch * (min(context_tokens, w) if w else context_tokens)
                 for per, w in zip(self.kv_bytes_per_token, self.windows))
        return kv + batch * self.state_bytes_per_row


def kv_layout(model: ModelSpec, hf_config: dict, *, dtype_bytes: int) -> KvLayout:
    """The cache layout of `model` from its parsed blocks and the HF config's KV heads.

    Args:
        hf_config: the HF config dict (`spec.model.read_hf_config`): `num_key_value_heads`
            (default: the attention heads), `head_dim` (default: the blocks' qk width).
        dtype_bytes: bytes per element of the compute dtype (2 or 4).
    """
    text = hf_config.get("text_config") or hf_config
    kv, windows, state = [], [], 0
    for blk in model.blocks:
        if blk.attention == "linear_attention":  # recurrent state + the conv's last inputs
            conv = blk.conv_flops_per_token // 2  # 2 x channels x kernel FLOPs per token
            state += (blk.linear_heads * blk.linear_k_dim * blk.linear_v_dim + conv) * dtype_bytes
            continue
        if blk.attention == "mla" and text.get("kv_lora_rank"):  # HF caches the latent
            kv.append((int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0)))
                      * dtype_bytes)
        elif blk.attention == "mla":
            kv.append(blk.num_heads * (blk.qk_head_dim + blk.v_head_dim) * dtype_bytes)
        else:
            heads = int(text.get("num_key_value_heads") or blk.num_heads)
            head_dim = int(text.get("head_dim") or blk.qk_head_dim)
            kv.append(2 * heads * head_dim * dtype_bytes)
        windows.append(blk.sliding_window)
    return KvLayout(kv_bytes_per_token=tuple(kv), windows=tuple(windows),
                    state_bytes_per_row=state)


@dataclass(kw_only=True, frozen=True, slots=True)
class InferencePlan:
    """One forward-only or decode plan: its HBM bytes by owner, the weight mode, the speed."""

    kind: str
    """"forward" (held-out loss) or "decode" (generation)."""
    weights: str
    """"resident" (every block loaded once) or "streamed" (INFERENCE_WEIGHT_SLOTS slots)."""
    batch: int
    """Rows per forward or decode batch."""
    context_tokens: int
    """Tokens per row: the sequence length (forward) or prompt + new tokens (decode)."""
    hbm_budget_bytes: int
    """The HBM budget the plan fits, bytes (the training problem's `hbm_bytes`)."""
    weight_bytes: int
    """Device weights: all blocks (resident) or the slots (streamed), bytes."""
    ends_bytes: int
    """Embedding, final norm and untied head on the device, bytes."""
    activation_bytes: int
    """Hidden states (a forward pass's batches, or a prefill's input) and one block output,
    one block's transient workspace and one head chunk, bytes."""
    cache_bytes: int = 0
    """KV cache and recurrent states (decode only), bytes."""
    model_weight_bytes: int
    """All blocks' compute-dtype weights, bytes (what resident needs)."""
    step_ms: float
    """Predicted time per forward micro-batch or per decode step, ms."""
    tokens_per_s: float
    """Predicted tokens scored (forward) or generated (decode) per second."""
    provenance: dict = field(default_factory=dict)
    """model_config_sha256, seq_len, micro_batch, dtype of the training problem."""

    @property
    def peak_hbm_bytes(self) -> int:
        return self.weight_bytes + self.ends_bytes + self.activation_bytes + self.cache_bytes

    def validate(self) -> "InferencePlan":
        """Check kinds, signs, the cache (decode only) and the budget; return self.

        Raises:
            PlanValidationError: naming the field and the problem.
        """
        if self.kind not in KINDS or self.weights not in WEIGHT_MODES:
            raise PlanValidationError(f"inference plan: kind {self.kind!r} (one of {KINDS}), "
                                      f"weights {self.weights!r} (one of {WEIGHT_MODES})")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not value >= 0:
                raise PlanValidationError(f"{self.kind} plan: {f.name} = {value} must be >= 0")
        if self.batch < 1 or self.context_tokens < 1:
            raise PlanValidationError(f"{self.kind} plan: batch {self.batch} and "
                                      f"context_tokens {self.context_tokens} must be >= 1")
        if self.kind == "forward" and self.cache_bytes:
            raise PlanValidationError(f"forward plan: cache_bytes = {self.cache_bytes}; a "
                                      f"forward pass keeps no cache")
        if self.weights == "resident" and self.weight_bytes != self.model_weight_bytes:
            raise PlanValidationError(f"{self.kind} plan: resident weight_bytes "
                                      f"{self.weight_bytes} != model_weight_bytes "
                                      f"{self.model_weight_bytes}")
        if self.peak_hbm_bytes > self.hbm_budget_bytes:
            raise PlanValidationError(
                f"{self.kind} plan: {self.peak_hbm_bytes / GB:.3g} GB over the HBM budget "
                f"{self.hbm_budget_bytes / GB:.3g} GB")
        return self

    def summary_line(self) -> str:
        """One line for the plan summary: kind, weight mode and why, HBM, tokens/s."""
        where = ("weights resident in HBM" if self.weights == "resident" else
                 f"weights streamed ({self.model_weight_bytes / GB:.3g} GB of blocks do not "
                 f"fit beside the rest)")
        cache = f", KV cache {self.cache_bytes / GB:.3g} GB" if self.kind == "decode" else ""
        what = "tokens scored" if self.kind == "forward" else "tokens generated"
        rate = f"{self.tokens_per_s:,.0f}" if self.tokens_per_s >= 100 else \
            f"{self.tokens_per_s:.3g}"
        return (f"{self.kind} plan: {where}; {self.batch} x {self.context_tokens} tokens, "
                f"{self.peak_hbm_bytes / GB:.3g} of {self.hbm_budget_bytes / GB:.3g} GB HBM"
                f"{cache}; predicted {rate} {what}/s")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON atomically."""
        return write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "InferencePlan":
        """Read and validate a plan written by `save`.

        Raises:
            FileNotFoundError: no such file.
            PlanValidationError: not JSON, a missing or unknown key, or an invalid plan.
        """
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise PlanValidationError(f"{path} is not an inference plan JSON file ({exc}); "
                                      f"delete it and start the run again") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - names or (names - {"provenance",
                                                                      "cache_bytes"}) - set(raw):
            keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
            raise PlanValidationError(f"{path}: keys {keys} are not an inference plan's "
                                      f"{sorted(names)}; delete it and start the run again")
        return cls(**raw).validate()


def make_inference_plan(problem: PlanningProblem, *, kind: str, kv: KvLayout | None = None,
                        vocab_size: int, hidden_size: int, batch: int | None = None,
                        context_tokens: int | None = None,
                        hbm_bytes_per_s: float = 0.0) -> InferencePlan:
    """The forward or decode plan of a costed training problem (module docstring).

    Args:
        problem: the run's costed problem (per-block ms and bytes of one training
            micro-batch; its `provenance` micro_batch and seq_len).
        kind: "forward" or "decode".
        kv: the cache layout (decode only; `kv_layout`).
        vocab_size, hidden_size: the model's, for the head chunk and the boundaries.
        batch: rows (default EVAL_ROWS).
        context_tokens: tokens per row (default: the problem's seq_len).
        hbm_bytes_per_s: device memory bandwidth, bytes/s (`HardwareSpec.
            hbm_bandwidth_bytes_per_s`): the floor of every block's and the head's time (module
            docstring); 0: no memory floor.

    Raises:
        ValueError: an unknown kind, or decode without `kv`.
        PlanValidationError: even streamed weights do not fit the HBM budget (names the
            shortfall and the fix).
    """
    if kind not in KINDS or (kind == "decode" and kv is None):
        raise ValueError(f"kind: {kind!r} must be one of {KINDS} (decode needs a KvLayout)")
    prov = problem.provenance
    batch = batch or EVAL_ROWS
    context = context_tokens or int(prov.get("seq_len", 1))
    b = _dtype_bytes(problem)
    tokens = batch * context  # a forward batch, or a decode batch's prefill
    chunk = min(tokens, INFERENCE_HEAD_CHUNK_TOKENS)
    # hidden states: a forward pass keeps its batches' (up to INFERENCE_PASS_TOKENS, at least
    # one batch) plus one block output; a prefill its input and output
    hidden = max(tokens, INFERENCE_PASS_TOKENS) + tokens if kind == "forward" else 2 * tokens
    activation = hidden * hidden_size * b + _workspace(problem, tokens) + 8 * chunk * vocab_size
    cache = kv.cache_bytes(batch=batch, context_tokens=context) if kind == "decode" else 0
    ends = problem.ends_params * b
    rest = ends + activation + cache
    model_weights = sum(problem.weight_bytes)
    resident = model_weights + rest <= problem.hbm_bytes
    weights = model_weights if resident else INFERENCE_WEIGHT_SLOTS * max(problem.weight_bytes)
    scale = (batch if kind == "decode" else tokens) / max(problem.tokens_per_micro_batch, 1)
    step = _step_ms(problem, scale=scale, resident=resident, hbm_bytes_per_s=hbm_bytes_per_s,
                    cache_bytes=cache, head_bytes=vocab_size * hidden_size * b)
    made = tokens if kind == "forward" else batch
    plan = InferencePlan(
        kind=kind, weights="resident" if resident else "streamed", batch=batch,
        context_tokens=context, hbm_budget_bytes=problem.hbm_bytes, weight_bytes=weights,
        ends_bytes=ends, activation_bytes=activation, cache_bytes=cache,
        model_weight_bytes=model_weights, step_ms=step,
        tokens_per_s=made * 1000.0 / step if step > 0 else 0.0,
        provenance={k: prov.get(k) for k in ("model_config_sha256", "seq_len", "micro_batch",
                                              "dtype")})
    if plan.peak_hbm_bytes > problem.hbm_bytes:
        short = (plan.peak_hbm_bytes - problem.hbm_bytes) / GB
        raise PlanValidationError(
            f"{kind} plan: {short:.3g} GB over the HBM budget even with streamed weights "
            f"({batch} x {context} tokens, cache {cache / GB:.3g} GB); evaluate fewer rows or "
            f"shorter sequences, or raise hardware.hbm_gb")
    return plan.validate()


def _dtype_bytes(problem: PlanningProblem) -> int:
    """Compute-dtype bytes per parameter: P / params of the first block (2 or 4)."""
    params = problem.params_per_block[0] if problem.params_per_block else 0
    return max(1, round(problem.weight_bytes[0] / params)) if params else 4


def _workspace(problem: PlanningProblem, tokens: int) -> int:
    """One block's transient forward workspace for `tokens` tokens, bytes: the largest
    block's autograd-saved internals of a training micro-batch scaled to `tokens` (an upper
    bound: without autograd the block frees them op by op)."""
    per_token = max(problem.internal_bytes, default=0) / max(problem.tokens_per_micro_batch, 1)
    return int(per_token * tokens)


def _step_ms(problem: PlanningProblem, *, scale: float, resident: bool,
             hbm_bytes_per_s: float, cache_bytes: int, head_bytes: int) -> float:
    """Predicted ms of one pass over the blocks (module docstring), compute scaled by
    `scale` from a training micro-batch; reads of `cache_bytes` (KV cache) and `head_bytes`
    (the head weight) from device memory at `hbm_bytes_per_s` (0: not counted)."""
    def read_ms(nbytes: float) -> float:
        return nbytes / hbm_bytes_per_s * 1000.0 if hbm_bytes_per_s > 0 else 0.0

    total = problem.embed_ms * scale + max(problem.head_ms * HEAD_FORWARD_SHARE * scale,
                                           read_ms(head_bytes))
    kv_share = cache_bytes / max(len(problem.fwd_ms), 1)
    for f, p in zip(problem.fwd_ms, problem.weight_bytes):
        compute = max(f * scale, read_ms(p + kv_share))
        total += problem.window_overhead_ms
        if resident:
            total += compute
            continue
        rates = [problem.h2d_bytes_per_s] + ([problem.host_convert_bytes_per_s]
                                             if problem.host_convert_bytes_per_s > 0 else [])
        load = max(p / r for r in rates) * 1000.0
        total += max(compute, load) if problem.copies_overlap_compute else compute + load
    return total


def make_inference_plans(problem: PlanningProblem, *, model: ModelSpec, hf_config: dict,
                         hbm_bytes_per_s: float = 0.0,
                         batch: int | None = None) -> dict[str, InferencePlan]:
    """Both plans of `model` (`make_inference_plan`, at `hbm_bytes_per_s` bytes/s of device
    memory bandwidth), by kind; each is written beside plan.json as `FILES[kind]`
    (`InferencePlan.save`).

    Args:
        batch: rows of both plans; None: EVAL_ROWS. A GRPO run asks for its rollouts per step
            (every rollout of a step in one generation batch); when that many rows do not fit
            the HBM budget, the rows halve until both plans fit, down to EVAL_ROWS.

    Raises:
        PlanValidationError: a plan does not fit the HBM budget at EVAL_ROWS (or at `batch`
            when that is below EVAL_ROWS) (`make_inference_plan`).
    """
    kv = kv_layout(model, hf_config, dtype_bytes=_dtype_bytes(problem))
    rows = batch or EVAL_ROWS
    while True:
        try:
            return {kind: make_inference_plan(problem, kind=kind, kv=kv,
                                              vocab_size=model.vocab_size,
                                              hidden_size=model.hidden_size, batch=rows,
                                              hbm_bytes_per_s=hbm_bytes_per_s)
                    for kind in KINDS}
        except PlanValidationError:
            if rows <= EVAL_ROWS:
                raise
            rows = max(EVAL_ROWS, rows // 2)


def summary_lines(problem: PlanningProblem, hf_config: dict, *,
                  hbm_bytes_per_s: float = 0.0) -> list[str]:
    """The plan summary's line of each plan kind (`InferencePlan.summary_line`) for the model
    of `hf_config` (a `spec.model.read_hf_config` dict) on `problem`, at `hbm_bytes_per_s`
    bytes/s of device memory bandwidth; one line naming the shortfall instead when a plan
    does not fit even with streamed weights."""
    try:
        plans = make_inference_plans(problem, model=ModelSpec.from_hf_config(hf_config),
                                     hf_config=hf_config, hbm_bytes_per_s=hbm_bytes_per_s)
    except PlanValidationError as exc:
        return [f"evaluation plans: {exc}"]
    return [plan.summary_line() for plan in plans.values()]
