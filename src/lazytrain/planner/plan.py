"""Plan JSON v1: the planner's output and the runtime's only input from the planner.

Owns the `Plan` type (decisions per boundary, keep-internals, resident weights, 8-bit blocks,
save levels and their internals' tiers and transfers, transfer-to-window assignment, per-window
predictions, solver record, bounds), its JSON round trip, atomic save/load, and
`Plan.validate()`, which checks a plan against the contract in `docs/execution_model.md` (window
order, legal transfer windows, cumulative precedence, save levels; the checks are
`planner/plan_checks.py`'s, the window index `planner/windows.py`'s).

Must not know: any solver, torch, or how a plan was found. `runtime` imports this module.

Index legend: block j = 0..L-1 maps boundary j to boundary j+1; boundary i = 0..L; windows
f0..f{L-1} (ord j), turn (ord L), b{L-1}..b0 (ord 2L - j).

Source: docs/design.md, "The plan"; the meaning of every field is docs/execution_model.md's
(`resident_weights`: "Decisions in a Plan"; `save_levels`, `saved_tiers`, `internal_transfers`,
`WindowRecord.hbm_saved_bytes`: "Save levels"). Version 1 is extended, never renamed: an
optional field is written only when it holds something, so a plan without it keeps its digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lazytrain.atomic import write_text_atomic
from lazytrain.planner.plan_checks import PLAN_VERSION, PlanValidationError, as_int, check_plan


def _window_dict(w: "WindowRecord") -> dict:
    """A window record's JSON object; `hbm_saved_bytes` only when nonzero (old digests hold)."""
    out = asdict(w)
    if not out["hbm_saved_bytes"]:
        del out["hbm_saved_bytes"]
    return out


