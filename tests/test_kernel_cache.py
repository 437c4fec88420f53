"""The kernel cache (numbaengine/kernels/cache.py) and its warmup command: keys that change with everything that
changes the machine code and only with it (also across processes), entries that survive save -> load, damage and
racing writers, the off switches, the dry run, and `python -m numbaengine.warmup --size / --clear`.

Without a GPU, real kernels are compiled to PTX for sm_90 (NVVM wheel) with the device's compute capability, the
module load and the CUDA context stubbed out (`as_sm90`); the gpu tests run the real path in fresh processes."""
import functools
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from numba import cuda
from numba import types as ty

import numbaengine.kernels.device as dev
import numbaengine.kernels.launch as kl
from numbaengine import phases
from numbaengine.kernels import cache

ENV = ((9, 0), "toolchain")                      # a stand-in for cache.toolchain(cc)
SIG = (ty.float32[::1],)
SCALE = 2.0                                      # a module global read by `scaled`
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Cfg:
    rows: int
    scale: float


def key(fn, sig=SIG, options=None, env=ENV):
    return cache.kernel_key(fn, sig, options or {"fastmath": False}, env)


def closure(c):
    def k(x):
        x[0] = x[0] * c
    return k


def scaled(x):
    x[0] = x[0] * SCALE


def uses_project_attr(x):
    x[0] = dev.FULL


def with_cfg(cfg):
    def k(x):
        for i in range(cfg.rows):
            x[i] = x[i] * cfg.scale
    return k


def with_device_fn(c):
    @cuda.jit(device=True)
    def helper(v):
        return v * c

    def k(x):
        x[0] = helper(x[0])
    return k


def with_intrinsic(n):
    wait = dev.cp_wait(n)

    def k(x):
        wait()
        x[0] = 1.0
    return k


def with_load():
    load = dev.ld16        # its typer reads types.uint32: an attribute named like device.py's global uint32

    def k(x, w):
        a, b, c, d = load(w, 0)
        x[0] = a + b + c + d
    return k


# ------------------------------------------------------------------------------------------------------------- key
def test_key_follows_closure_constants_code_and_globals(monkeypatch):
    assert key(closure(2.0)) == key(closure(2.0))                # two closures built separately
    assert key(closure(2.0)) != key(closure(3.0))
    assert key(closure(2)) != key(closure(2.0))                  # int vs float: other machine code

    def other(x):
        x[0] = x[0] + 1.0
    assert key(scaled) != key(other)                             # the code
    before = key(scaled)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)     # a global flipped at run time
    assert key(scaled) != before
    before = key(uses_project_attr)
    monkeypatch.setattr(dev, "FULL", 0x7FFFFFFF)                 # M.X on a project module
    assert key(uses_project_attr) != before


def test_trace_names_where_two_keys_part(monkeypatch):
    """The trace of a key names the deepest value read that differs: here a global of a device function that a
    kernel's closure holds (how precompile reports a kernel whose key differs in a fresh process)."""
    def traced():
        trace = {}
        cache.key_parts(with_device_fn(2.0), (ty.float32[::1],), {}, "env", trace)
        return trace
    before = traced()
    assert cache.first_difference(before, traced()) is None
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)    # not read by that kernel: same keys
    assert cache.first_difference(before, traced()) is None
    assert cache.first_difference(before, {**before, "helper/targetoptions": "x"}) == "helper/targetoptions"
    after = {}
    cache.key_parts(with_device_fn(3.0), (ty.float32[::1],), {}, "env", after)
    assert cache.first_difference(before, after) == "helper/c", after


def test_library_modules_are_named_by_their_package():
    """A library's module is named by its package (the version is in the key): numba-cuda redirects some of its
    modules to numba's, so the same module's __name__ may differ between processes."""
    import numba.core.types
    import numba.cuda.types
    digest = cache._Digest()
    assert digest(numba.core.types) == digest(numba.cuda.types) == digest(numba)
    assert digest(numba.core.types) != digest(np)


