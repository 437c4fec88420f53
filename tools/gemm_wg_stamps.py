"""Where a wgmma dense GEMM call's time goes (issue 5): kernels/gemm_wg.py compiled with WgConfig.stamps has thread 0
of every block write (SM cycles, global ns) at each of kernels.gemm_wg.STAMP_POINTS; one eager call per case after
an L2 flush, then each phase's median / min / max over the blocks in microseconds, the main loop per stage, the
blocks' start spread and the kernel's span (tools/mla_stamps.py `phases`), blocks alone on an SM vs sharing one;
beside them the call's graph time, the call chained over distinct weight copies (tools/bench_kernels.py's chain),
its x prep launch alone chained, and a pure read of the weights' bytes chained. Rows keep the raw stamps ("raw").
    python -m tools.gemm_wg_stamps [--cases q_kv_a:1,q_kv_a:17,o:1,o:33] [--set stages_max=8] [--out stamps.json]
(names: tools/bench_kernels.py K2_GEMMS; the call's bytes are the weights, n k 2.)
"""
import argparse
import dataclasses

from tools.gpu import require_gpu
from tools.mla_stamps import emit, phases

PHASES = ("barrier init", "stage 0 issue", "rest of ring issue", "x prologue", "first stage wait", "main loop",
          "partial tile + barrier", "reduce + store")


def sm_sharing(stamps, npoints):
    """Blocks that had an SM to themselves vs those that shared one (two resident blocks per SM fit): how many, the
    median main loop of each in us (each block's own clock) and when the last of each ended, in us after the first
    entry."""
    import numpy as np
    s = np.asarray(stamps, np.int64) & 0xFFFFFFFF
    ok = (s[:, :2 * npoints] != 0).all(axis=1)
    s = s[ok]
    sm = s[:, 2 * npoints]
    per_sm = {int(v): int(c) for v, c in zip(*np.unique(sm, return_counts=True))}
    shared = np.array([per_sm[int(v)] > 1 for v in sm])
    cyc, ns0 = s[:, 0:2 * npoints:2], s[:, 1]                     # [blocks, points] SM cycles; entry's ns
    ghz = ((cyc[:, -1] - cyc[:, 0]) % (1 << 32)) / np.maximum((s[:, 2 * npoints - 1] - ns0) % (1 << 32), 1)
    loop = PHASES.index("main loop")
    loop_us = ((cyc[:, loop + 1] - cyc[:, loop]) % (1 << 32)) / ghz / 1e3
    end_us = ((s[:, 2 * npoints - 1] - ns0.min()) % (1 << 32)) / 1e3
    out = {}
    for name, sel in (("alone", ~shared), ("shared", shared)):
        out[f"blocks {name}"] = int(sel.sum())
        if sel.any():
            out[f"main loop {name} us"] = round(float(np.median(loop_us[sel])), 3)
            out[f"last end {name} us"] = round(float(end_us[sel].max()), 3)
    return out


def run_case(name, m, wg=None):
    import cupy as cp
    import numpy as np
    from numba import cuda

    import numbaengine.kernels.gemm_wg as kw
    from numbaengine.kernels.launch import launch
    from numbaengine.kernels.prep import prep_b, xb_words
    from tools.bench_attention import gpu_us
    from tools.bench_kernels import (
        K2_GEMMS,
        chain_copies,
        chained_ms,
        rand_bf16,
        read_kernel,
    )
    n, k = K2_GEMMS[name]
    dv = cuda.as_cuda_array
    w = rand_bf16(cp, (n, k), 0.02)
    x = cp.random.standard_normal((m, k), dtype=cp.float32)
    out = cp.zeros((m, n), cp.float32)
    xb = cp.zeros(xb_words(m, k), cp.uint32)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    wg = wg or kw.WG_GEMM_DEFAULT
    cut = kw.wg_cut(m, n, k, sms, cfg=wg)
    blocks = cut.CL * -(-n // (64 * cut.MT)) * cut.ZB
    stamps = cp.zeros((blocks, kw.STAMP_WORDS), cp.int32)
    args = (dv(x), dv(w), dv(out), dv(xb), cut)
    us, how = gpu_us(lambda: kw.gemm_wg(*args, cfg=wg))         # unstamped kernel: the call's time
    # the same call chained over distinct weight copies (tools/bench_kernels.py's chain), x's prep launch alone in
    # the same chain, and a pure read of the weights' bytes: what the call costs beside its kernel's span
    nbytes = 2 * n * k
    ws = [dv(w)] + [dv(w.copy()) for _ in range(1, chain_copies(nbytes))]
    chain_us = 1e3 * chained_ms(cp, lambda i: kw.gemm_wg(args[0], ws[i], *args[2:], cfg=wg), len(ws), nbytes)
    prep_us = 0.0 if cut.XIN else 1e3 * chained_ms(cp, lambda i: prep_b(args[0], args[3], 1, 0, tiled=3), 1, 1 << 20)
    read_k, sink = read_kernel(), dv(cp.zeros(1, cp.uint32))
    flat = [dv(cp.asarray(u).reshape(n * k).view(cp.uint32)) for u in ws]     # (made before the capture)
    read_us = 1e3 * chained_ms(cp, lambda i: launch(read_k, 4 * sms, 512, flat[i], sink, np.int32(n * k // 2)),
                               len(flat), nbytes)
    stamped = dataclasses.replace(wg, stamps=True)
    flush = cp.ones(1 << 28, cp.uint8)                           # 256 MB read: the weights leave L2
    kw.gemm_wg(*args, stamps=dv(stamps), cfg=stamped)            # compile
    stamps[:] = 0
    int(flush.sum())
    kw.gemm_wg(*args, stamps=dv(stamps), cfg=stamped)
    cp.cuda.runtime.deviceSynchronize()
    raw = stamps.get()
    row = dict(name=name, m=m, n=n, k=k, cut=cut.__dict__, mb=round(nbytes / 1e6, 1), call_us=round(us, 2),
               timing=how, chain_us=round(chain_us, 2), prep_chain_us=round(prep_us, 2),
               read_chain_us=round(read_us, 2),
               **phases(raw, PHASES), **sm_sharing(raw, len(PHASES) + 1))
    row["stage MB/s per block"] = round(nbytes / blocks / max(row["steps"], 1) / row["main loop per step"], 1)
    row["raw"] = raw.tolist()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="q_kv_a:1,q_kv_a:17,o:1,o:33,shared_gate_up:1,q_b:17")
    ap.add_argument("--out", help="write the rows as JSON")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a kernels.gemm_wg.WgConfig field for every case (repeatable), e.g. stages_max=8")
    a = ap.parse_args(argv)
    from numbaengine.kernels.gemm_wg import WG_GEMM_DEFAULT
    fields = {f.name: f.type for f in dataclasses.fields(WG_GEMM_DEFAULT) if f.name not in ("on", "stamps")}
    wg = {}
    for item in a.set:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            ap.error(f"--set {item!r}: want <field>=value, a field of kernels.gemm_wg.WgConfig: {', '.join(fields)}")
        kind = type(getattr(WG_GEMM_DEFAULT, name))
        wg[name] = value.lower() in ("1", "true", "on") if kind is bool else kind(value)
    wg = dataclasses.replace(WG_GEMM_DEFAULT, **wg)
    try:
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in a.cases.split(",")]
    except (IndexError, ValueError):
        ap.error(f"--cases {a.cases!r}: want name:m pairs separated by commas")
    require_gpu("python -m tools.gemm_wg_stamps")
    return emit((run_case(name, m, wg) for name, m in cases), a.out)


if __name__ == "__main__":
    main()
