"""On-disk cache of compiled GPU kernels (cubin and PTX), keyed by everything that changes their machine code.

numba's own `cache=True` names an entry by the function's file, name and line: two closures of one factory with
different constants would share it. Here the key is a sha256 over the kernel's code and the values it reads
(globals, closure cells, device functions and intrinsics, recursively), the argument types, the target options, the
GPU and the toolchain. A value of a kind the key cannot describe makes the kernel uncacheable: it is compiled as
without a cache. kernel() installs the cache on every dispatcher it makes.

Layout: one file <key>.nbk per kernel and argument types under cache_dir(): a header (8-byte magic, u32 format,
32-byte key, 32-byte sha256 of the payload, u64 payload bytes; little-endian) then the payload, numba's pickled
_Kernel state. Entries are written to a temp file and renamed, so writers racing on one key leave one whole entry;
a damaged entry is reported in one line, recompiled and rewritten.
Settings: NUMBAENGINE_CACHE_DIR (default: $XDG_CACHE_HOME or ~/.cache, then numbaengine/kernels),
NUMBAENGINE_KERNEL_CACHE=0 (off), configure(); never under the simulator.
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.metadata
import os
import pickle
import re
import struct
import sys
import tempfile
import threading
import time
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from numbaengine import env, phases

FORMAT = 1
MAGIC = b"NBEKRNL\n"
_HEADER = struct.Struct("<8sI32s32sQ")       # magic, format, key, sha256(payload), payload bytes
_ENTRY = re.compile(r"[0-9a-f]{64}\.nbk")
_TEMP = re.compile(r"\.[0-9a-f]{64}\..+\.tmp")
_TABLE = re.compile(r"[0-9a-f]{64}\.json")
COST_TABLES = "cost_tables"                  # budget auto's measured cost tables (numbaengine/cost_store.py)
_LIBRARIES = ("numba", "numba_cuda", "llvmlite", "numpy", "cuda")
_PACKAGES = ("numba", "numba-cuda", "llvmlite", "numpy", "cuda-bindings", "cuda-core", "nvidia-nvvm",
             "nvidia-nvjitlink", "nvidia-cuda-nvcc")
_KNOBS = ("OPT", "BOUNDSCHECK", "FORCE_CUDA_CC", "CUDA_DEFAULT_PTX_CC", "DEBUGINFO_DEFAULT", "CUDA_DEBUGINFO_DEFAULT",
          "EXTEND_VARIABLE_LIFETIMES", "NRT_STATS", "CUDA_USE_NVIDIA_BINDING")


# ------------------------------------------------------------------------------------------------------------ key
class Uncacheable(Exception):
    """A kernel reads a value whose effect on its machine code the key cannot describe."""


_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_CODE = {}                                  # code object -> digest (immutable; the entry keeps the object alive)
_FIRST = weakref.WeakKeyDictionary()        # device dispatcher -> its digest when first hashed


def _sha(*parts) -> bytes:
    """sha256 of length-prefixed parts (str, bytes or anything str() describes)."""
    h = hashlib.sha256()
    for p in parts:
        p = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()


def _code(code) -> bytes:
    """Digest of a code object: bytecode, constants (nested code included), names; not its file or lines."""
    if code not in _CODE:
        consts = [_code(c) if isinstance(c, types.CodeType) else _Digest()(c) for c in code.co_consts]
        _CODE[code] = _sha("code", code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                           code.co_cellvars, code.co_argcount, code.co_kwonlyargcount, code.co_flags,
                           getattr(code, "co_exceptiontable", b""), *consts)
    return _CODE[code]


_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"}


@functools.cache
def _reads(code) -> tuple[frozenset, frozenset]:
    """(global names, all names: globals and attributes) used by a code object and the code nested in it. Globals
    come from the global opcodes alone (as cloudpickle takes them), not from attribute names that match a global."""
    found = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            inner, inner_names = _reads(c)
            found |= inner
            names |= inner_names
    return frozenset(found), frozenset(names)


def _repr(obj) -> str:
    """repr() for values whose repr is their identity; one holding an address is not."""
    r = repr(obj)
    if " at 0x" in r:
        raise Uncacheable(f"{type(obj).__qualname__} {r}")
    return r


class _Digest:
    """Digests of the values a kernel's code depends on, one walk (shared device functions hashed once)."""

    def __init__(self, trace=None):
        self.memo, self.active = {}, set()
        self.trace, self.path = trace, []        # trace: path of every named part -> its digest (diagnosis)

    def _at(self, label, obj, names=()) -> bytes:
        """self(obj, names) as the part `label` of the one being hashed (recorded in the trace, when kept)."""
        if self.trace is None:
            return self(obj, names)
        self.path.append(str(label))
        try:
            digest = self(obj, names)
        finally:
            path = "/".join(self.path)
            self.path.pop()
        self.trace.setdefault(path, digest.hex()[:16])
        return digest

    def __call__(self, obj, names=()) -> bytes:
        from numba.core import types as nbtypes
        from numba.cuda.dispatcher import CUDADispatcher
        from numba.cuda.extending import _Intrinsic
        if type(obj) in _SCALARS:
            return _sha("s", type(obj).__name__, repr(obj))
        if isinstance(obj, types.FunctionType):
            return self._node(obj, self._function)
        if isinstance(obj, CUDADispatcher):
            return self._node(obj, self._dispatcher)
        if isinstance(obj, _Intrinsic):
            return _sha("intrinsic", obj._name, self(obj._defn), self(obj._prefer_literal))
        if isinstance(obj, types.ModuleType):
            return self._module(obj, names)
        if isinstance(obj, nbtypes.Type):
            return _sha("type", type(obj).__qualname__, _repr(obj))
        return self._data(obj)

    def _data(self, obj) -> bytes:
        """Plain data: containers, NumPy values, classes, frozen dataclasses, enum members."""
        if isinstance(obj, (tuple, list)):
            return _sha(type(obj).__qualname__, *[self(x) for x in obj])
        if isinstance(obj, dict):
            return _sha("dict", *sorted(self(k) + self(v) for k, v in obj.items()))
        if isinstance(obj, (set, frozenset)):
            return _sha("set", *sorted(self(x) for x in obj))
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise Uncacheable("object array")
            return _sha("array", obj.dtype.descr, obj.shape, np.ascontiguousarray(obj).tobytes())
        if isinstance(obj, np.generic):
            return _sha("np", obj.dtype.descr, obj.tobytes())
        if isinstance(obj, np.dtype):
            return _sha("dtype", obj.descr)
        if isinstance(obj, type):
            return _sha("class", obj.__module__, obj.__qualname__)
        if isinstance(obj, (types.BuiltinFunctionType, np.ufunc)):
            return _sha("builtin", type(obj).__name__, getattr(obj, "__module__", None), obj.__name__)
        if isinstance(obj, enum.Enum):
            return _sha("enum", type(obj).__qualname__, obj.name, self(obj.value))
        if dataclasses.is_dataclass(obj) and type(obj).__dataclass_params__.frozen:
            return _sha("dataclass", type(obj).__qualname__,
                        *[f.name.encode() + self(getattr(obj, f.name)) for f in dataclasses.fields(obj)])
        if type(obj).__module__.startswith("llvmlite.ir") and isinstance(obj, _llvm_type()):
            return _sha("llvm", str(obj))
        raise Uncacheable(f"a {type(obj).__module__}.{type(obj).__qualname__} value")

    def _node(self, obj, build) -> bytes:
        """Memoized digest of a function, dispatcher or module; a cycle back to one being hashed is named."""
        k = id(obj)
        if k in self.memo:
            return self.memo[k]
        if k in self.active:
            return _sha("cycle", getattr(obj, "__qualname__", getattr(obj, "__name__", "")))
        self.active.add(k)
        try:
            self.memo[k] = build(obj)
        finally:
            self.active.discard(k)
        return self.memo[k]

    def _function(self, fn) -> bytes:
        """A library's function by name (its version is in the key); any other by its code and what it reads."""
        if _library(fn.__module__ or ""):
            return _sha("library function", fn.__module__, fn.__qualname__)
        global_names, names = _reads(fn.__code__)
        cells = [self._at(name, c.cell_contents, names) if _filled(c) else b"empty"
                 for name, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())]
        return _sha("function", fn.__module__, fn.__qualname__, _code(fn.__code__), self(fn.__defaults__),
                    self(fn.__kwdefaults__ or {}), *cells, self._globals(fn.__globals__, global_names, names))

    def _globals(self, scope, global_names, names) -> bytes:
        """The values of the globals a function reads (builtins by name); `names` for modules' attributes."""
        parts = []
        for name in sorted(global_names):
            if name in scope:
                parts += [name, self._at(name, scope[name], names)]
            elif hasattr(builtins, name):
                parts += [name, "builtin"]
        return _sha("globals", *parts)

    def _module(self, mod, names) -> bytes:
        """A library module by its package's name (its version is in the key: numba-cuda redirects some of its
        modules to numba's, so one module's __name__ can differ between processes); any other (the project's) by
        name and the values of the attributes the function may read from it (M.X): those of a kind numba could not
        read are skipped."""
        if _library(mod.__name__):
            return _sha("library module", mod.__name__.split(".")[0])
        if id(mod) in self.active:
            return _sha("module", mod.__name__)
        self.active.add(id(mod))
        parts = []
        for name in sorted(n for n in names if n in vars(mod)):
            with contextlib.suppress(Uncacheable):
                parts += [name, self._at(f"{mod.__name__}.{name}", vars(mod)[name], names)]
        self.active.discard(id(mod))
        return _sha("module", mod.__name__, *parts)

    def _dispatcher(self, d) -> bytes:
        """A device function: its Python function and options. numba keeps a device function's compiled overloads,
        so one whose reads changed (a global flipped with setattr) after it was compiled would put stale code in
        new kernels: those kernels are not cached."""
        digest = _sha("dispatcher", self(d.py_func), self._at("targetoptions", d.targetoptions))
        if _FIRST.setdefault(d, digest) != digest and d.overloads:
            raise Uncacheable(f"{d.py_func.__qualname__} changed after it was compiled")
        return digest