def test_key_follows_config_sig_options_and_gpu():
    cfg = Cfg(rows=4, scale=0.5)
    base = key(with_cfg(cfg))
    assert base == key(with_cfg(Cfg(rows=4, scale=0.5)))
    assert base != key(with_cfg(replace(cfg, rows=8)))           # a frozen dataclass field
    assert base != key(with_cfg(cfg), sig=(ty.float32[:],))      # argument types (layout)
    assert base != key(with_cfg(cfg), sig=(ty.float64[::1],))
    assert base != key(with_cfg(cfg), options={"fastmath": True})
    assert base != key(with_cfg(cfg), env=((8, 0), "toolchain"))  # compute capability


def test_key_follows_device_functions_and_intrinsics():
    assert key(with_device_fn(2.0)) == key(with_device_fn(2.0))
    assert key(with_device_fn(2.0)) != key(with_device_fn(3.0))
    assert key(with_intrinsic(1)) != key(with_intrinsic(2))     # the intrinsic's PTX text is closed over


def test_unknown_values_make_a_kernel_uncacheable():
    class Box:
        pass

    @dataclass
    class Mutable:
        n: int = 1
    for value in (Box(), Mutable(), functools.partial(max, 1), np.array([object()])):
        with pytest.raises(cache.Uncacheable):
            key(closure(value))


def test_real_kernel_key_same_in_fresh_processes(tmp_path):
    """A project kernel (grid_dep, device functions, intrinsics) built in two fresh processes with other hash
    seeds, and a closure pickled by value with cloudpickle and hashed in a child, as precompile's workers do."""
    try:
        import cloudpickle
    except ImportError:  # numba-cuda's copy, as numbaengine.warmup uses then
        from numba.cuda import cloudpickle
    script = textwrap.dedent("""
        import pickle, sys
        from numba import types as ty
        from numbaengine.kernels import cache
        from numbaengine.kernels.prep import build_prep
        k = build_prep(2, 1)
        sig = (ty.float32[:, :], ty.uint32[::1], ty.int32, ty.int32)
        keys = [cache.kernel_key(k.py_func, sig, k.targetoptions, ((9, 0), "toolchain"))]
        for fn, sig, options in pickle.load(open(sys.argv[1], "rb")):
            keys.append(cache.kernel_key(fn, sig, options, ((9, 0), "toolchain")))
        print(" ".join(keys))
    """)
    job = tmp_path / "job.pkl"
    fns = [with_device_fn(2.5), make_kernel(2.5).py_func, with_intrinsic(3), with_load()]
    job.write_bytes(cloudpickle.dumps([(fn, SIG, {"fastmath": False}) for fn in fns]))
    outs = [_python(script, str(job), env={"PYTHONHASHSEED": seed}).split() for seed in ("1", "2")]
    assert outs[0] == outs[1]
    assert outs[0][1:] == [key(fn) for fn in fns]


def test_device_function_changed_after_compiling_is_uncacheable(as_sm90, monkeypatch):
    """numba keeps a device function's compiled code: after a global it reads is flipped, a new kernel calling it
    would embed the old code, so such a kernel gets no entry."""
    @cuda.jit(device=True)
    def helper(v):
        return v * SCALE

    def k(x):
        x[0] = helper(x[0])
    key(k)
    cuda.compile_ptx(k, SIG, cc=(9, 0))                          # helper compiled with SCALE = 2.0
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)
    with pytest.raises(cache.Uncacheable, match="changed after it was compiled"):
        key(k)


# ---------------------------------------------------------------------------------------------------------- storage
def test_real_kernel_survives_save_and_load(as_sm90, tmp_path):
    """A numba kernel compiled for sm_90 -> entry -> a rebuilt kernel with the same PTX."""
    from numba.cuda.dispatcher import _Kernel
    kern = _Kernel(closure(np.float32(0.5)), SIG)
    k = key(closure(np.float32(0.5)))
    cache.write_entry(tmp_path, k, cache.pack(kern))
    back = cache.unpack(cache.read_entry(tmp_path, k))
    assert type(back) is _Kernel and back.argument_types == kern.argument_types
    ptx = back._codelibrary.get_asm_str(cc=(9, 0, "a"))
    assert ".entry" in ptx and ptx == kern._codelibrary.get_asm_str(cc=(9, 0, "a"))


@pytest.mark.parametrize("damage, words", [(lambda b: b[:-7], "truncated"), (lambda b: b[:40], "truncated"),
                                           (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "corrupt"),
                                           (lambda b: b"x" * 8 + b[8:], "not a kernel cache entry")])
