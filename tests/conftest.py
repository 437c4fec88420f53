"""GPU tests carry the `gpu` marker and are deselected (and reported) when no GPU is present."""
import os

pytest_plugins = ["gpu_faults", "pytester"]   # gpu_faults: after a device fault, later GPU tests error naming it


def _gpu_present() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # numba-cuda missing or no driver
        return False


def pytest_collection_modifyitems(config, items):
    # the simulator cases' results last: the CPU tests run while the simulator children work on both cores
    items.sort(key=lambda item: item.name.startswith("test_simulator"))      # stable: the order within is kept
    if _gpu_present():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)


def pytest_collection_finish(session):
    """Start the simulator children of every module whose simulator cases were selected, all at once."""
    modules = []
    for item in session.items:
        name = item.module.__name__
        if item.name.startswith("test_simulator") and hasattr(item.module, "SIM_CASES") and name not in modules:
            modules.append(name)
    if modules:
        import cudasim
        cudasim.start(modules)


def pytest_terminal_summary(terminalreporter):
    """The slowest simulator cases by their CPU seconds in the child processes (pytest's --durations shows only the
    wait of the first test that reads a module's children): what keeps the CPU suite's time in check."""
    import sys
    cudasim = sys.modules.get("cudasim")
    if cudasim is None or not cudasim.SECONDS:
        return
    ranked = sorted(cudasim.SECONDS.items(), key=lambda kv: -kv[1])
    total = sum(cudasim.SECONDS.values())
    terminalreporter.write_sep("=", f"simulator cases: {total:.0f} CPU s in all, slowest 12")
    for name, sec in ranked[:12]:
        terminalreporter.write_line(f"{sec:8.1f}s  {name}")