def _library(module_name) -> bool:
    """Whether a module belongs to the standard library or a package whose version is in toolchain()."""
    top = module_name.split(".")[0]
    return top in sys.stdlib_module_names or top in _LIBRARIES


def _filled(cell) -> bool:
    """Whether a closure cell holds a value (a cell of a name not yet assigned does not)."""
    try:
        cell.cell_contents  # noqa: B018 - reading an empty cell raises ValueError
    except ValueError:
        return False
    return True


@functools.cache
def _llvm_type():
    from llvmlite import ir
    return ir.Type


@functools.cache
def toolchain(cc) -> tuple:
    """What besides the source decides the machine code: the compute capability, the CUDA driver and NVVM versions,
    the compiler packages' versions, Python's, and numba's codegen settings."""
    import numba.core.config as numba_config
    from numba.cuda.core import config
    from numba.cuda.cudadrv import nvvm
    from numba.cuda.cudadrv.driver import driver
    try:
        drv = driver.get_version()
    except Exception:  # no driver (CPU machine): such keys never meet a GPU's
        drv = None
    versions = []
    for name in _PACKAGES:
        try:
            versions.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((name, None))
    knobs = [(k, str(getattr(cfg, k, None))) for cfg in (config, numba_config) for k in _KNOBS]
    nv = nvvm.NVVM()
    return (tuple(cc), drv, nv.get_version(), nv.get_ir_version(), tuple(versions), sys.version_info[:2],
            tuple(knobs))


