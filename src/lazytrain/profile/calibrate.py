"""The calibration cache: this machine's measured cost profile, measured once and reused.

Where a plan's costs come from, decided in one place (`resolve_profile`) for `lazytrain train`,
`lazytrain plan` and `lazytrain simulate`, so that they agree on the plan:

1. `hardware.profile_path` set: that measured profile (`lazytrain profile` wrote it).
2. `runtime.calibrate: auto` (the default) and the plan is for this machine: the cached
   calibration of this machine, measured on a cache miss by the caller's `measure` function
   (`lazytrain train` passes `train.setup.measure_calibration` in its quick mode, a few
   seconds, on a model cut to one block of each kind: host memory never holds the whole
   model; `lazytrain plan` passes none and plans analytic until one is cached).
3. Otherwise the analytic model of the hardware preset.

"For this machine": `runtime.device` resolves to the device this process runs on (auto: cuda
when torch sees one, else cpu; cpu-checked and cpu-threaded are the cpu) and the preset
describes it: `cpu` on a CPU; on CUDA a GPU preset whose model matches the device's name
(`preset_describes_gpu`: h100-pcie on "NVIDIA H100 PCIe", h200 on "NVIDIA H200"). A plan for
another machine (h100-sxm on a CPU box) never reads this machine's calibration.

Cache: one JSON file per key in `runtime.calibration_dir` (empty:
`$XDG_CACHE_HOME/lazytrain/calibration`, else `~/.cache/lazytrain/calibration`), named
`calibration-<first 16 hex of the key>.json`. The key is the sha256 of `KEY_FIELDS` (CPU
model, GPU name, torch version, model architecture hash, batch shape, dtypes, thread counts);
the file is the profile (`lazytrain.spec.costs` schema) plus a `calibration` record holding the
fields, the key and the measurement time. An entry whose stored fields differ from the current
ones is measured again (a torch upgrade, another micro-batch); an unreadable or malformed one
too, with a one-line warning. Files are written atomically (`lazytrain.atomic`).

A calibration measured under load: the quick profile takes each block and end time as the
least of its repeats and measures it again when the repeats spread widely or other processes
loaded the CPUs meanwhile (`runtime.steady`); and at the end of a run its own measured windows
replace an entry they contradict by more than `planner.drift_threshold`
(`lazytrain.train.recalibrate`), so one disturbed calibration misleads one run, not every
later one.

The environment variable `LAZYTRAIN_CALIBRATE=off` overrides `runtime.calibrate: auto` (the
test suite sets it, so no test writes to the user's cache unless it asks to).

Never imports torch: the device, the torch version and thread count come from
`profile.machine` (torch's own answers where the process loaded it, as `train` has; read from
the install and the OS where not, as `plan` has). `costed_problem` turns a config and these
costs into the node's `PlanningProblem`, the one place `train`, `plan` and `simulate` get it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lazytrain import __version__
from lazytrain.atomic import write_json_atomic
from lazytrain.config import RunConfig
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.problem import PlanningProblem
from lazytrain.profile import machine
from lazytrain.spec.hardware import PRESETS
from lazytrain.spec.model import ModelSpec

CALIBRATE_ENV = "LAZYTRAIN_CALIBRATE"
"""Environment variable: `off` overrides `runtime.calibrate: auto` (tests, CI); `auto` or
unset: the config decides."""
CACHE_VERSION = 1
"""Version of the cache file's `calibration` record (a new version re-measures)."""
KEY_FIELDS = ("cpu_model", "gpu_name", "torch_version", "model_config_sha256", "micro_batch",
              "seq_len", "compute_dtype", "master_dtype", "torch_threads", "io_threads")
