"""The numpy backend needs no numba: the reference ops live in numbaengine/reference.py, which imports neither numba
nor numbaengine.kernels, so loading the shipped pair on it and generating loads no kernel module."""
import ast
import json
import subprocess
import sys
from pathlib import Path

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