def test_damaged_entry_is_reported_once_and_missed(tmp_path, capsys, damage, words):
    k = "ab" * 32
    cache.write_entry(tmp_path, k, b"payload" * 100)
    path = cache.entry_path(tmp_path, k)
    path.write_bytes(damage(path.read_bytes()))
    assert cache.read_entry(tmp_path, k) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and str(path) in err


def test_entry_of_another_key_is_not_loaded(tmp_path, capsys):
    a, b = "ab" * 32, "cd" * 32
    cache.write_entry(tmp_path, a, b"payload")
    os.replace(cache.entry_path(tmp_path, a), cache.entry_path(tmp_path, b))
    assert cache.read_entry(tmp_path, b) is None and "another key" in capsys.readouterr().err
    assert cache.read_entry(tmp_path, a) is None                 # no entry: silent
    assert capsys.readouterr().err == ""


def test_racing_writer_processes_leave_one_valid_entry(tmp_path, capsys):
    script = textwrap.dedent("""
        import sys
        from numbaengine.kernels import cache
        tag = int(sys.argv[2])
        for i in range(150):
            cache.write_entry(sys.argv[1], "ef" * 32, bytes([tag]) * (200_000 + 97 * i))
    """)
    writers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(t)], env=_env()) for t in (1, 2)]
    seen = set()
    while any(w.poll() is None for w in writers):
        payload = cache.read_entry(tmp_path, "ef" * 32)
        if payload is not None:
            seen.add(payload[0])
            assert len(set(payload)) == 1                           # one writer's bytes, whole
    assert [w.returncode for w in writers] == [0, 0]
    payload = cache.read_entry(tmp_path, "ef" * 32)
    assert payload is not None and payload[0] in (1, 2) and len(set(payload)) == 1
    assert capsys.readouterr().err == ""                         # never a damaged entry
    assert [p.name for p in tmp_path.iterdir()] == [f"{'ef' * 32}.nbk"]


# -------------------------------------------------------------------------------------------- the dispatcher hook
def make_kernel(c):
    @kl.kernel()
    def scale_k(x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] = x[i] * c
    return scale_k


def test_second_dispatcher_loads_instead_of_compiling(as_sm90, kernel_dir):
    before, spans = cache.stats(), phases.totals().get("compile", 0.0)
    first = make_kernel(1.5).compile(SIG)
    mid, mid_spans = cache.stats(), phases.totals().get("compile", 0.0)
    assert (mid["misses"] - before["misses"], mid["hits"] - before["hits"]) == (1, 0)
    assert mid_spans > spans                                     # the compile shows as phase "compile"
    assert len(cache.cache_files(kernel_dir)) == 1
    again = make_kernel(1.5).compile(SIG)                        # another dispatcher, same closure value
    after = cache.stats()
    assert (after["misses"] - mid["misses"], after["hits"] - mid["hits"]) == (0, 1)
    assert phases.totals().get("compile", 0.0) == mid_spans
    assert again._codelibrary.get_asm_str(cc=(9, 0, "a")) == first._codelibrary.get_asm_str(cc=(9, 0, "a"))
    make_kernel(2.5).compile(SIG)                                # another constant: its own entry
    assert cache.stats()["misses"] - after["misses"] == 1 and len(cache.cache_files(kernel_dir)) == 2


def test_damaged_entry_is_compiled_and_rewritten(as_sm90, kernel_dir, capsys):
    make_kernel(4.5).compile(SIG)
    (path,) = cache.cache_files(kernel_dir)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    before = cache.stats()
    make_kernel(4.5).compile(SIG)
    assert cache.stats()["misses"] - before["misses"] == 1 and cache.stats()["damaged"] - before["damaged"] == 1
    assert "truncated" in capsys.readouterr().err
    assert cache.read_entry(kernel_dir, path.stem) is not None  # rewritten whole
    make_kernel(4.5).compile(SIG)
    assert cache.stats()["hits"] - before["hits"] == 1


