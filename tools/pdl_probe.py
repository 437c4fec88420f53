"""Probe (H200): does programmatic dependent launch (PDL) shorten a graph-captured chain of streaming kernels?

Every small engine kernel pays a launch, ramp-up and tail of ~2 us inside a graph (tools/bench_kernels.py's read
floor: a pure 30 MB read runs at 77% of copy). With PDL a kernel's blocks may start while its predecessor drains;
`griddepcontrol.wait` holds them until the predecessor's memory is visible, so anything before the wait (address
math, an L2 prefetch of this kernel's own weights) overlaps the predecessor's tail. This probe answers, before any
engine kernel is changed: does CuPy's stream capture keep the PDL launch attribute, is the wait honoured (a
producer / consumer chain checked against NumPy), and what does a chain of pure-read kernels (the read floor's
kernel) gain with the wait at the start, with an early trigger, and with an L2 prefetch before the wait; and, as a
bound on what the engine's GEMMs could gain, a chain of unchanged dense GEMMs launched with the attribute alone.

    NUMBAENGINE_PDL=off python -m tools.pdl_probe [--out pdl.json]

(off: the engine's kernels launch with PDL in "wait" mode by default, which would make the probe's "plain" GEMM
chain a PDL chain too.)

PDL reaches numba's launches by a LaunchConfig with programmatic_stream_serialization (cuda.core): numba builds its
LaunchConfig in numba.cuda.dispatcher, which `pdl()` swaps for the calls inside it. GPU only.
"""
import argparse
import json

import numpy as np

from tools.gpu import require_gpu

READ_MB = (8, 30, 59)


def step_kernel():
    """y = (x * mul + add) ^ xor (uint32), after the PDL trigger and wait."""
    from numba import cuda

    from numbaengine.kernels.device import _launch_dependents, _wait_previous

    @cuda.jit
    def step(x, y, mul, add, xor):
        _launch_dependents()
        _wait_previous()
        i = cuda.grid(1)
        if i < x.shape[0]:
            y[i] = (x[i] * mul + add) ^ xor
    return step


def pdl_launch(kern, grid, block, *args):
    """The launch with the PDL attribute (kernels.launch.pdl), whether or not the kernel waits."""
    from numbaengine.kernels.launch import current_stream, pdl
    with pdl():
        kern[grid, block, current_stream(), 0](*args)


def gemm_chain(cp, cuda, copy_bw, res, name="q_kv_a", m=1):
    """The dense GEMM (with NUMBAENGINE_PDL=off: no griddepcontrol in it) chained over distinct weight copies,
    plain and with the PDL attribute on every launch. Without a wait in the kernel PDL does not order its reads
    after the previous kernel's writes: a timing bound only (these GEMMs read only their own x and weights)."""
    from numbaengine.kernels.gemm import GemmWorkspace, gemm
    from numbaengine.kernels.launch import pdl
    from tools.bench_kernels import K2_GEMMS, chain_copies, chained_ms, rand_bf16
    n, k = K2_GEMMS[name]
    dv = cuda.as_cuda_array
    ws = GemmWorkspace(dv(cp.zeros(8 * 2 * k, cp.uint32)), dv(cp.zeros(64 * 8 * n, cp.float32)),
                       dv(cp.zeros(1 << 14, cp.uint32)))
    w0 = rand_bf16(cp, (n, k), 0.02)
    w = [dv(w0)] + [dv(w0.copy()) for _ in range(1, chain_copies(2 * n * k))]
    x, out = dv(cp.random.standard_normal((m, k), dtype=cp.float32)), dv(cp.zeros((m, n), cp.float32))
    for tag in ("plain", "pdl_attribute_only"):
        def call(i):
            if tag == "plain":
                gemm(x, w[i], out, ws)
            else:
                with pdl():
                    gemm(x, w[i], out, ws)
        ms = chained_ms(cp, call, len(w), 2 * n * k)
        row = dict(op=name, m=m, tag=tag, us=ms * 1e3, pct_copy=100 * 2 * n * k / ms / 1e6 / copy_bw)
        res.setdefault("gemm", []).append(row)
        print(f"gemm {name} m={m} {tag:>20}: {row['us']:7.2f} us {row['pct_copy']:5.1f}%", flush=True)


