"""The package's shape, read with ast (no import): no code run from strings, kernel functions of readable length, and
every kernel waiting for the previous one first (PDL)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "numbaengine"
KERNELS = PACKAGE / "kernels"
MAX_KERNEL_FUNCTION_LINES = 150


def _trees(root):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text(), filename=str(path))


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_exec_or_eval():
    """No exec / eval (nor builtins.exec / builtins.eval) anywhere in numbaengine/: kernels and their helpers are
    ordinary functions, so tracebacks and profilers point at real lines."""
    found = []
    for rel, tree in _trees(PACKAGE):
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if (isinstance(f, ast.Name) and f.id in ("exec", "eval")) or (
                    isinstance(f, ast.Attribute) and f.attr in ("exec", "eval") and isinstance(f.value, ast.Name)
                    and f.value.id == "builtins"):
                found.append(f"{rel}:{n.lineno}")
    assert not found, "exec/eval calls: " + ", ".join(found)


def test_kernel_functions_short():
    """No function in numbaengine/kernels/ (nested ones counted inside their parent) longer than
    MAX_KERNEL_FUNCTION_LINES: a kernel reads as named steps, a factory as the steps it builds."""
    long = [f"{rel}:{fn.name}:{fn.end_lineno - fn.lineno + 1}" for rel, tree in _trees(KERNELS)
            for fn in _functions(tree) if fn.end_lineno - fn.lineno + 1 > MAX_KERNEL_FUNCTION_LINES]
    assert not long, f"functions over {MAX_KERNEL_FUNCTION_LINES} lines: " + ", ".join(long)


def _is_kernel_decorator(d):
    return isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "kernel"


def test_kernels_start_with_grid_dep():
    """Every function decorated with kernels.device.kernel(...) calls grid_dep() as its first statement (after the
    docstring): with PDL nothing of a kernel may run before it waits for the previous kernel."""
    missing, kernels = [], 0
    for rel, tree in _trees(PACKAGE):
        for fn in _functions(tree):
            if not any(_is_kernel_decorator(d) for d in fn.decorator_list):
                continue
            kernels += 1
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            first = body[0] if body else None
            ok = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                  and isinstance(first.value.func, ast.Name) and first.value.func.id == "grid_dep"
                  and not first.value.args)
            if not ok:
                missing.append(f"{rel}:{fn.name}:{fn.lineno}")
    assert kernels > 20, kernels                       # the walk found the kernels
    assert not missing, "kernels not starting with grid_dep(): " + ", ".join(missing)
