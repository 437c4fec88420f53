"""Run a test module's simulator cases in a child process with NUMBA_ENABLE_CUDASIM=1.

The simulator is chosen when numba is first imported, and the pytest process imports numba normally (for the GPU
tests and the PTX checks), so simulator checks run in a fresh interpreter. A module lists its cases in SIM_CASES
(name -> check(env)); the child runs them all once and reports, per case, "" or the failure text.
"""
import json
import os
import subprocess
import sys
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
    """In the child: run every case on the simulator; name -> "" (passed) or the traceback."""
    env, out = Env(gpu=False), {}
    for name, check in cases.items():
        try:
            check(env)
            out[name] = ""
        except Exception:
            out[name] = traceback.format_exc()
    return out


_CHILDREN = {}               # module -> [(Popen, stdout file, stderr file)], started by start()


CASE_SECONDS = 3.0           # a simulator case's assumed CPU time where its module's SIM_COST does not say
# Measured (session 15, 2-core box): SIM_COST for every module (the tree module's ~290 s then no longer all on one
# core; ~500 / 506 s of simulator work per core instead of ~650 / 360) made the whole suite slower, 909 vs 686 s:
# the uneven dealing leaves a core to the main pytest process, which waits on the children's results in turn.
_CORE_LOAD = {}              # core -> seconds of simulator cases pinned to it so far


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
    """Start the simulator children of test modules in the background (conftest does it right after collection,
    so they overlap with each other and with the CPU tests). A module may set SIM_PARTS = n to spread its cases
    over n children and SIM_COST = {case: CPU seconds} (measured; CASE_SECONDS otherwise): cases are dealt onto
    the parts, and all children onto the cores, longest first onto the least loaded (the longest child is the
    suite's critical path; dealing round-robin put 435 of 583 s on one core of two). Each child is pinned to one
    core: the simulator's Python threads fight for the GIL when spread over several (measured: 440 s unpinned,
    95 s pinned for test_backend_sim's first cases)."""
    import importlib
    import tempfile
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None]
    for core in cores:
        _CORE_LOAD.setdefault(core, 0.0)
    chunks = []
    for module in modules:
        if module in _CHILDREN:
            continue
        m = importlib.import_module(module)
        cost = getattr(m, "SIM_COST", {})
        parts = {k: 0.0 for k in range(max(1, getattr(m, "SIM_PARTS", 1)))}
        dealt = {k: [] for k in parts}
        for k, name in _lpt([(cost.get(n, CASE_SECONDS), n) for n in m.SIM_CASES], parts):
            dealt[k].append(name)
        chunks += [(parts[k], (module, names, parts[k])) for k, names in dealt.items() if names]
        _CHILDREN[module] = []
    for core, (module, chunk, seconds) in _lpt(chunks, {c: _CORE_LOAD[c] for c in cores}):
        _CORE_LOAD[core] += seconds
        pin = f"import os; os.sched_setaffinity(0, {{{core}}}); " if core is not None else ""
        code = (f"{pin}import sys, json, warnings; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
                f"warnings.simplefilter('ignore'); import cudasim, {module} as m; "
                f"cases = {{k: m.SIM_CASES[k] for k in {chunk!r}}}; "
                f"print({MARK!r} + json.dumps(cudasim.run_cases(cases)))")
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        p = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=out, stderr=err, text=True)
        _CHILDREN[module].append((p, out, err))


def simulate(module: str, timeout=1500) -> dict:
    """In pytest: the results of tests/<module>.py's SIM_CASES from its simulator children (started now unless
    conftest started them): case name -> "" (passed) or the failure text."""
    start([module])
    results = {}
    for p, out, err in _CHILDREN[module]:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise RuntimeError(f"simulator child for {module} ran past {timeout} s") from None
        out.seek(0)
        err.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith(MARK)]
        if not lines:
            raise RuntimeError(f"simulator child for {module} failed (rc {p.returncode}):\n{err.read()[-4000:]}")
        results.update(json.loads(lines[-1][len(MARK):]))
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
