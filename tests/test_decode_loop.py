"""One decoding loop (read with ast, no import): generate.decode is the only place in numbaengine/ (kernels/ aside)
that runs rounds. Engine.generate / generate_batch on every backend and the server's scheduler decode through it;
the round itself lives in ddtree.py (host) and device_round.py (device), behind rounds.py's interface."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "numbaengine"
ROUND_CALLS = {"step", "probe", "decode_round", "auto_round"}     # what runs a round (or all the rounds' step)
IMPLEMENTATIONS = {"ddtree.py", "budget.py", "rounds.py", "device_round.py"}


def calls(path):
    """(enclosing function, called name) of every call in a module; a method or attribute call by its attribute."""
    found = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                found.append((fn, name))
            visit(child, inner)
    visit(ast.parse(path.read_text(), filename=str(path)), None)
    return found


def test_one_loop_runs_rounds():
    """Outside the round's implementations, the only call of a round is generate.step, called by generate.decode
    alone; inside them, a round is only called by the step that delegates to it, and by DeviceRounds.costs, which
    times rounds of dummy slots (no sequence decodes) for budget auto's cost table."""
    outside, inside = set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("kernels/"):               # device code (its `step` helpers are not rounds)
            continue
        for fn, name in calls(path):
            if name in ROUND_CALLS:
                (inside if rel in IMPLEMENTATIONS else outside).add((rel, fn, name))
    assert outside == {("generate.py", "step", "step"), ("generate.py", "decode", "step")}, outside
    assert {fn for _, fn, _ in inside} <= {"step", "probe", "auto_step", "costs"}, inside
    assert {fn for rel, fn, _ in inside if fn == "costs"} <= {"costs"} and \
        all(rel == "device_round.py" for rel, fn, _ in inside if fn == "costs"), inside
    assert ("rounds.py", "step", "decode_round") in inside and ("rounds.py", "auto_step", "auto_round") in inside