def key_parts(py_func, argtypes, targetoptions, env, trace=None) -> tuple[bytes, bytes, bytes, bytes]:
    """Digests of a kernel's function (code and everything it reads), argument types, options and env
    (toolchain(cc)). Raises Uncacheable for a value of a kind they cannot describe. trace: a dict that gets the
    digest of every part the function reads, by path (cell, global and attribute names): first_difference()."""
    d = _Digest(trace)
    return d(py_func), d(tuple(argtypes)), d(targetoptions), d(env)


def first_difference(a: dict, b: dict) -> str | None:
    """Where two key_parts traces part: the deepest path whose digests differ (one read on both sides first, then
    one read on a side only), or None."""
    paths = [p for p in a.keys() | b.keys() if a.get(p) != b.get(p)]
    return max(paths, key=lambda p: (p in a and p in b, p.count("/"), p)) if paths else None


def kernel_key(py_func, argtypes, targetoptions, env) -> str:
    """Hex sha256 naming a kernel's entry (key_parts)."""
    return hashlib.sha256(_sha(f"numbaengine kernel {FORMAT}",
                               *key_parts(py_func, argtypes, targetoptions, env))).hexdigest()


# -------------------------------------------------------------------------------------------------------- storage
def entry_path(directory, key) -> Path:
    return Path(directory) / f"{key}.nbk"


