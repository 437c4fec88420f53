"""Run a test module's simulator cases in a child process with NUMBA_ENABLE_CUDASIM=1.

The simulator is chosen when numba is first imported, and the pytest process imports numba normally (for the GPU
tests and the PTX checks), so simulator checks run in a fresh interpreter. A module lists its cases in SIM_CASES
(name -> check(env)); the child runs them all once and reports, per case, "" or the failure text.
"""
import atexit
import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@SIMRESULTS@@"


class Env:
    """Where check functions put their arrays: NumPy under the simulator, numba device arrays on a GPU."""

    def __init__(self, gpu: bool):
        self.gpu = gpu

    def dev(self, a):
        a = np.ascontiguousarray(a)
        if not self.gpu:
            return a.copy()
        from numba import cuda
        return cuda.to_device(a)

    def host(self, a):
        return a.copy_to_host() if self.gpu else np.asarray(a)

    def zeros(self, shape, dtype):
        return self.dev(np.zeros(shape, dtype))

    def sync(self):
        if self.gpu:
            from numba import cuda
            cuda.synchronize()


def run_cases(cases: dict) -> dict:
    """In the child: run every case on the simulator; name -> ["" (passed) or the traceback, CPU seconds]."""
    import time

    from numbaengine.kernels.sim import sleeping_block_manager
    sleeping_block_manager()                     # (kernels.device installs it on import; a case may import none)
    env, out = Env(gpu=False), {}
    for name, check in cases.items():
        t0 = time.process_time()
        try:
            check(env)
            out[name] = ["", 0.0]
        except Exception:
            out[name] = [traceback.format_exc(), 0.0]
        out[name][1] = round(time.process_time() - t0, 1)
    return out


_CHILDREN = {}               # module -> [Child], queued by start()
SECONDS = {}                 # "module::case" -> CPU seconds in its child (conftest prints the slowest)


CASE_SECONDS = 3.0           # a simulator case's assumed CPU time where its module's SIM_COST does not say
# A worker per core takes the longest waiting child as soon as its core is free: children pinned to cores dealt in
# advance can leave a core idle while two children share the other (on a 2-core box the two longest test_backend_sim
# parts shared one core for their last ~5 minutes).


class Child:
    """One simulator child: some cases of a module, run when a core's worker picks it."""

    def __init__(self, module, names, seconds):
        self.module, self.names, self.seconds = module, names, seconds
        self.done = threading.Event()
        self.proc, self.rc, self.out, self.err = None, None, "", ""

    def run(self, core):
        pin = f"import os; os.sched_setaffinity(0, {{{core}}}); " if core is not None else ""
        code = (f"{pin}import sys, json, warnings; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
                f"warnings.simplefilter('ignore'); import cudasim, {self.module} as m; "
                f"cases = {{k: m.SIM_CASES[k] for k in {self.names!r}}}; "
                f"print({MARK!r} + json.dumps(cudasim.run_cases(cases)))")
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
            self.out, self.err = self.proc.communicate()
            self.rc = self.proc.returncode
        except Exception as e:       # report it from simulate(), never hang the worker
            self.rc, self.err = -1, f"{type(e).__name__}: {e}"
        finally:
            self.done.set()


_QUEUE = []                  # Children waiting for a core, longest first
_QLOCK = threading.Lock()
_WORKERS = {}                # core -> its worker thread


def _stop_children():
    """At exit (an interrupted run, say): end the children still running and drop the waiting ones."""
    with _QLOCK:
        _QUEUE.clear()
    for children in _CHILDREN.values():
        for child in children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()


atexit.register(_stop_children)


def _worker(core):
    """Run waiting children on `core` (pinned: the simulator's Python threads fight for the GIL when spread over
    several cores: measured 440 s unpinned, 95 s pinned for test_backend_sim's first cases) until none wait."""
    while True:
        with _QLOCK:
            if not _QUEUE:
                del _WORKERS[core]
                return
            child = _QUEUE.pop(0)
        child.run(core)


def _lpt(items, bins):
    """Longest first onto the least loaded bin: items [(seconds, x)], bins {key: seconds} (updated) ->
    [(key, x)]."""
    out = []
    for sec, x in sorted(items, key=lambda it: -it[0]):
        key = min(bins, key=bins.get)
        bins[key] += sec
        out.append((key, x))
    return out


