"""Timing on a shared machine: the least of the repeats, measured again when disturbed.

Owns how the calibration (the profiler's quick mode) turns a measurement's timed repeats into
one number. Other processes only ever add time to a run of fixed work, so the fastest repeat
is the best estimate of the undisturbed time; the median is not: on a 2-core machine with one
other busy process every repeat is slow, and the median of three keeps that. Two signs say
that even the fastest repeat was disturbed, and the whole measurement (a block kind's forward,
forward with autograd and backward; the ends) runs again, at most `MAX_TRIES` times; the least
time over all tries is kept:

- spread: the slowest repeat of a series over its fastest > `MAX_SPREAD`;
- load: other processes used more than `MAX_OTHERS_SHARE` of the CPUs' time while it ran
  (`cpu_others_s`: the busy time of /proc/stat less this process's own from /proc/self/stat,
  so the measurement's own threads never count; where /proc is missing only the spread
  counts).

A measurement still disturbed after the last try is kept (a calibration must finish) and
marked `disturbed` in its record; the run's own measured windows later replace a cached
calibration they contradict (`lazytrain.train.recalibrate`).

Knows no model and no profile schema: it times callables that return their repeats.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

MAX_SPREAD = 1.5
"""Slowest / fastest repeat of one series above which the series counts as disturbed: repeats
of the same work on the same inputs differ by timer and cache noise only, while one repeat
that shared its cores for part of its run takes longer by up to the slowdown of a loaded
machine (block times 3-17x the idle ones at a load of 2-3 on the 2-core CI box, where the
other processes also stall the intra-op threads' barriers)."""
MAX_OTHERS_SHARE = 0.25
"""Share of all CPUs' time used by other processes while measuring above which the
measurement counts as disturbed: half of one busy process on a 2-core machine (a whole one
is 0.5, the acceptance case of one busy process per two cores)."""
MAX_TRIES = 3
"""Tries of one disturbed measurement before its least time is kept anyway: each try repeats
the measurement's warm-up and timed runs, so a machine busy all along costs the block and end
times of the calibration 3x, not an unbounded wait."""

Samples = Callable[[], dict[str, list[float]]]
"""One try of a measurement: series name -> its timed repeats, ms."""
Timing = Callable[[Samples, str], dict[str, float]]
"""`timing(samples, what)`: series name -> ms from tries of `samples` (`median_timing`, or a
`SteadyTiming`)."""
OthersClock = Callable[[], tuple[float, float] | None]
"""`() -> (CPU s used by other processes since boot, wall s)`, or None where unknown."""


def cpu_others_s(*, stat: Path = Path("/proc/stat"), own: Path = Path("/proc/self/stat"),
                 clock: Callable[[], float] = time.monotonic) -> tuple[float, float] | None:
    """CPU seconds used by every other process since boot, and the wall clock now (s).

    Busy time is the aggregate `cpu` line of /proc/stat (user, nice, system, irq, softirq,
    steal) less this process's utime + stime (/proc/self/stat fields 14-15, every thread), both
    in clock ticks (`os.sysconf("SC_CLK_TCK")`).

    Returns:
        (others_s, wall_s), or None where /proc cannot be read (not Linux).
    """
    try:
        cpu = stat.read_text().split("\n", 1)[0].split()
        mine = own.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    busy = sum(int(cpu[k]) for k in (1, 2, 3, 6, 7, 8))  # user nice system irq softirq steal
    ticks = os.sysconf("SC_CLK_TCK")
    own_ticks = int(mine[11]) + int(mine[12])  # utime, stime (fields 14, 15 after pid, comm)
    return (busy - own_ticks) / ticks, clock()


def cpu_count_of(stat: Path = Path("/proc/stat")) -> int:
    """CPUs /proc/stat counts (its `cpuN` lines; the share is of these), else os.cpu_count()."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return os.cpu_count() or 1
    return sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit()) or 1


@dataclass(kw_only=True)
class SteadyTiming:
    """The calibration's timing rule (module docstring); call it on one measurement.

    Args:
        others: `OthersClock` (tests inject one; default `cpu_others_s`).
        cpus: CPUs the share is taken of (default `cpu_count_of()`).
        max_spread, max_others_share, max_tries: the thresholds (module constants).
        log: one line per measurement tried again.
    """

    # defaults read when constructed (a test may patch the module's clock and thresholds)
    others: OthersClock = field(default_factory=lambda: cpu_others_s)
    cpus: int = field(default_factory=lambda: cpu_count_of())
    max_spread: float = field(default_factory=lambda: MAX_SPREAD)
    max_others_share: float = field(default_factory=lambda: MAX_OTHERS_SHARE)
    max_tries: int = field(default_factory=lambda: MAX_TRIES)
    log: Callable[[str], None] = lambda msg: None
    records: dict[str, dict] = field(default_factory=dict)
    """What -> {"tries", "spread", "others_share", "disturbed"} of every measurement timed."""

    def __call__(self, samples: Samples, what: str) -> dict[str, float]:
        """The least repeat of each series over the tries of `samples` (module docstring).

        Args:
            samples: one try of the measurement.
            what: its name in `records` and in the log ("block kind dense").

        Returns:
            series name -> ms.

        Raises:
            ValueError: a try returned a series without repeats.
        """
        best: dict[str, float] = {}
        for attempt in range(1, self.max_tries + 1):
            before = self.others()
            series = samples()
            share = self._share(before, self.others())
            if any(not v for v in series.values()):
                raise ValueError(f"{what}: a series without timed repeats; repeats must be >= 1")
            for name, v in series.items():
                best[name] = min(best.get(name, float("inf")), min(v))
            spread = max(max(v) / max(min(v), 1e-9) for v in series.values())
            disturbed = spread > self.max_spread or (share is not None
                                                     and share > self.max_others_share)
            self.records[what] = {"tries": attempt, "spread": spread, "others_share": share,
                                  "disturbed": disturbed}
            if not disturbed:
                break
            if attempt < self.max_tries:
                self.log(f"calibration: {what} measured again (repeats spread {spread:.2f}x"
                         + ("" if share is None else f", other processes used {share:.0%} of "
                                                     f"the CPUs") + ")")
        return best

    def _share(self, before, after) -> float | None:
        if before is None or after is None or after[1] <= before[1]:
            return None
        return (after[0] - before[0]) / ((after[1] - before[1]) * max(self.cpus, 1))


def median_timing(samples: Samples, what: str) -> dict[str, float]:
    """The full profile's rule: one try, the median of each series (`what` unused)."""
    return {name: statistics.median(v) for name, v in samples().items()}