@pytest.mark.parametrize("how", ["env", "configure"])
def test_cache_off_compiles_and_writes_nothing(as_sm90, kernel_dir, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("NUMBAENGINE_KERNEL_CACHE", "0")
    else:
        cache.configure(kernel_dir, enabled=False)
    before = cache.stats()
    make_kernel(6.5).compile(SIG)
    make_kernel(6.5).compile(SIG)
    after = cache.stats()
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (2, 0)
    assert not after["enabled"] and cache.cache_files(kernel_dir) == []


def test_cache_dir_settings(monkeypatch, tmp_path):
    cache.configure()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("NUMBAENGINE_CACHE_DIR", raising=False)
    assert cache.cache_dir() == tmp_path / "xdg" / "numbaengine" / "kernels"
    monkeypatch.setenv("NUMBAENGINE_CACHE_DIR", str(tmp_path / "env"))
    assert cache.cache_dir() == tmp_path / "env"
    cache.configure(tmp_path / "flag")
    assert cache.cache_dir() == tmp_path / "flag"
    cache.configure()


# ---------------------------------------------------------------------------------------------- dry run, warmup
def test_dry_run_records_missing_kernels_and_launches_nothing(as_sm90, kernel_dir):
    cached, missing, fresh, big = make_kernel(7.5), make_kernel(8.5), make_kernel(7.5), make_kernel(9.5)
    cached.compile(SIG)
    x = np.ones(4, np.float32)
    with cache.recording() as found:
        for k in (fresh, missing, missing):
            kl.launch(k, 1, 32, x)
        kl.launch_smem(big, 1, 32, 96 * 1024, (x,))             # no compile to raise its shared memory limit
    assert [(kc.py_func, argtypes) for kc, argtypes, _ in found.values()] == [(missing.py_func, SIG),
                                                                              (big.py_func, SIG)]
    assert not missing.overloads and not big.overloads           # not compiled
    assert SIG in fresh.overloads                                # its entry loaded now, not at its first launch
    assert not cache.dry_run() and (x == 1).all()


POOL_SCRIPT = """
import functools, json, sys
import numpy as np
import numba.cuda.codegen as codegen
import numba.cuda.dispatcher as dispatcher
from numba import cuda

class Device:                   # as_sm90, in the spawned workers too: they run this file again as __mp_main__
    compute_capability = (9, 0)
dispatcher.get_current_device = Device
codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: cc or (9, 0, "a")
dispatcher._Kernel.bind = lambda self: None

import numbaengine.kernels.device as dev
from numbaengine.kernels import cache
from numbaengine.kernels.launch import kernel, launch
from numbaengine.warmup import precompile

@functools.cache                 # as the kernel families: one dispatcher per set of constants
def make(c):
    @kernel()
    def scale_k(x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] = x[i] * c
    return scale_k

@kernel()
def broken(x):
    x[0] = x.no_such_attribute

@kernel()
def flagged(x):
    x[0] = dev.F1                # a project module's attribute, set at run time below (not in the workers)

def run_once():
    x = np.ones(4, np.float32)
    queried = make(4.0)
    queried.compile(cache._argtypes("void(float32[::1])"))   # as attention.raise_smem_limit: a worker compiles it
    for k in (make(2.0), make(3.0), broken, queried, flagged):
        launch(k, 1, 32, x)
    raise IndexError("garbage read back from launches that never ran")

if __name__ == "__main__":
    dev.F1 = np.float32(2.0)
    cache.configure(sys.argv[1])
    from numbaengine import phases

    def in_prefill():                    # as the CLI's dry run: the engine's phases open around the launches
        with phases.span("prefill"):
            run_once()
    done = precompile(in_prefill, workers=2)
    spent = phases.totals()
    assert all(make(c).overloads for c in (2.0, 3.0)), "the workers' kernels are loaded by precompile"
    print(json.dumps([done.found, done.compiled, list(done.failed), cache.stats(), spent]))
"""


def test_precompile_compiles_in_worker_processes(tmp_path):
    """The dry run meets five kernels, one compiled by the host itself (it waits for its worker and loads the
    entry); two workers compile three (functions pickled by value, keys checked in the worker). One fails to
    compile, and one reads a module attribute the parent changed at run time (its key differs in the worker): both
    are left to the lazy path with one warning line; precompile loads the entries the workers wrote (phase load).
    The time spent waiting for the workers counts as compile; the dry run's own spans count as warmup, not as the
    real run's prefill and decode. (A CPU machine
    compiles as for sm_90 in the parent and the workers: POOL_SCRIPT.)"""
    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "kernels")], capture_output=True, text=True,
                       check=False, cwd=ROOT, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    found, compiled, failed, stats, spent = json.loads(r.stdout.splitlines()[-1])
    assert (found, compiled, len(failed)) == (5, 3, 2), failed
    assert sorted(f.split(":")[0] for f in failed) == ["broken", "flagged"]
    assert any("TypingError" in f for f in failed)
    assert any("differs" in f and "function" in f and "(at dev/numbaengine.kernels.device.F1)" in f for f in failed)
    assert "compiling kernels 5/5" in r.stderr and r.stderr.count("left to compile on first use") == 1
    assert (stats["hits"], stats["misses"]) == (3, 0) and len(cache.cache_files(tmp_path / "kernels")) == 3
    assert spent.get("compile", 0) > spent.get("warmup", 0), f"waiting for the workers is compile time: {spent}"
    assert spent.get("prefill", 0) == 0 < spent.get("warmup", 0), f"the dry run's spans are warmup: {spent}"
    assert spent.get("load", 0) > 0, spent