def check_chain(cp, cuda, n=16 << 20, rounds=12):
    """A graph of `rounds` produce / consume pairs launched with PDL (x -> y -> z -> y -> ...) == NumPy."""
    step = step_kernel()
    u = np.uint32
    dv = cuda.as_cuda_array
    x0 = cp.random.randint(0, 2 ** 31, n, dtype=cp.uint32)
    a, b = dv(x0.copy()), dv(cp.zeros(n, cp.uint32))
    blocks = -(-n // 256)

    def chain():
        for _ in range(rounds):
            pdl_launch(step, blocks, 256, a, b, u(3), u(1), u(0))                # produce: y = 3x + 1
            pdl_launch(step, blocks, 256, b, a, u(1), u(0), u(0x5BD1E995))       # consume: z = y ^ 0x5BD1E995
    from tools.bench_kernels import capture
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        capture(s, chain).launch(s)
        s.synchronize()
    want = x0.get()
    for _ in range(rounds):
        want = (want * np.uint32(3) + np.uint32(1)) ^ np.uint32(0x5BD1E995)
    got = cp.asarray(a).get()
    return int((got != want).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="pdl_probe.json")
    args = ap.parse_args()
    require_gpu("python -m tools.pdl_probe")
    import cuda.core as cuda_core
    import cupy as cp
    import numba.cuda.dispatcher as D
    from numba import cuda

    from numbaengine.kernels.launch import launch
    from tools.bench_kernels import (
        chain_copies,
        chained_ms,
        copy_bandwidth,
        read_kernel,
    )
    res = {"cuda_core": getattr(cuda_core, "__version__", "?")}
    D.LaunchConfig(grid=1, block=32, programmatic_stream_serialization=True)     # raises if cuda.core lacks PDL
    res["wrong_words_in_pdl_chain"] = check_chain(cp, cuda)
    print("producer / consumer chain under PDL, wrong words:", res["wrong_words_in_pdl_chain"], flush=True)
    copy_bw = res["copy_gbps"] = copy_bandwidth(cp)[0]
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    dv = cuda.as_cuda_array
    out = dv(cp.zeros(1, cp.uint32))
    variants = {"plain": (0, 0, 0, False), "pdl_wait": (1, 0, 0, True), "pdl_trigger_wait": (1, 1, 0, True),
                "pdl_trigger_prefetch_wait": (1, 1, 1, True), "pdl_trigger_no_wait": (0, 1, 0, True)}
    kerns = {tag: read_kernel(trigger=bool(v[1]), wait=bool(v[0]), prefetch=bool(v[2])) for tag, v in variants.items()}
    res["read"] = []
    for mb in READ_MB:
        nwords = (mb << 20) // 4
        ws = [dv(cp.zeros(nwords, cp.uint32)) for _ in range(chain_copies(4 * nwords))]
        for tag, (_, _, _, pdl) in variants.items():
            go = pdl_launch if pdl else launch
            ms = chained_ms(cp, lambda i: go(kerns[tag], 4 * sms, 512, ws[i], out, np.int32(nwords)), len(ws),
                            4 * nwords)
            row = dict(mb=mb, tag=tag, us=ms * 1e3, gbps=4 * nwords / ms / 1e6)
            row["pct_copy"] = 100 * row["gbps"] / copy_bw
            res["read"].append(row)
            print(f"read {mb:3d} MB {tag:>26}: {row['us']:7.2f} us {row['gbps']:6.0f} GB/s {row['pct_copy']:5.1f}%",
                  flush=True)
        ws.clear()
    for name in ("q_kv_a", "o"):
        gemm_chain(cp, cuda, copy_bw, res, name)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