"""What a calibration depends on; any change measures a new one."""
PROFILE_TIME_KEYS = ("fwd_ms", "fwd_grad_ms", "bwd_ms")
"""Per block kind, the times a cached profile must hold to be used."""
BUSY_LOAD_PER_CPU = 0.5
"""A 1-minute load average above this many runnable tasks per CPU, just before measuring,
means other jobs compete for the cores: the calibration is kept but a warning says its times
may be high (on the 2-core CI box, quick-mode block times measured 3-17x the idle ones at a
load of 2-3). So does a block or end time still disturbed after its last try
(`runtime.steady`). Either way the run's own windows replace a calibration they contradict
(`lazytrain.train.recalibrate`)."""

Measure = Callable[[RunConfig, str], dict]
"""`measure(cfg, device)`: a profile dict for `cfg` on `device` ("cpu" | "cuda")."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ResolvedCosts:
    """Where a plan's costs come from, and the config to plan with."""

    config: RunConfig
    """The run config to build the problem from: `hardware.profile_path` names the cache file
    when calibrated, else as given."""
    source: str
    """"calibrated" (this machine's cache), "profile" (`hardware.profile_path`) or
    "analytic" (the hardware preset)."""
    path: str = ""
    """The cache file or the profile, empty for analytic."""
    measured_at: str = ""
    """UTC time the calibration was measured (ISO 8601), empty unless calibrated."""
    note: str = ""
    """Why analytic costs were used where a calibration could have been, empty otherwise."""

    def line(self) -> str:
        """The one line `plan` and `train` print: where the costs came from."""
        return costs_line(self.record())

    def record(self) -> dict:
        """The plan provenance's `costs` entry (JSON-able)."""
        return {"source": self.source, "file": self.path, "measured_at": self.measured_at,
                "preset": self.config.hardware.preset, "note": self.note}

    def annotate(self, problem: Any) -> Any:
        """`problem` (a `PlanningProblem`) with this record as `provenance["costs"]`, which
        every plan made from it carries."""
        return dataclasses.replace(problem, provenance={**problem.provenance,
                                                        "costs": self.record()})


def costs_line(record: dict) -> str:
    """`costs: calibrated on this machine (cache FILE, measured DATE)` / `costs: measured profile
    FILE` / `costs: analytic (hardware preset NAME)` (+ `; note`), from a provenance record."""
    source = record.get("source")
    if source == "calibrated":
        return (f"costs: calibrated on this machine (cache {record.get('file')}, measured "
                f"{record.get('measured_at')})")
    if source == "profile":
        return f"costs: measured profile {record.get('file')}"
    note = record.get("note")
    return f"costs: analytic (hardware preset {record.get('preset')})" + (f"; {note}" if note
                                                                          else "")


def costs_line_of(provenance: dict) -> str:
    """The costs line of a plan's provenance; plans made before the `costs` entry existed are
    described from their `costs_source` ("analytic" or "profile:FILE")."""
    if provenance.get("costs"):
        return costs_line(provenance["costs"])
    source = str(provenance.get("costs_source") or "analytic")
    if source.startswith("profile:"):
        return costs_line({"source": "profile", "file": source[len("profile:"):]})
    return costs_line({"source": "analytic", "preset": provenance.get("hardware", "?")})


def calibration_mode(cfg: RunConfig) -> str:
    """`runtime.calibrate`, with `LAZYTRAIN_CALIBRATE=off` overriding auto.

    Raises:
        ValueError: the environment variable holds something other than auto or off.
    """
    env = os.environ.get(CALIBRATE_ENV, "").strip().lower()
    if env not in ("", "auto", "off"):
        raise ValueError(f"{CALIBRATE_ENV}: {env!r} is not auto or off; unset it or set off")
    return "off" if env == "off" else cfg.runtime.calibrate


