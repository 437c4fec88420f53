"""Every environment variable the engine reads, in one place (docs/KERNELS.md lists them for users).

    NUMBA_ENABLE_CUDASIM=1      numba's CUDA simulator: kernels run as Python threads (backend `sim`, tests)
    NUMBAENGINE_PDL             programmatic dependent launch: wait (default) or off
    NUMBAENGINE_GEMM_WG=0       dense GEMMs on the mma.sync path everywhere (default 1: wgmma where it applies)
    NUMBAENGINE_CACHE_DIR       the compiled-kernel cache's folder (default $XDG_CACHE_HOME/numbaengine/kernels)
    NUMBAENGINE_KERNEL_CACHE=0  no compiled-kernel cache
    NUMBAENGINE_POISON=1        the cuda op table fills scratch with NaN / -1 (finds reads of unwritten memory)
    NUMBAENGINE_PHASES=FILE     phases.record appends one JSON line per phase (numbaengine.profile sets it)

SIM, PDL and GEMM_WG are read once, at import (they decide how kernels are compiled; SIM before numba is imported);
the others at each use, so a process can change them between runs.
"""
import os
from pathlib import Path

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

PDL_MODES = {"": "wait", "wait": "wait", "1": "wait", "0": None, "off": None}


def pdl_mode(value):
    """NUMBAENGINE_PDL's value -> "wait" or None (off); anything else is an error."""
    if value not in PDL_MODES:
        raise ValueError(f"NUMBAENGINE_PDL={value!r}: use one of wait (default), off")
    return PDL_MODES[value]


PDL = pdl_mode(os.environ.get("NUMBAENGINE_PDL", "").strip().lower())
GEMM_WG = os.environ.get("NUMBAENGINE_GEMM_WG", "1") != "0"


def cache_dir() -> Path:
    """NUMBAENGINE_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache)/numbaengine/kernels."""
    if os.environ.get("NUMBAENGINE_CACHE_DIR"):
        return Path(os.environ["NUMBAENGINE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numbaengine" / "kernels"


def cache_off() -> bool:
    """NUMBAENGINE_KERNEL_CACHE is 0 / off / false / no."""
    return os.environ.get("NUMBAENGINE_KERNEL_CACHE", "").strip().lower() in ("0", "off", "false", "no")


def simulator() -> bool:
    """NUMBA_ENABLE_CUDASIM=1 now (SIM is its value at import)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def poison() -> bool:
    return os.environ.get("NUMBAENGINE_POISON", "") == "1"


def phases_file() -> str | None:
    return os.environ.get("NUMBAENGINE_PHASES") or None