def start(modules) -> None:
    """Queue the simulator children of test modules (conftest does it right after collection, so they overlap with
    each other and with the CPU tests). A module may set SIM_PARTS = n to spread its cases over n children and
    SIM_COST = {case: CPU seconds} (measured; CASE_SECONDS otherwise): cases are dealt onto the parts longest first
    onto the least loaded, and a worker per core runs the longest waiting child whenever its core is free (the
    longest child is the suite's critical path)."""
    import importlib
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None]
    with _QLOCK:
        for module in modules:
            if module in _CHILDREN:
                continue
            m = importlib.import_module(module)
            cost = getattr(m, "SIM_COST", {})
            parts = {k: 0.0 for k in range(max(1, getattr(m, "SIM_PARTS", 1)))}
            dealt = {k: [] for k in parts}
            for k, name in _lpt([(cost.get(n, CASE_SECONDS), n) for n in m.SIM_CASES], parts):
                dealt[k].append(name)
            _CHILDREN[module] = [Child(module, names, parts[k]) for k, names in dealt.items() if names]
            _QUEUE.extend(_CHILDREN[module])
        _QUEUE.sort(key=lambda c: -c.seconds)
        for core in cores[:max(1, len(_QUEUE))]:
            if core not in _WORKERS and _QUEUE:
                _WORKERS[core] = threading.Thread(target=_worker, args=(core,), daemon=True)
                _WORKERS[core].start()


def simulate(module: str, timeout=1500) -> dict:
    """In pytest: the results of tests/<module>.py's SIM_CASES from its simulator children (queued now unless
    conftest did): case name -> "" (passed) or the failure text. timeout: seconds to wait for each child."""
    start([module])
    results = {}
    for child in _CHILDREN[module]:
        if not child.done.wait(timeout):
            if child.proc is not None:
                child.proc.kill()
            raise RuntimeError(f"simulator child for {module} ({', '.join(child.names)}) not done after {timeout} s")
        lines = [ln for ln in child.out.splitlines() if ln.startswith(MARK)]
        if not lines:
            raise RuntimeError(f"simulator child for {module} failed (rc {child.rc}):\n{child.err[-4000:]}")
        for case, (text, sec) in json.loads(lines[-1][len(MARK):]).items():
            results[case] = text
            SECONDS[f"{module}::{case}"] = sec
    return results


def ptx_or_skip(pyfunc, sig, cc=(9, 0)):
    """PTX for sm_90 (cc=(9, 0, "a"): sm_90a) from a kernel's Python function; skips when NVVM/NVRTC are not
    installed."""
    import pytest
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need numba's compiler: run pytest without NUMBA_ENABLE_CUDASIM=1 (simulator cases run "
                    "in their own child process anyway)")
    from numba import cuda
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=cc)
    except Exception as e:  # missing NVVM / NVRTC wheels: numba-cuda[cu13]
        if "NVVM" in str(e) or "nvrtc" in str(e).lower() or "libnvvm" in str(e):
            pytest.skip(f"no CUDA compiler libraries (pip install 'numba-cuda[cu13]'): {str(e)[:120]}")
        raise
    return ptx


def ptxas_check(ptx):
    """Where ptxas is installed: it assembles the PTX for sm_90a with no spills and no notice that the wgmmas were
    serialized (a kernel whose wgmmas run one at a time loses their overlap silently otherwise)."""
    import re
    import shutil
    import subprocess
    import tempfile
    ptxas = shutil.which("ptxas")
    if not ptxas:
        return
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx))
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-500:]
    assert "0 bytes spill stores" in out.stderr, out.stderr[-500:]
    assert "serialized" not in out.stderr, out.stderr[-800:]


def f64_lines(ptx):
    """Float64 instructions in PTX (register names such as %fd are not instructions)."""
    import re
    return [ln for ln in ptx.splitlines() if re.search(r"\.f64\b", ln)]


def worst(got, want):
    """One-line worst-element report."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    i = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    return f"max |err| {err.max() if err.size else 0:.3g} at {i}: got {got[i] if err.size else ''} want " \
           f"{want[i] if err.size else ''}"


def simulator_test(module: str):
    """The test a module with SIM_CASES exposes (`test_simulator = simulator_test(__name__)`): one parametrized
    case per name, reading the module's simulator children once (their results are cached per module)."""
    import importlib

    import pytest
    cases = sorted(importlib.import_module(module).SIM_CASES) if module in sys.modules else []

    @pytest.mark.parametrize("case", cases)
    def test_simulator(case):
        results = _RESULTS.get(module)
        if results is None:
            results = _RESULTS[module] = simulate(module)
        assert results[case] == "", results[case]
    return test_simulator


_RESULTS = {}                # module -> simulate(module)