def write_entry(directory, key, payload: bytes):
    """Write key's entry atomically: a temp file in the same folder, renamed over the entry."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    header = _HEADER.pack(MAGIC, FORMAT, bytes.fromhex(key), hashlib.sha256(payload).digest(), len(payload))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + payload)
        os.replace(tmp, entry_path(directory, key))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_entry(directory, key) -> bytes | None:
    """key's payload; None when there is no entry, or (reported in one line) a damaged one."""
    path = entry_path(directory, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn(f"cannot read {path} ({e.strerror}): compiling the kernel")
        return None
    problem = _damage(data, key)
    if problem:
        _COUNTS.damaged += 1
        warn(f"{path} {problem}: compiling the kernel again")
        return None
    return data[_HEADER.size:]


def _damage(data, key) -> str | None:
    """What is wrong with an entry's bytes, or None."""
    if len(data) < _HEADER.size:
        return "is truncated"
    magic, fmt, k, digest, size = _HEADER.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT:
        return "is not a kernel cache entry of this format"
    if k != bytes.fromhex(key):
        return "holds another key"
    if len(data) - _HEADER.size != size:
        return "is truncated"
    if hashlib.sha256(data[_HEADER.size:]).digest() != digest:
        return "is corrupt"
    return None


def cache_files(directory) -> list[Path]:
    """The files this cache wrote in `directory`: entries and temp files left by killed writers."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _ENTRY.fullmatch(p.name) or _TEMP.fullmatch(p.name))


def usage(directory) -> tuple[int, int]:
    """(entries, bytes) held in `directory`."""
    entries = [p for p in cache_files(directory) if p.suffix == ".nbk"]
    return len(entries), sum(p.stat().st_size for p in entries)


def clear(directory) -> int:
    """Remove the files this cache wrote in `directory` and the cost tables kept beside them (nothing else)
    -> how many."""
    tables = Path(directory) / COST_TABLES
    files = cache_files(directory)
    if tables.is_dir():
        files += [p for p in tables.iterdir() if _TABLE.fullmatch(p.name) or _TEMP.fullmatch(p.name)]
    for p in files:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    with contextlib.suppress(OSError):
        tables.rmdir()                       # only when empty
    return len(files)


def pack(kernel) -> bytes:
    """A compiled numba kernel (_Kernel) -> payload bytes: its state with the PTX and cubins."""
    from numba.cuda.serialize import dumps
    return dumps(kernel._reduce_states())


def unpack(payload: bytes):
    from numba.cuda.dispatcher import _Kernel
    return _Kernel._rebuild(**pickle.loads(payload))


_WARNED = set()


def warn(message):
    """One line on stderr, once per message."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"numbaengine: kernel cache: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ settings, stats
@dataclass
class _Settings:
    directory: Path | None = None      # None: NUMBAENGINE_CACHE_DIR or the user's cache folder
    enabled: bool = True


@dataclass
class _Counters:
    hits: int = 0                      # kernels loaded from the cache
    misses: int = 0                    # kernels compiled
    uncacheable: int = 0               # of those, kernels the key cannot describe (not saved)
    damaged: int = 0                   # damaged entries met (compiled again)
    compile_s: float = 0.0
    load_s: float = 0.0


_SETTINGS = _Settings()
_COUNTS = _Counters()
_UNCACHEABLE = {}                      # kernel name -> why the key cannot describe it
_LOCK = threading.Lock()


def configure(directory=None, enabled=True):
    """Where entries live (None: the default) and whether kernels use them: the CLI's --kernel-cache DIR and
    --no-kernel-cache. NUMBAENGINE_KERNEL_CACHE=0 keeps the cache off whatever this says."""
    _SETTINGS.directory = Path(directory).expanduser() if directory else None
    _SETTINGS.enabled = bool(enabled)


def cache_dir() -> Path:
    if _SETTINGS.directory is not None:
        return _SETTINGS.directory
    return env.cache_dir()


def enabled() -> bool:
    return _SETTINGS.enabled and not env.cache_off() and not env.simulator()


def stats() -> dict:
    """This process's kernel counts and seconds (hits: loaded, misses: compiled), why kernels were uncacheable,
    and the cache's folder."""
    with _LOCK:
        counts = dataclasses.asdict(_COUNTS)
        why = [f"{name}: {reason}" for name, reason in sorted(_UNCACHEABLE.items())]
    counts["compile_s"], counts["load_s"] = round(counts["compile_s"], 3), round(counts["load_s"], 3)
    return {**counts, "uncacheable_why": why, "dir": str(cache_dir()), "enabled": enabled()}


def _count(**add):
    with _LOCK:
        for name, value in add.items():
            setattr(_COUNTS, name, getattr(_COUNTS, name) + value)


# ----------------------------------------------------------------------------------------------- dispatcher hook
def _argtypes(sig) -> tuple:
    from numba.cuda.core import sigutils
    return tuple(sigutils.normalize_signature(sig)[0])


def current_cc() -> tuple:
    from numba.cuda import dispatcher
    return tuple(dispatcher.get_current_device().compute_capability)


class KernelCache:
    """numba's per-dispatcher cache interface (what CUDADispatcher.compile calls: load_overload, save_overload) over
    the entries above. fetch() reads an entry ahead of compile(), so that install() can tell a load from a compile."""

    def __init__(self, dispatcher):
        self.py_func, self.targetoptions = dispatcher.py_func, dispatcher.targetoptions
        self.dispatcher = weakref.ref(dispatcher)
        self._keys, self._loaded = {}, {}       # argument types -> key; -> kernel read by fetch()

    @property
    def cache_path(self):
        return str(cache_dir())

    def key(self, argtypes) -> str | None:
        """The entry's key for these argument types on the current GPU; None when uncacheable (the reason is kept
        for stats())."""
        try:
            return kernel_key(self.py_func, argtypes, self.targetoptions, toolchain(current_cc()))
        except Uncacheable as e:
            with _LOCK:
                _UNCACHEABLE[self.py_func.__qualname__] = str(e)
            return None

    def fetch(self, argtypes) -> bool:
        """Read argtypes' entry for the next load_overload(); True on a hit."""
        if not enabled():
            return False
        t0 = time.perf_counter()
        key = self._keys[argtypes] = self.key(argtypes)
        if key is None:
            _count(uncacheable=1)
            return False
        payload = read_entry(cache_dir(), key)
        if payload is None:
            return False
        try:
            kern = unpack(payload)
            kern.bind()                         # loaded into the context as compile() does (carveout included)
            self._loaded[argtypes] = kern
        except Exception as e:  # an entry numba cannot rebuild: compile instead (and overwrite it)
            warn(f"{entry_path(cache_dir(), key)} cannot be loaded ({type(e).__name__}): compiling the kernel")
            return False
        _count(hits=1, load_s=time.perf_counter() - t0)
        return True

    def compiled_elsewhere(self, argtypes) -> bool:
        """In a dry run, after fetch() missed: have the pool compile the kernel, wait, load the entry; True on a hit."""
        key = self._keys.get(argtypes)
        future = _note(key, self, argtypes) if _DRY.on and key is not None else None
        if future is None:
            return False
        try:
            with phases.span("compile"):            # waiting for a worker is compile time, not the caller's phase
                future.result()
        except Exception:  # the worker could not compile it: compile here
            return False
        return self.fetch(argtypes)

    def load_overload(self, sig, target_context):
        return self._loaded.pop(_argtypes(sig), None)

    def save_overload(self, sig, kernel):
        """Write the entry of a kernel just compiled (not one whose code depends on its launch configuration)."""
        key = self._keys.pop(_argtypes(sig), None)
        if key is None or not enabled() or getattr(kernel, "launch_config_sensitive", False):
            return
        try:
            write_entry(cache_dir(), key, pack(kernel))
        except OSError as e:
            warn(f"cannot write to {cache_dir()} ({e.strerror}): kernels are not cached")
        except Exception as e:  # numba cannot serialize this kernel (linked files, device arrays): not cached
            warn(f"{self.py_func.__qualname__} is not cached ({type(e).__name__}: {e})")

    def enable(self):
        pass

    def disable(self):
        pass

    def flush(self):
        pass


def install(dispatcher):
    """Make a numba kernel dispatcher load its overloads from the cache and save those it compiles; each real compile
    is timed as phases.span("compile"). -> the dispatcher."""
    from numba.cuda.core.compiler_lock import global_compiler_lock
    cache = dispatcher._cache = KernelCache(dispatcher)
    plain = dispatcher.compile

    def compile(sig):
        argtypes = _argtypes(sig)
        with global_compiler_lock:
            if argtypes in dispatcher.overloads or cache.fetch(argtypes) or cache.compiled_elsewhere(argtypes):
                return plain(sig)
            t0 = time.perf_counter()
            with phases.span("compile"):
                kern = plain(sig)
            _count(misses=1, compile_s=time.perf_counter() - t0)
            return kern

    dispatcher.compile = compile
    return dispatcher


# ------------------------------------------------------------------------------------------------------- dry run
@dataclass
class _DryRun:
    on: bool = False
    submit: object = None                         # (key, KernelCache, argument types) -> future, or None
    found: dict = field(default_factory=dict)     # key -> (KernelCache, argument types, future or None)
    seen: set = field(default_factory=set)        # (id(dispatcher), argument types) already looked at


_DRY = _DryRun()


@contextlib.contextmanager
def recording(submit=None):
    """Context: a dry run. launch() runs nothing and notes each kernel neither compiled nor cached, handing it to
    submit(key, its KernelCache, argument types) -> a future of its compile elsewhere (precompile's pool). Host code
    that compiles a kernel itself (to query it) then waits for that future and loads the entry. Yields the dict
    key -> (KernelCache, argument types, future)."""
    _DRY.on, _DRY.submit, _DRY.found, _DRY.seen = True, submit, {}, set()
    try:
        yield _DRY.found
    finally:
        _DRY.on, _DRY.submit = False, None


def dry_run() -> bool:
    """Whether a dry run (recording()) is in progress: launches are skipped."""
    return _DRY.on


def _note(key, kernel_cache, argtypes):
    """A missing kernel of the dry run, noted and submitted once -> the future of its compile (None: no submit)."""
    with _LOCK:
        if key not in _DRY.found:
            future = _DRY.submit(key, kernel_cache, argtypes) if _DRY.submit else None
            _DRY.found[key] = (kernel_cache, argtypes, future)
        return _DRY.found[key][2]


def record_launch(kern, args) -> bool:
    """launch()'s hook: in a dry run, note `kern` for these arguments when its entry is missing, load it when it is
    cached -> True (skip the launch); False outside a dry run."""
    if not _DRY.on:
        return False
    cache = getattr(kern, "_cache", None)
    if not isinstance(cache, KernelCache):
        return True
    argtypes = tuple(kern.typeof_pyval(a) for a in args)
    with _LOCK:
        new = (id(kern), argtypes) not in _DRY.seen
        _DRY.seen.add((id(kern), argtypes))
    key = cache.key(argtypes) if new and argtypes not in kern.overloads else None
    if key is None:
        return True
    if entry_path(cache_dir(), key).exists():
        with phases.span("load"):               # loaded now, not at its first launch inside the timed run
            kern.compile(argtypes)
    else:
        _note(key, cache, argtypes)
    return True


def load_compiled(found):
    """After a dry run: load the kernels the workers compiled (recording()'s dict) into their dispatchers, so that
    the run after loads nothing at first launch."""
    with phases.span("load"):
        for kernel_cache, argtypes, future in found.values():
            disp = kernel_cache.dispatcher()
            if disp is None or future is None or argtypes in disp.overloads:
                continue
            if future.done() and future.exception() is None:
                disp.compile(argtypes)          # a cache hit: the worker wrote the entry