def test_precompile_in_a_script_without_main_guard_says_so(tmp_path):
    """A script that calls precompile at its top level (no `if __name__ == "__main__":`) is run again by every
    spawned worker, whose own precompile cannot start processes while it bootstraps: its warning line says what to
    change (the run goes on; kernels left over compile on first use)."""
    script = tmp_path / "unguarded.py"
    script.write_text(POOL_SCRIPT.split("if __name__")[0] + "cache.configure(sys.argv[1])\n"
                      "precompile(run_once, workers=1, progress=False)\n")
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "kernels")], capture_output=True, text=True,
                       check=False, cwd=ROOT, env=_env(), timeout=300)
    warning = [x for x in r.stderr.splitlines() if "left to compile on first use" in x]
    assert r.returncode == 0 and any('under `if __name__ == "__main__":`' in x for x in warning), r.stderr[-3000:]


def test_warmup_size_and_clear(tmp_path):
    keys = ["12" * 32, "34" * 32]
    for k in keys:
        cache.write_entry(tmp_path, k, b"p" * 1_000_000)
    (tmp_path / f".{keys[0]}.left.tmp").write_bytes(b"half")      # a killed writer's temp file
    (tmp_path / "notes.txt").write_text("not ours")
    out = _python("from numbaengine.warmup import main; raise SystemExit(main())", "--kernel-cache",
                  str(tmp_path), "--size")
    assert f"{tmp_path}: 2 entries, 2.0 MB" in out
    out = _python("from numbaengine.warmup import main; raise SystemExit(main())", "--kernel-cache",
                  str(tmp_path), "--clear")
    assert "removed 3 files" in out and "0 entries" in out
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("argv, words", [(["--batches", "1,x"], "--batches"), (["--modes", "ar,tree"], "'tree'"),
                                         (["--model", "/nonexistent"], "--model"), (["--budgets", "16,x"], "auto"),
                                         (["--budgets", "0"], "positive")])
