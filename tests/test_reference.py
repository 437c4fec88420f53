"""The numpy backend needs no numba: the reference ops live in numbaengine/reference.py, which imports neither numba
nor numbaengine.kernels, so loading the shipped pair on it and generating loads no kernel module."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import numbaengine.reference

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("numba", "llvmlite", "cupy", "numbaengine.kernels")


def forbidden(name):
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_numpy_backend_generates_without_numba():
    code = ("import json, sys\nfrom numbaengine import Engine\n"
            "Engine.load(backend='numpy').generate('def f(x):', 4)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'numba' or m.startswith('numbaengine.kernels'))))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    loaded = json.loads(p.stdout.splitlines()[-1])
    assert not loaded, f"loading and generating on the numpy backend imported {loaded}"


def test_reference_source_imports_no_numba():
    tree = ast.parse(Path(numbaengine.reference.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    bad = [m for m in names if forbidden(m) or (m.startswith("numbaengine") and not m.startswith("numbaengine.weights"))]
    assert not bad, f"numbaengine/reference.py imports {bad}"


def _conforms(impl, proto_fn, what):
    """impl's signature takes the protocol method's parameters: the same positional names in order, the same
    keyword-only names, and nothing else without a default."""
    import inspect
    want = list(inspect.signature(proto_fn).parameters.values())[1:]          # without self
    params = list(inspect.signature(impl).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    got = {p.name: p for p in params}
    pos = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    want_pos = [p.name for p in want if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert pos[:len(want_pos)] == want_pos, f"{what}: positional {pos} != {want_pos}"
    for p in want:
        if p.kind == p.KEYWORD_ONLY:
            assert p.name in got and got[p.name].kind == p.KEYWORD_ONLY, f"{what}: {p.name} is not keyword-only"
    extra = [p.name for p in params if p.name not in {w.name for w in want} and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not extra, f"{what}: required parameters {extra} beyond the protocol"


def test_op_tables_follow_the_protocol():
    """backends.Ops is the op interface: the NumPy table and ops_cuda.KernelOps have every op it declares, with its
    parameters (boolean flags keyword-only), and every fact."""
    import inspect

    from numbaengine.backends import NUMPY, Ops
    from numbaengine.ops_cuda import KernelOps
    ops = [n for n, f in vars(Ops).items() if inspect.isfunction(f) and not n.startswith("_")]
    facts = Ops.__annotations__
    assert len(ops) > 20 and set(facts) == {"name", "cache_dtypes", "max_shards", "prefill_form"}
    for n in ops:
        _conforms(getattr(NUMPY, n), getattr(Ops, n), f"NUMPY.{n}")
        _conforms(getattr(KernelOps, n), getattr(Ops, n), f"KernelOps.{n}")
    assert all(hasattr(NUMPY, f) for f in facts)
    assert not [n for n in vars(NUMPY) if n not in ops and n not in facts], "NUMPY has ops the protocol lacks"
    with pytest.raises(AssertionError, match="keyword-only"):           # the check itself can fail
        _conforms(lambda x, pos, inv_freq, out, interleaved, attn_factor=1.0: out, Ops.rope, "positional flag")
