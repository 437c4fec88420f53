"""The package's shape, read with ast (no import): no code run from strings, kernel functions of readable length, and
every kernel waiting for the previous one first (PDL)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "numbaengine"
KERNELS = PACKAGE / "kernels"
MAX_KERNEL_FUNCTION_LINES = 120


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


def _kernels():
    """(file, function) of every function of the package decorated with kernels.launch.kernel(...)."""
    found = [(rel, fn) for rel, tree in _trees(PACKAGE) for fn in _functions(tree)
             if any(_is_kernel_decorator(d) for d in fn.decorator_list)]
    assert len(found) > 20, len(found)                   # the walk found the kernels
    return found


def test_kernels_start_with_grid_dep():
    """Every function decorated with kernels.launch.kernel(...) calls grid_dep() as its first statement (after the
    docstring): with PDL nothing of a kernel may run before it waits for the previous kernel."""
    missing = []
    for rel, fn in _kernels():
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            else fn.body
        first = body[0] if body else None
        ok = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
              and isinstance(first.value.func, ast.Name) and first.value.func.id == "grid_dep"
              and not first.value.args)
        if not ok:
            missing.append(f"{rel}:{fn.name}:{fn.lineno}")
    assert not missing, "kernels not starting with grid_dep(): " + ", ".join(missing)


# ------------------------------------------------------------------------------------------------- the import graph
def _module_names():
    """Dotted module name -> path, for every module of numbaengine/ (packages by their __init__)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name, path, modules):
    """(imported module, name or None, line) of every import in a module, function-level ones included; a
    relative import resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(n, ast.Import):
            found += [(a.name, None, n.lineno) for a in n.names if a.name in modules]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = package.split(".")[:len(package.split(".")) - (n.level - 1)]
                base = ".".join(up + ([n.module] if n.module else []))
            for a in n.names:
                if f"{base}.{a.name}" in modules:        # `from package import module`
                    found.append((f"{base}.{a.name}", None, n.lineno))
                elif base in modules:
                    found.append((base, a.name, n.lineno))
    return found


def test_import_graph_has_no_cycle():
    """Dependencies point down: no module of the package reaches itself through imports (function-level imports
    count: an import moved into a function to break a cycle at load time is still a cycle)."""
    modules = _module_names()
    edges = {m: {t for t, _, _ in _imports(m, p, modules) if t != m} for m, p in modules.items()}
    for m in edges:                              # a package's __init__ imported by its modules is not a cycle here
        edges[m] = {t for t in edges[m] if not m.startswith(t + ".")}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"
    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_no_private_names_across_modules():
    """A module uses another module's public names only: `from numbaengine.x import _y` (or alias._y on an imported
    module) would tie it to a helper its owner may change freely."""
    modules = _module_names()
    bad = []
    for m, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        bad += [f"{path.relative_to(PACKAGE.parent)}:{line} {t}.{n}" for t, n, line in _imports(m, path, modules)
                if n and n.startswith("_") and not n.startswith("__") and t != m]
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names if (a.asname or a.name) and (
                       a.name in modules or f"{getattr(n, 'module', '')}.{a.name}" in modules)}
        bad += [f"{path.relative_to(PACKAGE.parent)}:{n.lineno} {n.value.id}.{n.attr}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert not bad, "private names used across modules: " + ", ".join(bad)


def test_the_walk_sees_imports():
    """The walk itself: it finds a function-level import and resolves a known edge (a walk that found nothing
    would pass the two tests above)."""
    modules = _module_names()
    found = _imports("numbaengine.backends", modules["numbaengine.backends"], modules)
    assert ("numbaengine.ops_cuda", "cuda_ops", found[-1][2]) in found or any(
        t == "numbaengine.ops_cuda" for t, _, _ in found), found
    assert len(modules) > 40 and any(t == "numbaengine.kernels.device" for m, p in modules.items()
                                     for t, _, _ in _imports(m, p, modules))


def test_environment_read_in_one_place():
    """Environment variables are read in numbaengine/env.py only (os.environ.get / [...] / os.getenv): the one list
    of what the engine reads, documented in docs/KERNELS.md. (A child's environment built from os.environ is fine.)"""
    found = []
    for rel, tree in _trees(PACKAGE):
        if rel.as_posix() == "numbaengine/env.py":
            continue
        for n in ast.walk(tree):
            environ = lambda v: isinstance(v, ast.Attribute) and v.attr == "environ"          # noqa: E731
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                    (n.func.attr == "get" and environ(n.func.value)) or n.func.attr == "getenv")) or (
                    isinstance(n, ast.Subscript) and environ(n.value) and isinstance(n.ctx, ast.Load)):
                found.append(f"{rel}:{n.lineno}")
    assert not found, "environment read outside numbaengine/env.py: " + ", ".join(found)


def test_env_variables_documented():
    """Every variable numbaengine/env.py reads has a row in docs/KERNELS.md's table."""
    import re
    names = set(re.findall(r'"((?:NUMBAENGINE|NUMBA)_[A-Z_]+)"', (PACKAGE / "env.py").read_text()))
    doc = (PACKAGE.parent / "docs" / "KERNELS.md").read_text()
    assert len(names) >= 6, names
    assert not [v for v in names if f"| `{v}` |" not in doc], names


def test_kernel_docstrings_give_launch_and_bytes():
    """Every kernel's docstring says how it is launched (grid / block / launch shape) and the bytes it moves: what
    a reader needs to judge it against its floor."""
    missing = []
    for rel, fn in _kernels():
        doc = (ast.get_docstring(fn) or "").lower()
        shape = any(w in doc for w in ("launch", "grid", "block"))
        moved = any(w in doc for w in ("byte", "moves", "reads"))
        if not (shape and moved):
            missing.append(f"{rel}:{fn.name}")
    assert not missing, "kernel docstrings without launch shape and bytes: " + ", ".join(missing)
