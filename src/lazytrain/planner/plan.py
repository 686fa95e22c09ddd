"""Plan JSON v1: the planner's output and the runtime's only input from the planner.

Owns the `Plan` type (decisions per boundary, keep-internals, resident weights, 8-bit blocks,
transfer-to-window assignment, per-window predictions, solver record, bounds), its JSON round
trip, atomic save/load, and `Plan.validate()`, which checks a plan against the contract in
`docs/execution_model.md` (window order, legal transfer windows, cumulative precedence).

Must not know: any solver, torch, or how a plan was found. `runtime` imports this module.

Index legend: block j = 0..L-1 maps boundary j to boundary j+1; boundary i = 0..L; windows
f0..f{L-1} (ord j), turn (ord L), b{L-1}..b0 (ord 2L - j).

Source: docs/design.md, "The plan"; the meaning of every field is docs/execution_model.md's
(`resident_weights`: "Decisions in a Plan"). Version 1 is extended, never renamed.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lazytrain.atomic import write_text_atomic
from lazytrain.contract import TURN_WINDOW, backward_window, forward_window
from lazytrain.errors import UserError

TIERS = ("hbm", "dram", "nvme", "recompute")
"""Tier vocabulary; a boundary that is not materialized has tier `recompute`."""
OFFLOAD_TIERS = ("dram", "nvme")
"""Tiers whose boundaries leave HBM after the forward and come back before use."""
TRANSFER_KINDS = ("d2h", "h2d", "nvme_write", "nvme_read")
"""Transfer kinds: HBM->DRAM, DRAM->HBM, DRAM->NVMe file, NVMe file->DRAM."""
PLAN_VERSION = 1
FRACTION_TOL = 1e-6
"""Tolerance on sums and cumulative comparisons of transfer fractions (dimensionless)."""


def plan_digest(plan_dict: dict) -> str:
    """16 hex digits of sha256 over a plan's canonical JSON (sorted keys, no spaces): the
    `plan_id` that windows.jsonl records and `lazytrain report` matches against plan.json."""
    text = json.dumps(plan_dict, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PlanValidationError(UserError, ValueError):
    """A plan breaks the execution-model contract; the message names boundary and window."""


# ---------------------------------------------------------------------------------------------
# Windows


def window_names(num_blocks: int) -> list[str]:
    """Window names in execution order: f0..f{L-1}, turn, b{L-1}..b0 (2L+1 names; spelled by
    `lazytrain.contract`, as the engine names the windows it runs)."""
    return [window_name(o, num_blocks) for o in range(2 * num_blocks + 1)]


def window_ord(name: str, num_blocks: int) -> int:
    """Position of a window in execution order: f{j} -> j, turn -> L, b{j} -> 2L - j.

    Raises:
        ValueError: if the name is not a window of an L-block plan.
    """
    L = num_blocks
    if name == TURN_WINDOW:
        return L
    if len(name) >= 2 and name[0] in "fb" and name[1:].isdigit():
        j = int(name[1:])
        if 0 <= j < L and str(j) == name[1:]:
            return j if name[0] == "f" else 2 * L - j
    raise ValueError(f"unknown window {name!r} for {L} blocks; expected f0..f{L - 1}, turn, "
                     f"b{L - 1}..b0")


def window_name(ord_: int, num_blocks: int) -> str:
    """Inverse of `window_ord`.

    Raises:
        ValueError: if `ord_` is outside 0..2L.
    """
    L = num_blocks
    if not 0 <= ord_ <= 2 * L:
        raise ValueError(f"window ord {ord_} outside 0..{2 * L}")
    if ord_ < L:
        return forward_window(ord_)
    if ord_ == L:
        return TURN_WINDOW
    return backward_window(2 * L - ord_)


def use_ord(segment_end: int, num_blocks: int) -> int:
    """ord of b{e-1}, the window where the start of segment (s, e) is first needed: 2L - e + 1."""
    return 2 * num_blocks - segment_end + 1


def legal_ords(kind: str, boundary: int, segment_end: int, num_blocks: int, *,
               drain_windows: int | None, prefetch_windows: int | None,
               nvme_lead_windows: int | None) -> range:
    """Window ords in which a transfer of `kind` for `boundary` may run (the contract's table).

    With `use = 2L - e + 1` (segment (boundary, e)) and H_d, H_p, H_n the horizons:
      d2h:        i <= ord <= i + H_d - 1,          ord < use
      nvme_write: i <= ord <= i + H_d + H_n - 1,    ord < use
      nvme_read:  use - H_p - H_n <= ord <= use - 1  (and ord >= i)
      h2d:        use - H_p <= ord <= use - 1        (and ord >= i)
    A horizon of None means unlimited (only the order constraints i <= ord < use remain).

    Args:
        kind: one of TRANSFER_KINDS.
        boundary: i, 0..L-1.
        segment_end: e, the next materialized boundary after i.
        num_blocks: L.

    Returns:
        range of ords (possibly empty).

    Raises:
        ValueError: unknown kind.

    Source: docs/execution_model.md, "Transfers and their legal windows".
    """
    i = boundary
    use = use_ord(segment_end, num_blocks)
    h_d, h_p, h_n = drain_windows, prefetch_windows, nvme_lead_windows
    if kind == "d2h":
        hi = use - 1 if h_d is None else min(use - 1, i + h_d - 1)
        return range(i, hi + 1)
    if kind == "nvme_write":
        hi = use - 1 if h_d is None or h_n is None else min(use - 1, i + h_d + h_n - 1)
        return range(i, hi + 1)
    if kind == "nvme_read":
        lo = i if h_p is None or h_n is None else max(i, use - h_p - h_n)
        return range(lo, use)
    if kind == "h2d":
        lo = i if h_p is None else max(i, use - h_p)
        return range(lo, use)
    raise ValueError(f"unknown transfer kind {kind!r}; expected one of {TRANSFER_KINDS}")


# ---------------------------------------------------------------------------------------------
# Records


@dataclass(kw_only=True, frozen=True, slots=True)
class Transfer:
    """Move `fraction` of boundary `boundary`'s bytes A[i] by `kind` during window `window`."""

    boundary: int
    kind: str
    window: str
    fraction: float


@dataclass(kw_only=True, frozen=True, slots=True)
class WindowRecord:
    """Predicted work and time of one window (bytes, ms); see docs/execution_model.md."""

    name: str
    compute_ms: float
    h2d_bytes: float
    d2h_bytes: float
    nvme_read_bytes: float
    nvme_write_bytes: float
    time_ms: float
    exposed_ms: float
    hbm_checkpoint_bytes: float
    """Peak bytes of boundary tensors the checkpoint store holds in HBM during the window."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SolveRecord:
    """How the plan was found (Plan JSON `solver`)."""

    backend: str
    """scip | highs | heuristic | megatrain | uniform | ideal | manual."""
    status: str = "ok"
    solve_s: float = 0.0
    gap: float | None = None
    num_vars: int = 0
    num_rows: int = 0


@dataclass(kw_only=True, frozen=True, slots=True)
class Bounds:
    """Lower bounds and reference step times, ms (None: not computed or no plan fits).

    One line each (`planner/bounds.py`): `lp_step_ms` the MILP's LP relaxation with the budgets
    (a bound on every plan that fits); `memory_step_ms` closed form with keep-internals limited
    by the HBM budget (a bound on every plan that fits HBM); `roofline_step_ms` closed form with
    infinite HBM (a bound, usually far from reachable); `ideal_step_ms` the infinite-HBM plan's
    step (a reference, not a bound)."""

    lp_step_ms: float | None = None
    memory_step_ms: float | None = None
    roofline_step_ms: float | None = None
    ideal_step_ms: float | None = None


@dataclass(kw_only=True, frozen=True, slots=True)
class Predicted:
    """Predicted step performance (ms, TFLOP/s, tokens/s, bytes)."""

    step_ms: float
    model_tflops: float
    hardware_tflops: float
    tokens_per_s: float
    peak_hbm_bytes: float
    dram_bytes: float
    nvme_bytes: float
    q8_param_fraction: float = 0.0
    """Fraction of all trainable parameters (blocks and ends) whose Adam moments are 8-bit
    (the blocks in `q8_blocks`); 0 for plans written before this field."""
    pinned_bytes: float = 0.0
    """Page-locked host bytes the runtime holds at the peak, at most: DRAM-tier checkpoints,
    staging pools, the NVMe bounce buffers any legal schedule of the tiers may hold at once;
    0 for plans written before this field."""


# ---------------------------------------------------------------------------------------------
# Plan


@dataclass(kw_only=True, frozen=True, slots=True)
class Plan:
    """One activation-placement plan for L blocks (Plan JSON v1 + `resident_weights`).

    `tiers[i]` for boundaries i = 0..L (JSON: "boundaries"); `keep_internals`,
    `resident_weights`, `q8_blocks` are sorted block indices; `windows` follow
    `window_names(L)`; `transfers` are sorted by (window ord, boundary, kind).
    Construct through `lazytrain.planner.evaluate.build_plan` or `Plan.from_dict`.
    """

    version: int = PLAN_VERSION
    provenance: dict = field(default_factory=dict)
    tiers: tuple[str, ...]
    keep_internals: tuple[int, ...] = ()
    resident_weights: tuple[int, ...] = ()
    q8_blocks: tuple[int, ...] = ()
    windows: tuple[WindowRecord, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    predicted: Predicted | None = None
    solver: SolveRecord | None = None
    bounds: Bounds = field(default_factory=Bounds)

    # --- structure ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """L."""
        return len(self.tiers) - 1

    def is_materialized(self, i: int) -> bool:
        """True iff boundary i's tier is not `recompute` (boundary 0 is a segment start anyway)."""
        return self.tiers[i] != "recompute"

    def segments(self) -> list[tuple[int, int]]:
        """Segments (s, e) in forward order: consecutive segment starts, boundary 0 included."""
        starts = [0] + [i for i in range(1, self.num_blocks + 1) if self.is_materialized(i)]
        return list(zip(starts[:-1], starts[1:]))

    def segments_backward(self) -> list[tuple[int, int]]:
        """Segments in backward (execution) order: the last segment first."""
        return self.segments()[::-1]

    def segment_end_of(self, i: int) -> int:
        """e of the segment containing boundary i < L: the first materialized boundary > i."""
        for e in range(i + 1, self.num_blocks + 1):
            if self.is_materialized(e):
                return e
        raise ValueError(f"boundary {i} has no later materialized boundary (L={self.num_blocks})")

    def transfers_in(self, window: str) -> list[Transfer]:
        """Transfers the plan issues in `window`, in plan order."""
        return [t for t in self.transfers if t.window == window]

    def window(self, name: str) -> WindowRecord:
        """The predicted record of window `name`.

        Raises:
            KeyError: no such window in the plan.
        """
        for w in self.windows:
            if w.name == name:
                return w
        raise KeyError(f"plan has no window {name!r}")

    def horizons(self) -> dict:
        """{drain_windows, prefetch_windows, nvme_lead_windows} from provenance (None: unlimited)."""
        h = self.provenance.get("horizons") or {}
        return {k: h.get(k) for k in ("drain_windows", "prefetch_windows", "nvme_lead_windows")}

    # --- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The Plan JSON v1 object (plain dicts and lists, keys in a fixed order)."""
        return {
            "version": self.version,
            "provenance": self.provenance,
            "boundaries": [{"index": i, "tier": t} for i, t in enumerate(self.tiers)],
            "keep_internals": list(self.keep_internals),
            "resident_weights": list(self.resident_weights),
            "q8_blocks": list(self.q8_blocks),
            "windows": [asdict(w) for w in self.windows],
            "transfers": [asdict(t) for t in self.transfers],
            "predicted": None if self.predicted is None else asdict(self.predicted),
            "solver": None if self.solver is None else asdict(self.solver),
            "bounds": asdict(self.bounds),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Parse a Plan JSON v1 object. Unknown top-level keys are ignored (extensions).

        `resident_weights` defaults to `keep_internals` for plans written without the extension.

        Raises:
            PlanValidationError: missing or malformed keys, a non-int index or version (2.7,
                true, "1": never truncated or converted), a provenance that is not an object
                (the plan is not validated here).
        """
        try:
            bounds = sorted(d["boundaries"], key=lambda b: _int(b["index"], "boundary index"))
            if [b["index"] for b in bounds] != list(range(len(bounds))):
                raise PlanValidationError("boundaries must list every index 0..L once")
            keep = tuple(_int(j, "keep_internals") for j in d.get("keep_internals", ()))
            resident = d.get("resident_weights")
            provenance = d.get("provenance") or {}
            if not isinstance(provenance, dict):
                raise PlanValidationError(f"plan provenance must be a JSON object; got "
                                          f"{type(provenance).__name__}")
            return cls(
                version=_int(d["version"], "version"),
                provenance=dict(provenance),
                tiers=tuple(str(b["tier"]) for b in bounds),
                keep_internals=keep,
                resident_weights=keep if resident is None else tuple(
                    _int(j, "resident_weights") for j in resident),
                q8_blocks=tuple(_int(j, "q8_blocks") for j in d.get("q8_blocks", ())),
                windows=tuple(WindowRecord(**w) for w in d.get("windows", ())),
                transfers=tuple(Transfer(boundary=_int(t["boundary"], "transfer boundary"),
                                         kind=str(t["kind"]),
                                         window=str(t["window"]), fraction=float(t["fraction"]))
                                for t in d.get("transfers", ())),
                predicted=None if d.get("predicted") is None else Predicted(**d["predicted"]),
                solver=None if d.get("solver") is None else SolveRecord(**d["solver"]),
                bounds=Bounds(**(d.get("bounds") or {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PlanValidationError):
                raise
            raise PlanValidationError(f"malformed plan JSON: {exc!r}") from exc

    def digest(self) -> str:
        """`plan_digest` of this plan (same value as for its saved JSON)."""
        return plan_digest(self.to_dict())

    def to_json(self, *, indent: int | None = 1) -> str:
        """JSON text of `to_dict()`."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON atomically (lazytrain.atomic: temp file, fsync, rename)."""
        return write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by `save` (not validated; call `validate()`).

        Raises:
            FileNotFoundError: no such file (the message names the path).
            PlanValidationError: the file is not JSON, or not a Plan JSON object.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"plan file {path} does not exist; write one with "
                                    f"`lazytrain plan --out {path}`")
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise PlanValidationError(f"{path} is not a plan JSON file ({exc}); give the file "
                                      f"`lazytrain plan --out` wrote") from None
        if not isinstance(raw, dict):
            raise PlanValidationError(f"{path} is not a plan JSON object; give the file "
                                      f"`lazytrain plan --out` wrote")
        return cls.from_dict(raw)

    # --- checks ------------------------------------------------------------------------------

    def check_matches(self, *, model_config_sha256: str | None = None, seq_len: int | None = None,
                      micro_batch: int | None = None) -> None:
        """Refuse a plan made for another model, sequence length or micro-batch.

        Raises:
            PlanValidationError: naming the provenance field, the plan's value and the asked one.
        """
        asked = {"model_config_sha256": model_config_sha256, "seq_len": seq_len,
                 "micro_batch": micro_batch}
        for key, value in asked.items():
            if value is None:
                continue
            have = self.provenance.get(key)
            if have != value:
                raise PlanValidationError(
                    f"plan provenance {key}={have!r} does not match the run's {key}={value!r}; "
                    f"re-plan with `lazytrain plan` for this run")

    def validate(self) -> "Plan":
        """Check the plan against docs/execution_model.md; return self when it is consistent.

        Raises:
            PlanValidationError: naming the boundary and window of the first inconsistency.
        """
        _check_provenance(self)
        _check_structure(self)
        _check_numbers(self)
        _check_transfers(self)
        return self


# ---------------------------------------------------------------------------------------------
# Validation helpers (one concern each; messages name boundary and window)


def _fail(msg: str) -> None:
    raise PlanValidationError(msg)


def _int(value, what: str) -> int:
    """`value` if it is an int (not a bool), else PlanValidationError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(f"{what} must be an integer; got {value!r} ({type(value).__name__})")
    return int(value)


def _is_count(value, minimum: int) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral)
            and value >= minimum)


def _check_provenance(plan: Plan) -> None:
    """Types of the provenance fields validation reads: k_max int >= 1, horizons an object of
    ints (drain, prefetch >= 1; nvme lead >= 0) or nulls (unlimited)."""
    prov = plan.provenance
    if not isinstance(prov, dict):
        _fail(f"plan provenance must be an object; got {type(prov).__name__}")
    horizons = prov.get("horizons")
    if horizons is not None and not isinstance(horizons, dict):
        _fail(f"provenance horizons must be an object; got {horizons!r}")
    horizons = horizons or {}
    for where, key, minimum in (("provenance", "k_max", 1),
                                ("provenance horizons", "k_max", 1),
                                ("provenance horizons", "drain_windows", 1),
                                ("provenance horizons", "prefetch_windows", 1),
                                ("provenance horizons", "nvme_lead_windows", 0)):
        value = (prov if where == "provenance" else horizons).get(key)
        if value is not None and not _is_count(value, minimum):
            _fail(f"{where} {key} must be an integer >= {minimum} (or null); got {value!r}")


def _check_numbers(plan: Plan) -> None:
    """Every window record figure and predicted figure is a finite number >= 0 (the engine
    uses `hbm_checkpoint_bytes` as a hard limit: NaN would switch the check off, a negative
    one fail it mid-step)."""
    records = [(f"window {w.name}", w) for w in plan.windows]
    if plan.predicted is not None:
        records.append(("predicted", plan.predicted))
    for where, rec in records:
        for key, value in asdict(rec).items():
            if key == "name":
                continue
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not math.isfinite(value) or value < 0):
                _fail(f"{where}: {key} must be a finite number >= 0; got {value!r}")


def _check_structure(plan: Plan) -> None:
    """Version, tier vocabulary, tier[L], windows, keep/resident/q8 indices, k_max."""
    if plan.version != PLAN_VERSION:
        _fail(f"plan version {plan.version!r} is not supported; expected {PLAN_VERSION}")
    L = plan.num_blocks
    if L < 1:
        _fail(f"plan needs boundaries 0..L with L >= 1; got {len(plan.tiers)} boundaries")
    for i, t in enumerate(plan.tiers):
        if t not in TIERS:
            _fail(f"boundary {i}: tier {t!r} is not one of {TIERS}")
    if plan.tiers[L] != "hbm":
        _fail(f"boundary {L}: the last boundary (head input) must be hbm; got {plan.tiers[L]!r}")
    names = [w.name for w in plan.windows]
    expected = window_names(L)
    if names != expected:
        bad = next((k for k, (a, b) in enumerate(zip(names, expected)) if a != b),
                   min(len(names), len(expected)))
        got = names[bad] if bad < len(names) else "<missing>"
        want = expected[bad] if bad < len(expected) else "<none>"
        _fail(f"windows must be {expected[0]}..{expected[-1]} in execution order ({len(expected)}"
              f" windows); position {bad} holds {got!r}, expected {want!r}")
    for label, blocks in (("keep_internals", plan.keep_internals),
                          ("resident_weights", plan.resident_weights),
                          ("q8_blocks", plan.q8_blocks)):
        for j in blocks:
            if not 0 <= j < L:
                _fail(f"{label}: block {j} outside 0..{L - 1}")
        if len(set(blocks)) != len(blocks):
            _fail(f"{label}: duplicate block indices {sorted(blocks)}")
    resident = set(plan.resident_weights)
    for j in plan.keep_internals:
        if j not in resident:
            _fail(f"block {j}: keep_internals without resident weights (window b{j} would "
                  f"run on a weight buffer reused since f{j}); add {j} to resident_weights")
        if not plan.is_materialized(j + 1):
            _fail(f"block {j}: keep_internals needs boundary {j + 1} materialized (a kept block"
                  f" ends its segment); boundary {j + 1} is recompute")
    k_max = plan.provenance.get("k_max", (plan.provenance.get("horizons") or {}).get("k_max"))
    if k_max is not None:
        for s, e in plan.segments():
            if e - s > k_max:
                _fail(f"segment ({s}, {e}) spans {e - s} blocks > k_max={k_max} "
                      f"(recomputed in window b{e - 1})")


def _required_kinds(tier: str) -> tuple[str, ...]:
    return {"dram": ("d2h", "h2d"), "nvme": TRANSFER_KINDS}.get(tier, ())


def _check_transfers(plan: Plan) -> None:
    """Legal windows, totals of 1 per (boundary, kind), cumulative precedence."""
    L = plan.num_blocks
    hz = plan.horizons()
    # by (boundary, kind): {ord: fraction}
    table: dict[tuple[int, str], dict[int, float]] = {}
    for t in plan.transfers:
        if not 0 <= t.boundary <= L:
            _fail(f"boundary {t.boundary}: transfer in window {t.window} names a boundary "
                  f"outside 0..{L}")
        tier = plan.tiers[t.boundary]
        if t.kind not in TRANSFER_KINDS:
            _fail(f"boundary {t.boundary}: transfer kind {t.kind!r} in window {t.window} is not "
                  f"one of {TRANSFER_KINDS}")
        if t.kind not in _required_kinds(tier):
            _fail(f"boundary {t.boundary}: {t.kind} in window {t.window} but the boundary's tier"
                  f" is {tier} (which has no {t.kind} transfers)")
        try:
            o = window_ord(t.window, L)
        except ValueError as exc:
            raise PlanValidationError(f"boundary {t.boundary}: {t.kind} names {exc}") from None
        if not (t.fraction > 0.0 and t.fraction <= 1.0 + FRACTION_TOL):
            _fail(f"boundary {t.boundary}: {t.kind} in window {t.window} has fraction "
                  f"{t.fraction!r}; expected 0 < fraction <= 1")
        e = plan.segment_end_of(t.boundary)
        legal = legal_ords(t.kind, t.boundary, e, L, **hz)
        if o not in legal:
            span = (f"{window_name(legal[0], L)}..{window_name(legal[-1], L)}" if len(legal)
                    else "none")
            _fail(f"boundary {t.boundary}: {t.kind} in window {t.window} is outside its legal "
                  f"windows ({span}; segment ({t.boundary}, {e}) first needs it in b{e - 1})")
        cell = table.setdefault((t.boundary, t.kind), {})
        cell[o] = cell.get(o, 0.0) + t.fraction
    for i, tier in enumerate(plan.tiers):
        for kind in _required_kinds(tier):
            total = sum(table.get((i, kind), {}).values())
            if abs(total - 1.0) > FRACTION_TOL:
                _fail(f"boundary {i}: {kind} fractions of this {tier} checkpoint sum to "
                      f"{total:.6f}; expected 1 (windows "
                      f"{[window_name(o, L) for o in sorted(table.get((i, kind), {}))]})")
        if tier in OFFLOAD_TIERS:
            _check_precedence(plan, i, tier, table)


def _check_precedence(plan: Plan, i: int, tier: str,
                      table: dict[tuple[int, str], dict[int, float]]) -> None:
    """cum nvme_write <= cum d2h; cum nvme_read <= cum nvme_write; cum h2d <= cum source."""
    L = plan.num_blocks
    rules = [("h2d", "d2h" if tier == "dram" else "nvme_read", "sends",
              "drained to DRAM" if tier == "dram" else "read back from NVMe")]
    if tier == "nvme":
        rules = [("nvme_write", "d2h", "writes", "staged in DRAM"),
                 ("nvme_read", "nvme_write", "reads", "written")] + rules
    for kind, src, verb, have in rules:
        dst, srcs = table.get((i, kind), {}), table.get((i, src), {})
        cum_dst = cum_src = 0.0
        for o in sorted(set(dst) | set(srcs)):
            cum_dst += dst.get(o, 0.0)
            cum_src += srcs.get(o, 0.0)
            if cum_dst > cum_src + FRACTION_TOL:
                _fail(f"boundary {i}: {kind} in window {window_name(o, L)} {verb} "
                      f"{cum_dst:.2f} of the checkpoint but only {cum_src:.2f} has been "
                      f"{have} by then")
