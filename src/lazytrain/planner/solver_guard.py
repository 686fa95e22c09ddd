"""A hard wall-clock guard for solver calls that may ignore their own time limit.

HiGHS 1.16 checks its time limit and interrupt callbacks only at some points; inside its MIP
presolve (`HPresolve::strengthenInequalities`) it was seen running more than ten minutes past a
5 s limit on a 64-block placement model, which would hang `lazytrain plan` for as long.
`run_guarded` runs the solve in a forked child process and, past a hard deadline, kills it and
returns a fallback answer instead (the caller's warm start), so planning always ends.

No solver, no torch: the child runs whatever function it is given.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Callable

GUARD_FACTOR = 3.0
"""The hard deadline is GUARD_FACTOR x the solver's own time limit + GUARD_GRACE_S."""
GUARD_GRACE_S = 30.0


def hard_deadline_s(time_limit_s: float) -> float:
    """Seconds after which a solve with `time_limit_s` is killed (math.inf stays inf)."""
    return GUARD_FACTOR * float(time_limit_s) + GUARD_GRACE_S


def _child(conn, fn: Callable[..., Any], kwargs: dict) -> None:
    try:
        out = ("ok", fn(**kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which re-raises it
        out = ("error", exc)
    try:
        conn.send(out)
    except Exception as exc:  # noqa: BLE001 - an exception that does not pickle
        conn.send(("error", RuntimeError(f"{type(out[1]).__name__}: {out[1]} ({exc})")))
    conn.close()


def run_guarded(fn: Callable[..., Any], kwargs: dict, *, wall_s: float,
                fallback: Callable[[float], Any]) -> Any:
    """`fn(**kwargs)` in a forked child; after `wall_s` seconds the child is killed and
    `fallback(elapsed_s)` is returned instead.

    The child's return value (or exception, re-raised here) must pickle. Where fork is not
    available, `wall_s` is not finite, or this process is itself daemonic (a
    `multiprocessing.Pool` worker, which may not have children), `fn` runs in this process
    unguarded.

    Raises:
        whatever `fn` raises.
    """
    if (wall_s == float("inf") or "fork" not in multiprocessing.get_all_start_methods()
            or multiprocessing.current_process().daemon):
        return fn(**kwargs)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=_child, args=(send, fn, kwargs), daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(wall_s):
            try:
                kind, value = recv.recv()
            except EOFError:  # the child died without an answer (killed, out of memory)
                raise RuntimeError(f"the solver process exited with code {proc.exitcode} "
                                   f"without an answer") from None
            if kind == "error":
                raise value
            return value
        return fallback(time.perf_counter() - t0)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