def plan_digest(plan_dict: dict) -> str:
    """16 hex digits of sha256 over a plan's canonical JSON (sorted keys, no spaces): the
    `plan_id` that windows.jsonl records and `lazytrain report` matches against plan.json."""
    text = json.dumps(plan_dict, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
class InternalTransfer:
    """Move `fraction` of block `block`'s saved internals (S1[j] at L1, S2[j] at L2, bytes) by
    `kind` ("d2h" | "h2d") during window `window` (a dram-tier block only)."""

    block: int
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
    """Peak bytes of boundary tensors the activation store holds in HBM during the window."""
    hbm_saved_bytes: float = 0.0
    """Bytes of L1/L2 blocks' saved internals held in HBM during the window (hbm tier from f{j}
    to b{j}; dram tier until its last d2h and from its first h2d); 0 for plans written before
    this field (JSON: absent when 0)."""


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
    weight_paths: tuple[str, ...] = ()
    """How each block's weights reach the device, one per block (`lazytrain.contract`
    `WEIGHT_PATH_NAMES`); empty (JSON: absent): every block host_convert."""
    save_levels: tuple[str, ...] = ()
    """What each block keeps from f{j} for b{j}, one of `SAVE_LEVELS` per block; empty (JSON:
    absent; plans written before the field and the MegaTrain rule as published): every block
    L0 with the full re-forward."""
    saved_tiers: tuple[str, ...] = ()
    """Where each block's saved internals wait, one of `SAVED_TIERS` per block ("none" for L0
    and kept blocks); empty exactly when `save_levels` is."""
    internal_transfers: tuple[InternalTransfer, ...] = ()
    """D2H/H2D of dram-tier blocks' saved internals, sorted by (window ord, block, kind)."""
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

    def path_of(self, j: int) -> str:
        """Block j's weight path ("host_convert" when the plan has none)."""
        return self.weight_paths[j] if self.weight_paths else "host_convert"

    @property
    def reforwards_in_full(self) -> bool:
        """True when the plan gives no save levels: every block's b{j} re-forwards it in full
        (Fr = Fg; plans written before `save_levels` and the MegaTrain rule as published)."""
        return not self.save_levels

    def level_of(self, j: int) -> str:
        """Block j's save level ("L0" when the plan has none; see `reforwards_in_full`)."""
        return self.save_levels[j] if self.save_levels else "L0"

    def saved_tier_of(self, j: int) -> str:
        """Where block j's saved internals wait ("none" when the plan has no save levels)."""
        return self.saved_tiers[j] if self.saved_tiers else "none"

    def saved_blocks(self) -> list[int]:
        """Blocks at L1 or L2 (whose f{j} runs with autograd and saves internals), ascending."""
        return [j for j, level in enumerate(self.save_levels) if level != "L0"]

    def internal_transfers_in(self, window: str) -> list[InternalTransfer]:
        """Saved-internals transfers the plan issues in `window`, in plan order."""
        return [t for t in self.internal_transfers if t.window == window]

    def internal_transfers_of(self, j: int) -> list[InternalTransfer]:
        """Saved-internals transfers of block j, in plan order."""
        return [t for t in self.internal_transfers if t.block == j]

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
            **({"weight_paths": list(self.weight_paths)} if self.weight_paths else {}),
            **({"save_levels": list(self.save_levels)} if self.save_levels else {}),
            **({"saved_tiers": list(self.saved_tiers)} if self.saved_tiers else {}),
            **({"internal_transfers": [asdict(t) for t in self.internal_transfers]}
               if self.internal_transfers else {}),
            "windows": [_window_dict(w) for w in self.windows],
            "transfers": [asdict(t) for t in self.transfers],
            "predicted": None if self.predicted is None else asdict(self.predicted),
            "solver": None if self.solver is None else asdict(self.solver),
            "bounds": asdict(self.bounds),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Parse a Plan JSON v1 object. Unknown top-level keys are ignored (extensions).

        `resident_weights` defaults to `keep_internals` for plans written without the extension;
        `save_levels`, `saved_tiers`, `internal_transfers` default to empty and
        `hbm_saved_bytes` to 0.

        Raises:
            PlanValidationError: missing or malformed keys, a non-int index or version (2.7,
                true, "1": never truncated or converted), a provenance that is not an object
                (the plan is not validated here).
        """
        try:
            bounds = sorted(d["boundaries"], key=lambda b: as_int(b["index"], "boundary index"))
            if [b["index"] for b in bounds] != list(range(len(bounds))):
                raise PlanValidationError("boundaries must list every index 0..L once")
            keep = tuple(as_int(j, "keep_internals") for j in d.get("keep_internals", ()))
            resident = d.get("resident_weights")
            provenance = d.get("provenance") or {}
            if not isinstance(provenance, dict):
                raise PlanValidationError(f"plan provenance must be a JSON object; got "
                                          f"{type(provenance).__name__}")
            return cls(
                version=as_int(d["version"], "version"),
                provenance=dict(provenance),
                tiers=tuple(str(b["tier"]) for b in bounds),
                keep_internals=keep,
                resident_weights=keep if resident is None else tuple(
                    as_int(j, "resident_weights") for j in resident),
                q8_blocks=tuple(as_int(j, "q8_blocks") for j in d.get("q8_blocks", ())),
                weight_paths=tuple(str(w) for w in d.get("weight_paths") or ()),
                save_levels=tuple(str(v) for v in d.get("save_levels") or ()),
                saved_tiers=tuple(str(v) for v in d.get("saved_tiers") or ()),
                internal_transfers=tuple(
                    InternalTransfer(block=as_int(t["block"], "internal transfer block"),
                                     kind=str(t["kind"]), window=str(t["window"]),
                                     fraction=float(t["fraction"]))
                    for t in d.get("internal_transfers") or ()),
                windows=tuple(WindowRecord(**w) for w in d.get("windows", ())),
                transfers=tuple(Transfer(boundary=as_int(t["boundary"], "transfer boundary"),
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
        check_plan(self)
        return self
