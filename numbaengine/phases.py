"""Where a process's time goes: named spans (load, compile, capture, warmup, prefill, decode).

A span's time is exclusive: time spent in spans opened inside it (a kernel compiled during prefill) counts for the
inner one only, so the totals add up to the wall time covered. Totals are kept per process (`totals()`, `delta()`);
when NUMBAENGINE_PHASES names a file, every span is also appended to it as one JSON line (phase, start, end in Unix
seconds, pid; `record` adds counts such as tokens) so that `python -m numbaengine.profile` can put the GPU's samples
beside the work that made them.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

from numbaengine import env

PHASES = ("load", "compile", "capture", "warmup", "prefill", "decode")
WARMED = ("prefill", "decode")     # the spans that warming() counts as "warmup"

_TOTALS: dict[str, float] = {}
_LOCK = threading.Lock()
_LOCAL = threading.local()        # .stack: the open spans of this thread, [name, start, seconds of inner spans]


@contextmanager
def span(name: str):
    """Time the block as phase `name` (exclusive of the spans opened inside it)."""
    stack = _LOCAL.__dict__.setdefault("stack", [])
    if name in WARMED and _LOCAL.__dict__.get("warming"):
        name = "warmup"
    frame = [name, time.perf_counter(), 0.0]
    wall0 = time.time()
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        seconds = time.perf_counter() - frame[1]
        if stack:
            stack[-1][2] += seconds
        with _LOCK:
            _TOTALS[name] = _TOTALS.get(name, 0.0) + seconds - frame[2]
        _write(dict(phase=name, start=wall0, end=wall0 + seconds, pid=os.getpid()))


@contextmanager
def warming():
    """A warm-up run of a request (first launches, graphs captured) so that the real one runs steady: its prefill
    and decode spans count as phase "warmup"; compile, load and capture keep their names."""
    before = _LOCAL.__dict__.get("warming", False)
    _LOCAL.warming = True
    try:
        yield
    finally:
        _LOCAL.warming = before


def record(name: str, **fields):
    """A count for phase `name` (e.g. record("decode", tokens=256)) as one line of the NUMBAENGINE_PHASES file,
    so that the profiler can divide the phase's energy by it; nothing when no file is named."""
    _write(dict(phase=name, time=time.time(), pid=os.getpid(), **fields))


def _write(line):
    path = env.phases_file()
    if path:
        _append(path, line)


def _append(path, line):
    """One line per span; O_APPEND keeps lines whole when several processes write the same file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def totals() -> dict[str, float]:
    """Exclusive seconds per phase so far in this process."""
    with _LOCK:
        return dict(_TOTALS)


def delta(before: dict[str, float]) -> dict[str, float]:
    """Exclusive seconds per phase since `before` (an earlier `totals()`): every phase of PHASES, then the other
    spans that ran since (e.g. "costs", budget auto's timing of the reference round)."""
    now = totals()
    names = list(PHASES) + [k for k in now if k not in PHASES and now[k] != before.get(k)]
    return {k: round(now.get(k, 0.0) - before.get(k, 0.0), 6) for k in names}
