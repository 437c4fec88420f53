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


def simulate(module: str, timeout=900) -> dict:
    """In pytest: run tests/<module>.py's SIM_CASES in a simulator child process."""
    code = (f"import sys, json, warnings; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
            f"warnings.simplefilter('ignore'); import cudasim, {module} as m; "
            f"print({MARK!r} + json.dumps(cudasim.run_cases(m.SIM_CASES)))")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"simulator child for {module} failed (rc {p.returncode}):\n{p.stderr[-4000:]}")


def ptx_or_skip(pyfunc, sig):
    """PTX for sm_90 from a kernel's Python function; skips when NVVM/NVRTC are not installed."""
    import pytest
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulator has no compiler")
    from numba import cuda
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=(9, 0))
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