def test_warmup_bad_input_is_one_line(argv, words):
    r = subprocess.run([sys.executable, "-c", "from numbaengine.warmup import main; raise SystemExit(main())",
                        *argv], capture_output=True, text=True, check=False, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_warmup_budget_auto_shapes():
    """--budgets takes auto beside integers: ddtree shapes get it (their cost table is measured when they run), the
    modes without a tree budget do not."""
    from numbaengine.warmup import parser, shapes
    args = parser().parse_args(["--budgets", "16,auto", "--modes", "ar,dflash,ddtree", "--batches", "1,8"])
    assert shapes(args) == [("ar", 1, 0), ("ar", 8, 0), ("dflash", 1, 16), ("dflash", 8, 16), ("ddtree", 1, 16),
                            ("ddtree", 1, "auto"), ("ddtree", 8, 16), ("ddtree", 8, "auto")]


def test_warm_rounds_dry_run_then_every_bucket(monkeypatch):
    """A server's warmup (warmup.warm_rounds, cuda): a dry run of every bucket of up to the batch, each on new slots
    and cut after 3 rounds, its rounds dropped; then every bucket once for real, long enough for 3 rounds, on the
    rounds it returns (those the server keeps); in both, every prefill graph size that fits run 3 times. Other backends: the rounds as they are."""
    import numbaengine.generate as gen
    import numbaengine.warmup as warmup
    calls, made = [], []

    class Engine:
        backend, tokenizer, drafter, rounds_cache = "cuda", None, None, {"dry run's": 1}

    class Dev:                                              # DeviceRounds' prefill side
        prefill_rows, cap = (8, 32, 128), 40

        def prefill_part(self, b, ids, start, end):
            calls.append(("prefill", made.index(self.rounds), b, len(ids), start, end, cache.dry_run()))

        def retire(self, slots):
            calls.append(("retire", made.index(self.rounds), slots))

    class Rounds:
        def __init__(self):
            self.dev = Dev()
            self.dev.rounds = self

    def rounds_of():
        made.append(Rounds())
        return made[-1]

    def generate_on(rounds, tokenizer, prompts, max_new, mode, budget, stop=None, on_round=None):
        calls.append((made.index(rounds), len(prompts), max_new, cache.dry_run(), type(on_round).__name__,
                      bool(Engine.rounds_cache)))
        if on_round is not None:
            raise RuntimeError("round limit")               # as RoundLimit does after 3 rounds
    monkeypatch.setattr(gen, "generate_on", generate_on)

    def precompile(run_once, progress):                     # the dry run without the worker pool
        with cache.recording():
            run_once()
    monkeypatch.setattr(warmup, "precompile", precompile)
    rounds = warmup.warm_rounds(Engine(), rounds_of, 4, "ddtree", 16, progress=False)
    assert rounds is made[-1] and len(made) == 4, made
    prefill = [("prefill", r, 0, n + 1, 0, n, dry) for r, dry in ((2, True), (3, False)) for n in (8, 32)
               for _ in range(3)]                           # 128 rows do not fit cap: eager, no graph
    assert calls == [(0, 1, 51, True, "RoundLimit", True), (1, 2, 51, True, "RoundLimit", True),
                     (2, 4, 51, True, "RoundLimit", True), *prefill[:6], ("retire", 2, [0]),
                     (3, 1, 51, False, "NoneType", False), (3, 2, 51, False, "NoneType", False),
                     (3, 4, 51, False, "NoneType", False), *prefill[6:], ("retire", 3, [0])], calls
    Engine.backend = "numpy"
    assert warmup.warm_rounds(Engine(), rounds_of, 4, "ddtree", 16) is made[-1] and len(made) == 5


def test_warm_request_runs_the_request_twice_as_warmup():
    """The CLI's warm-up (warmup.warm_request, cuda): the request itself twice, without stop tokens, cut to three
    rounds of its tree width; its prefill and decode spans count as "warmup" (capture, compile and load keep their
    names), so the real run's prefill and decode are its own. Other backends: nothing."""
    import time as _time

    import numbaengine.warmup as warmup
    from numbaengine import phases
    calls = []

    class Engine:
        backend, drafter = "cuda", None

        def generate(self, prompt, max_new, mode, budget, temperature, seed, stop=None, cost_table=None):
            calls.append((prompt, max_new, mode, budget, temperature, seed, stop, cost_table))
            for name in ("prefill", "capture", "decode"):
                with phases.span(name):
                    _time.sleep(0.01)
    before = phases.totals()
    warmup.warm_request(Engine(), "p", 100, "ddtree", 16, 0.5, 3, "table")
    d = phases.delta(before)
    assert calls == [("p", 51, "ddtree", 16, 0.5, 3, (), "table")] * 2, calls
    assert d["prefill"] == d["decode"] == 0 and d["warmup"] >= 0.04 and d["capture"] >= 0.02, d
    with phases.span("decode"):                             # outside the warm-up: decode again
        pass
    assert phases.delta(before)["decode"] > 0
    warmup.warm_request(Engine(), "p", 100, "ar", 16)       # ar: three rounds are three tokens
    warmup.warm_request(Engine(), "p", 2, "ar", 16)         # fewer tokens than three rounds: the request's own
    assert [c[1:3] for c in calls[2:]] == [(3, "ar")] * 2 + [(2, "ar")] * 2, calls
    Engine.backend = "numpy"
    warmup.warm_request(Engine(), "p", 100, "ddtree", 16)
    assert len(calls) == 6


def test_warmup_without_gpu_says_so(tmp_path):
    if cuda.is_available():
        pytest.skip("a GPU is present, so the no-GPU error cannot be raised here: CI (no GPU) runs it")
    r = subprocess.run([sys.executable, "-m", "numbaengine.warmup", "--kernel-cache", str(tmp_path)],
                       capture_output=True, text=True, check=False, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no CUDA GPU" in r.stderr, r.stderr


# -------------------------------------------------------------------------------------------------------------- GPU
GPU_SCRIPT = """
import functools, json, sys
import numpy as np
from numba import cuda
from numbaengine.kernels import cache
from numbaengine.kernels.launch import kernel, launch

@functools.cache                 # as the kernel families: one dispatcher per set of constants
def make(c):
    @kernel()
    def scale_k(x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] = x[i] * c
    return scale_k

def run():
    x = cuda.to_device(np.ones(64, np.float32))
    for c in (2.0, 3.0):
        launch(make(c), 1, 64, x)
    assert (x.copy_to_host() == 6.0).all()
"""


@pytest.mark.gpu
def test_gpu_second_process_loads_without_compiling(tmp_path):
    script = GPU_SCRIPT + "run()\nprint(json.dumps(cache.stats()))"
    env = {"NUMBAENGINE_CACHE_DIR": str(tmp_path)}
    first = json.loads(_python(script, env=env).splitlines()[-1])
    second = json.loads(_python(script, env=env).splitlines()[-1])
    assert (first["misses"], first["hits"]) == (2, 0) and len(cache.cache_files(tmp_path)) == 2
    assert (second["misses"], second["hits"], second["compile_s"]) == (0, 2, 0.0)


@pytest.mark.gpu
def test_gpu_precompile_fills_the_cache(tmp_path):
    script = GPU_SCRIPT + textwrap.dedent("""
        from numbaengine.warmup import precompile
        if __name__ == "__main__":
            done = precompile(run, workers=2)
            assert (done.found, done.compiled, done.failed) == (2, 2, ()), done
            run()
            print(json.dumps(cache.stats()))
    """)
    out = json.loads(_python(script, env={"NUMBAENGINE_CACHE_DIR": str(tmp_path)}).splitlines()[-1])
    assert (out["misses"], out["hits"]) == (0, 2)


@pytest.mark.gpu
def test_gpu_warmup_keeps_the_auto_cost_table(tmp_path):
    """warmup --budgets auto measures the shipped pair's round costs and keeps them; a later CLI run with budget auto
    (same batch and context) reads that table instead of timing its rounds."""
    env = {"NUMBAENGINE_CACHE_DIR": str(tmp_path)}
    _python("from numbaengine.warmup import main; raise SystemExit(main())", "--batches", "1", "--budgets", "auto",
            env=env)
    tables = list((tmp_path / "cost_tables").glob("*.json"))
    assert len(tables) == 1, tables
    out = _python("from numbaengine.run import main; raise SystemExit(main())", "--prompt", "def f(x):", "--backend",
                  "cuda", "--budget", "auto", "--max-new-tokens", "16", "--json", env=env)
    assert json.loads(out)["stats"]["cost_table_from"] == str(tables[0]), out[-500:]


# ---------------------------------------------------------------------------------------------------------- helpers
def _python(script, *argv, env=None) -> str:
    """stdout of a fresh `python -c script argv...` (the test's environment plus `env`); fails on a non-zero exit."""
    r = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, check=False,
                       cwd=ROOT, env=_env(**(env or {})))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _env(**extra) -> dict:
    """This environment with the checkout first on PYTHONPATH, plus `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


@pytest.fixture
def kernel_dir(tmp_path):
    """This process's kernel cache in a fresh folder (the defaults again afterwards)."""
    cache.configure(tmp_path / "kernels")
    yield tmp_path / "kernels"
    cache.configure()


@pytest.fixture
def as_sm90(monkeypatch):
    """Without a GPU: compile as for an sm_90 device (its compute capability, PTX for sm_90a) and skip loading the
    module into a context; with a GPU nothing changes."""
    if cuda.is_available():
        return
    from numba.cuda import codegen, dispatcher

    class Device:
        compute_capability = (9, 0)
    monkeypatch.setattr(dispatcher, "get_current_device", Device)
    monkeypatch.setattr(codegen.CUDACodeLibrary, "_ensure_cc", lambda self, cc: cc or (9, 0, "a"))
    monkeypatch.setattr(dispatcher._Kernel, "bind", lambda self: None)
