"""Did a change alter any kernel's code? PTX of every kernel case the CPU suite compiles (the tests named *ptx*),
saved per test and compared between two checkouts (CPU only: numba's compile_ptx and NVVM, no GPU).

    python -m tools.ptx_diff --save /tmp/before          # in the old checkout (git worktree add /tmp/old HEAD~1)
    python -m tools.ptx_diff --save /tmp/after           # in the new one
    python -m tools.ptx_diff --compare /tmp/before /tmp/after

Names that carry no meaning are made canonical before comparing: numba's mangled symbols (by order of first use),
the process-wide numbering of shared arrays (by their declaration), the order of declarations and the unused
environment globals a function from another module brings. A structural change (code moved between modules,
renamed, re-layered) should compare equal; then the GPU runs the same instructions as before.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = ["tests/test_ptx.py", "tests/test_cuda_mla.py", "tests/test_cuda_gemm_wg.py", "tests/test_wgmma.py",
         "tests/test_cuda_attention.py", "tests/test_backend_sim.py", "tests/test_cuda_tree.py",
         "tests/test_cuda_moe.py", "tests/test_cuda_dense.py", "tests/test_cuda_head_gemm.py"]


def canonical(ptx: str) -> str:
    """PTX with meaningless names and orders made canonical (see the module docstring)."""
    decl = {}
    for m in re.finditer(r"^\.(extern|visible) \.shared \.align (\d+) \.b8 (_cudapy_smem_\d+)\[(\d*)\];", ptx, re.M):
        decl[m.group(3)] = f"SMEM_{m.group(1)}_{m.group(2)}_{m.group(4) or 'dyn'}"
    ptx = re.sub(r"\b_cudapy_smem_\d+\b", lambda m: decl.get(m.group(0), m.group(0)), ptx)
    ptx = "\n".join(ln for ln in ptx.split("\n") if not re.match(r"\.common \.global \.align 8 \.u64 \S+;", ln))
    names = {}
    lines = re.sub(r"\b_Z\w+", lambda m: names.setdefault(m.group(0), f"F{len(names)}"), ptx).split("\n")
    head = sorted(ln for ln in lines if ln.startswith((".extern .shared", ".visible .shared")))
    return "\n".join(head + [ln for ln in lines if not ln.startswith((".extern .shared", ".visible .shared"))])


# --- pytest plugin (loaded by --save in a child pytest): every compile_ptx result, one file per call --------------
def pytest_configure(config):
    import collections

    import numba.cuda as cuda
    out, real, calls = Path(os.environ["PTX_DIFF_OUT"]), cuda.compile_ptx, collections.Counter()

    def compile_ptx(pyfunc, sig, *a, **k):
        ptx, rt = real(pyfunc, sig, *a, **k)
        test = re.sub(r"[^\w.-]+", "_", os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])
        calls[test] += 1
        (out / f"{test}.{calls[test]}.ptx").write_text(canonical(ptx))
        return ptx, rt
    cuda.compile_ptx = compile_ptx


def save(folder: Path) -> int:
    """The suite's PTX cases into folder, its earlier .ptx files removed first (stale ones would read as
    differences)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.ptx"):
        old.unlink()
    env = dict(os.environ, PTX_DIFF_OUT=str(folder.resolve()))
    tests = [t for t in TESTS if Path(t).exists()]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tools.ptx_diff",
                        "-k", "ptx", *tests], env=env)
    print(f"{len(list(folder.glob('*.ptx')))} kernels saved in {folder}")
    return r.returncode


def compare(a: Path, b: Path) -> int:
    """0 when both folders hold the same kernels with the same code; else 1, naming what differs."""
    names_a, names_b = {p.name for p in a.glob("*.ptx")}, {p.name for p in b.glob("*.ptx")}
    differ = sorted(n for n in names_a & names_b if (a / n).read_text() != (b / n).read_text())
    for n in sorted(names_a ^ names_b):
        print(f"only in {a if n in names_a else b}: {n}")
    for n in differ:
        print(f"differs: {n}")
    print(f"{len(names_a & names_b) - len(differ)} of {len(names_a | names_b)} kernels identical")
    return int(bool(differ or names_a ^ names_b))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", metavar="DIR", help="compile the suite's PTX cases here")
    ap.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two saved folders")
    args = ap.parse_args(argv)
    if bool(args.save) == bool(args.compare):
        ap.error("give --save DIR or --compare DIR_A DIR_B")
    return save(Path(args.save)) if args.save else compare(*map(Path, args.compare))


if __name__ == "__main__":
    sys.exit(main())
