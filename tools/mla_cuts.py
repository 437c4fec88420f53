"""Where the 64-head MLA step's time goes: kernels/mla_wg.py timed with parts of its step cut out (the results are
wrong; only the time means something). Each variant runs in a child process that compiles the kernel from
mla_wg.py's source with the cut lines removed (the file is not touched), then times mla_attention (kernel + merge)
as CUDA-graph replays.
    python -m tools.mla_cuts base softmax pv s load sync s+pv load+softmax s+pv+sync+q [--case 64:1:4096:64]
    python -m tools.mla_cuts base q store merge q+store+merge     # the per-block fixed work (prologue, epilogue)
    python -m tools.mla_cuts --check       # CPU: every cut still compiles to sm_90a PTX (needs the NVVM wheels)
A cut that also makes O dead code (store) lets the compiler drop more than the cut: read it with care."""
import argparse
import json
import subprocess
import sys

I12 = " " * 12
CUTS = {    # name: lines of mla_wg.py's kernel source removed, or (old, new) replacements
    "softmax": [f'{{softmax("{I12}")}}\n'],                           # warpgroup 0's softmax inside the loop
    "pv": [f'{{pv_calls("{I12}")}}\n'],                               # O += P V in both warpgroups' loops
    "s": [f'{{s_calls("{I12}")}}\n'],                                 # S(i + 1) = Q K^T inside the loop
    "load": [   # the ring's refills in the loop: the TMA boxes (the refill copies nothing but still completes its
        #         slot's mbarrier phase, so the waits do not hang)
        ("load_tile_tma(wsm, bars, tmap, row0, lo + (i + 3) * {NK}, hi, (i + 3) % {stages})",
         "load_tile_tma(wsm, bars, tmap, row0, hi, hi, (i + 3) % {stages})")],
    "sync": [f"{I12}fence_proxy_async()                   # P(i) -> the wgmma proxy\n{I12}cuda.syncthreads()\n",
             f"{I12}fence_proxy_async()\n{I12}cuda.syncthreads()\n"],     # the per-step barrier (both loops)
    "q": [("ld16(q, qo)", "(uint32(0), uint32(0), uint32(0), uint32(0))"),      # the q prologue's global loads
          ("ld16(q, qo + 4)", "(uint32(0), uint32(0), uint32(0), uint32(0))")],
    "store": ["{store_out}\n"],                                          # the o_part stores (O becomes dead code)
}
LAUNCH_CUTS = {"merge"}     # cut in the child at run time, not in the source: the merge launch after the splits

CHILD = """
import sys
import cupy as cp, numpy as np
import numbaengine.kernels.mla_wg as W
from tools.mla_cuts import cut_source
from tools.bench_attention import Keep, K2_D, K2_R, gpu_us
ns = {"__name__": "numbaengine.kernels.mla_wg_cut"}
exec(compile(cut_source(sys.argv[1]), W.__file__, "exec"), ns)
W._make_kernel = ns["_make_kernel"]
import numbaengine.kernels.mla as KM
if "merge" in sys.argv[1].split("+"):
    KM.merge_splits = lambda *args: None
from numbaengine.kernels.mla import mla_attention, mla_work
h, T, ctx, B = (int(v) for v in sys.argv[2].split(":"))
keep = Keep()
q, cache = keep.normal((B, T, h, K2_D)), keep.bf16((B, ctx + T, K2_D))
lengths, ntok = keep.arr(cp.full(B, ctx, np.int32)), keep.arr(cp.full(B, T, np.int32))
mask = keep.arr(cp.full((B, T, -(-T // 32)), 0xFFFFFFFF, np.uint32))
out = keep.zeros((B, T, h, K2_R), np.float32)
work = mla_work(keep.zeros, B, T, h, K2_R, ctx + T)
us, _ = gpu_us(lambda: mla_attention(q, cache, lengths, ntok, mask, 0.04, out, work), reps=20)
print("US", us)
"""


def cut_source(variant):
    """kernels/mla_wg.py's source with the cuts of `variant` ("base" or names joined by +) applied."""
    import numbaengine.kernels.mla_wg as W
    with open(W.__file__) as f:
        src = f.read()
    for name in filter(None, variant.replace("base", "").split("+")):
        if name in LAUNCH_CUTS:
            continue
        if name not in CUTS:
            raise SystemExit(f"mla_cuts: unknown cut {name!r} (known: {', '.join([*CUTS, *LAUNCH_CUTS])})")
        for pat in CUTS[name]:
            old, new = pat if isinstance(pat, tuple) else (pat, "")
            if old not in src:
                raise SystemExit(f"mla_cuts: cut {name!r} no longer matches kernels/mla_wg.py: {old.strip()!r}")
            src = src.replace(old, new)
    return src


def check():
    """Every single cut compiles to sm_90a PTX at K2's widths (CPU)."""
    from numba import cuda

    from numbaengine.kernels.mla_wg import MLA_WG_PTX_SIG
    from tools.ptx_stats import _sm90
    _sm90()                                             # no GPU here: device functions compile for sm_90
    for name in ["base", *CUTS]:
        cuda.compile_ptx(cut_kernel(name).py_func, MLA_WG_PTX_SIG, cc=(9, 0, "a"))
        print(f"{name}: compiles", flush=True)


def cut_kernel(variant, D=576, r=512):
    """The kernel (not compiled yet) of kernels/mla_wg.py's source with `variant`'s cuts; building it runs the
    generated source, so a cut that breaks it fails here."""
    import numbaengine.kernels.mla_wg as W
    ns = {"__name__": "numbaengine.kernels.mla_wg_cut"}
    exec(compile(cut_source(variant), "mla_wg_cut", "exec"), ns)
    return ns["_make_kernel"](D, r, False, W.MLA_WG_NK, W.wg_stages(D))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", default=["base"])
    ap.add_argument("--case", default="64:1:4096:64", help="heads:queries:context:batch")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        return check()
    results = {}
    for v in args.variants:
        cut_source(v)                                   # unknown or stale cuts fail here, before any GPU work
        r = subprocess.run([sys.executable, "-c", CHILD, v, args.case], capture_output=True, text=True, timeout=300)
        us = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("US ")]
        if not us:
            raise SystemExit(f"mla_cuts: variant {v} failed:\n{r.stderr[-2000:]}")
        results[v] = round(us[0], 1)
        print(f"{v:24s} {results[v]:8.1f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(case=args.case, us=results), f, indent=1)


if __name__ == "__main__":
    main()