def calibration_dir(cfg: RunConfig) -> Path:
    """The cache directory: `runtime.calibration_dir`, else `$XDG_CACHE_HOME/lazytrain/
    calibration`, else `~/.cache/lazytrain/calibration`."""
    if cfg.runtime.calibration_dir:
        return Path(cfg.runtime.calibration_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lazytrain" / "calibration"


def local_device(choice: str) -> str | None:
    """The torch device type `runtime.device` runs on in this process ("cpu" | "cuda"), or None
    when it names a CUDA device this process does not have."""
    if choice in ("cpu", "cpu-checked", "cpu-threaded"):
        return "cpu"
    if choice == "auto":
        return "cuda" if machine.cuda_available() else "cpu"
    return "cuda" if machine.cuda_available() else None


def gpu_name(device: str) -> str:
    """`torch.cuda.get_device_name()` on CUDA, "none" on the CPU."""
    if device != "cuda":
        return "none"
    return machine.cuda_device_name()


def preset_describes_gpu(preset: str, name: str) -> bool:
    """Whether GPU preset `preset` (a `PRESETS` key) is the GPU called `name`.

    The preset's model (h100, a100, 4090 of rtx-4090) must appear in the name; a -pcie preset
    needs "PCIe" in it and an -sxm preset its absence (CUDA names the PCIe cards so: "NVIDIA
    H100 PCIe" vs "NVIDIA H100 80GB HBM3").
    """
    if preset not in PRESETS or preset == "cpu":
        return False
    flat = name.lower().replace(" ", "").replace("-", "")
    parts = preset.split("-")
    model = parts[1] if parts[0] == "rtx" else parts[0]
    if model not in flat:
        return False
    if "pcie" in parts:
        return "pcie" in flat
    return "sxm" not in parts or "pcie" not in flat


def machine_device(cfg: RunConfig) -> str | None:
    """The device ("cpu" | "cuda") when `cfg` plans for this machine (module docstring), else
    None. A preset that is a hardware file is never assumed to be this machine."""
    preset = cfg.hardware.preset
    if preset not in PRESETS:
        return None
    if preset != "cpu" and cfg.runtime.device in ("cpu", "cpu-checked", "cpu-threaded"):
        return None  # a GPU preset planned on the CPU backends: another machine
    device = local_device(cfg.runtime.device)
    if device == "cpu":
        return "cpu" if preset == "cpu" else None
    if device == "cuda" and preset_describes_gpu(preset, gpu_name("cuda")):
        return "cuda"
    return None


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo `model name`, else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def key_fields(cfg: RunConfig, *, device: str) -> dict:
    """The cache key's fields for `cfg` on `device` (`KEY_FIELDS`, in that order)."""
    t = cfg.train
    spec = ModelSpec.from_hf_config(cfg.model.config_path, name=cfg.model.name)
    return {"cpu_model": cpu_model(), "gpu_name": gpu_name(device),
            "torch_version": machine.torch_version(), "model_config_sha256": spec.config_sha256,
            "micro_batch": t.micro_batch, "seq_len": cfg.data.seq_len,
            "compute_dtype": t.compute_dtype, "master_dtype": t.master_dtype,
            "torch_threads": cfg.runtime.threads or machine.torch_threads(),
            "io_threads": cfg.runtime.io_threads}


def cache_key(fields: dict) -> str:
    """sha256 (hex) of the key fields, as canonical JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def cache_file(cfg: RunConfig, fields: dict) -> Path:
    """Where the calibration for `fields` lives."""
    return calibration_dir(cfg) / f"calibration-{cache_key(fields)[:16]}.json"


def read_cache(path: Path, fields: dict) -> tuple[dict | None, str]:
    """The cached profile at `path` if it was measured for `fields`.

    Returns:
        (profile, "") when usable; (None, why) when missing ("" then), measured for other fields
        (the differing fields named) or corrupt (the reason, starting with "corrupt").
    """
    if not path.is_file():
        return None, ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"corrupt ({type(exc).__name__}: {str(exc)[:80]})"
    cal = data.get("calibration") if isinstance(data, dict) else None
    if not isinstance(cal, dict) or not isinstance(cal.get("fields"), dict):
        return None, "corrupt (no calibration record)"
    stored = cal["fields"]
    changed = [f"{k} {stored.get(k)!r} -> {fields[k]!r}" for k in KEY_FIELDS
               if stored.get(k) != fields[k]]
    if cal.get("version") != CACHE_VERSION:
        changed.insert(0, f"cache version {cal.get('version')!r} -> {CACHE_VERSION}")
    if changed:
        return None, "measured for other " + ", ".join(changed)
    problem = _profile_problem(data, fields)
    return (None, f"corrupt ({problem})") if problem else (data, "")


def _profile_problem(profile: dict, fields: dict) -> str:
    """What makes a cached profile unusable by `spec.costs.profile_costs` ("" when nothing)."""
    for key in ("seq_len", "micro_batch", "compute_dtype", "model_config_sha256"):
        if profile.get(key) != fields[key]:
            return f"its {key} {profile.get(key)!r} is not its key's {fields[key]!r}"
    kinds = profile.get("block_kinds")
    if not isinstance(kinds, dict) or not kinds:
        return "no block_kinds"
    for kind, entry in kinds.items():
        if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), (int, float)) for k in PROFILE_TIME_KEYS):
            return f"block kind {kind!r} lacks {'/'.join(PROFILE_TIME_KEYS)}"
    return ""


def write_cache(path: Path, profile: dict, fields: dict, *,
                load_avg: float | None = None) -> dict:
    """Store `profile` with its `calibration` record at `path` atomically; returns the stored
    dict.

    Args:
        path: the cache file.
        profile: the measured profile.
        fields: its key fields.
        load_avg: the 1-minute load average when the measurement started (a record).

    Raises:
        OSError: the directory cannot be created or written.
    """
    stored = {**profile, "calibration": {
        "version": CACHE_VERSION, "key_sha256": cache_key(fields), "fields": dict(fields),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_1min": load_avg, "cpu_count": os.cpu_count(),
        "created_by": f"lazytrain {__version__}"}}
    write_json_atomic(path, stored)
    return stored


def resolve_profile(cfg: RunConfig, *, measure: Measure | None = None,
                    log: Callable[[str], None] = lambda msg: None) -> ResolvedCosts:
    """Where the plan's costs come from (module docstring), measuring a calibration on a miss
    when `measure` is given.

    Args:
        cfg: the run config.
        measure: `measure(cfg, device) -> profile`; None: a miss plans analytic (with a note).
        log: warnings and progress (one line each).

    Returns:
        The `ResolvedCosts`; its `config` is what to plan with.

    Raises:
        ValueError: a bad `LAZYTRAIN_CALIBRATE` value.
    """
    if cfg.hardware.profile_path:
        return ResolvedCosts(config=cfg, source="profile", path=cfg.hardware.profile_path)
    if calibration_mode(cfg) == "off":
        return ResolvedCosts(config=cfg, source="analytic")
    device = machine_device(cfg)
    if device is None:
        return ResolvedCosts(config=cfg, source="analytic")
    fields = key_fields(cfg, device=device)
    path = cache_file(cfg, fields)
    profile, why = read_cache(path, fields)
    if profile is None and why.startswith("corrupt"):
        log(f"warning: calibration cache {path} is {why}; "
            + ("measuring it again" if measure else "planning with analytic costs"))
    elif profile is None and why:
        log(f"note: calibration cache {path} was {why}; "
            + ("measuring again" if measure else "planning with analytic costs"))
    if profile is None and measure is None:
        return ResolvedCosts(config=cfg, source="analytic", note=(
            "no calibration of this machine is cached yet: `lazytrain train` measures one, or "
            "run `lazytrain profile --calibrate`"))
    if profile is None:
        try:
            return calibrate(cfg, measure, device=device, fields=fields, path=path, log=log)
        except OSError as exc:  # a read-only home: the job still runs, on analytic costs
            log(f"warning: cannot write the calibration cache {path} ({exc}); planning with "
                f"analytic costs")
            return ResolvedCosts(config=cfg, source="analytic", note=(
                f"the calibration could not be cached: set runtime.calibration_dir to a "
                f"writable directory"))
    return _calibrated(cfg, path, profile)


def calibrate(cfg: RunConfig, measure: Measure, *, device: str | None = None,
              fields: dict | None = None, path: Path | None = None,
              log: Callable[[str], None] = lambda msg: None) -> ResolvedCosts:
    """Measure this machine's calibration for `cfg` and store it in the cache, replacing any
    entry (`lazytrain profile --calibrate`, and `resolve_profile` on a miss).

    Args:
        cfg: the run config.
        measure: `measure(cfg, device) -> profile`.
        device, fields, path: the machine's device, key fields and cache file when the caller
            has them (default: computed from `cfg`).
        log: progress lines.

    Returns:
        The calibrated `ResolvedCosts` (its `path` is the cache file).

    Raises:
        ValueError: `cfg` does not plan for this machine (`machine_device`), naming the preset.
        OSError: the cache directory cannot be written.
    """
    device = device or machine_device(cfg)
    if device is None:
        raise ValueError(f"hardware.preset: {cfg.hardware.preset} with runtime.device="
                         f"{cfg.runtime.device} does not describe this machine, so it cannot be "
                         f"calibrated here; use hardware.preset=cpu on a CPU, or the preset of "
                         f"this GPU")
    fields = fields or key_fields(cfg, device=device)
    path = path or cache_file(cfg, fields)
    log(f"calibrating the cost model on this machine ({device}; a few seconds)")
    load = _load_avg()
    stored = write_cache(path, measure(cfg, device), fields, load_avg=load)
    log(f"calibration written to {path}")
    cpus = os.cpu_count() or 1
    disturbed = [what for what, rec in
                 ((stored.get("measurements") or {}).get("steady") or {}).items()
                 if rec.get("disturbed")]
    if disturbed or (load is not None and load > BUSY_LOAD_PER_CPU * cpus):
        why = (f"1-minute load average {load:.1f} on {cpus} CPUs" if not disturbed else
               f"{', '.join(disturbed)} disturbed on every try")
        log(f"warning: the machine was busy while calibrating ({why}), so the measured times "
            f"may be high; this run's measured windows replace them if they disagree, or rerun "
            f"`lazytrain profile --calibrate` when it is idle")
    return _calibrated(cfg, path, stored)


def _load_avg() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _calibrated(cfg: RunConfig, path: Path, profile: dict) -> ResolvedCosts:
    hardware = dataclasses.replace(cfg.hardware, profile_path=str(path))
    return ResolvedCosts(config=dataclasses.replace(cfg, hardware=hardware),
                         source="calibrated", path=str(path),
                         measured_at=profile["calibration"].get("measured_at", "?"))


def config_for_plan(cfg: RunConfig, provenance: dict) -> RunConfig:
    """`cfg` with the costs the plan was made with (its provenance `costs` file, when it still
    exists), for a re-plan during training that should see the same costs."""
    record = provenance.get("costs") or {}
    path = record.get("file")
    if cfg.hardware.profile_path or record.get("source") != "calibrated" or not path \
            or not Path(path).is_file():
        return cfg
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware,
                                                                 profile_path=str(path)))


def costed_problem(cfg: RunConfig, *, measure: Measure | None = None,
                   log: Callable[[str], None] = lambda msg: None) -> PlanningProblem:
    """The node's `PlanningProblem` for `cfg` with the costs `resolve_profile` chooses
    (`hardware.profile_path`, else this machine's cached calibration, else the preset's
    analytic model; recorded as provenance `costs`). `lazytrain train` (measuring on a miss),
    `plan` and `simulate` (never measuring) build their problem here.

    Args:
        cfg: the run config.
        measure: `measure(cfg, device) -> profile` for a cache miss; None: a miss plans
            analytic, and the provenance note says how to measure one.
        log: calibration progress and warnings.

    Raises:
        FileNotFoundError, ValueError: as `planner.build.problem_from_config`.
    """
    costs = resolve_profile(cfg, measure=measure, log=log)
    return costs.annotate(problem_from_config(costs.config))
