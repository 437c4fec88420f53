"""Where a wgmma dense GEMM block's time goes (issue 5): kernels/gemm_wg.py compiled with GEMM_WG_STAMPS has thread 0
of every block write (SM cycles, global ns) at seven points (kernels.gemm_wg.STAMP_POINTS); one eager call per case
after an L2 flush, then each phase's median / min / max over the blocks in microseconds, the main loop per stage,
the blocks' start spread and the kernel's span (tools/mla_stamps.py `phases`), beside the call's graph time.
    python -m tools.gemm_wg_stamps [--cases q_kv_a:1,q_kv_a:17,o:1,o:33] [--set WG_TMAP=none] [--out stamps.json]
(names: tools/bench_kernels.py K2_GEMMS; the call's bytes are the weights, n k 2.)
"""
import argparse

from tools.mla_stamps import emit, phases

PHASES = ("ring issue", "x prologue", "first stage wait", "main loop", "partial tile + barrier", "reduce + store")


def run_case(name, m):
    import cupy as cp
    from numba import cuda

    import kernels.gemm_wg as kw
    from tools.bench_attention import gpu_us
    from tools.bench_kernels import K2_GEMMS, rand_bf16
    n, k = K2_GEMMS[name]
    dv = cuda.as_cuda_array
    w = rand_bf16(cp, (n, k), 0.02)
    x = cp.random.standard_normal((m, k), dtype=cp.float32)
    out = cp.zeros((m, n), cp.float32)
    xb = cp.zeros(kw.xb_words(m, k), cp.uint32)
    cut = kw.wg_cut(m, n, k, cuda.get_current_device().MULTIPROCESSOR_COUNT)
    blocks = cut.CL * -(-n // (64 * cut.MT)) * cut.ZB
    stamps = cp.zeros((blocks, 16), cp.int32)
    args = (dv(x), dv(w), dv(out), dv(xb), cut)
    us, how = gpu_us(lambda: kw.gemm_wg(*args))                 # unstamped kernel: the call's time
    kw.GEMM_WG_STAMPS = True
    try:
        flush = cp.ones(1 << 28, cp.uint8)                       # 256 MB read: the weights leave L2
        kw.gemm_wg(*args, stamps=dv(stamps))                     # compile
        stamps[:] = 0
        int(flush.sum())
        kw.gemm_wg(*args, stamps=dv(stamps))
        cp.cuda.runtime.deviceSynchronize()
    finally:
        kw.GEMM_WG_STAMPS = False
    row = dict(name=name, m=m, n=n, k=k, cut=cut.__dict__, mb=round(2 * n * k / 1e6, 1), call_us=round(us, 2),
               timing=how, **phases(stamps.get(), PHASES))
    row["stage MB/s per block"] = round(2 * n * k / blocks / max(row["steps"], 1) / row["main loop per step"], 1)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="q_kv_a:1,q_kv_a:17,o:1,o:33,shared_gate_up:1,q_b:17")
    ap.add_argument("--out", help="write the rows as JSON")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a kernels.gemm_wg knob for every case (repeatable), e.g. WG_TMAP=none")
    a = ap.parse_args(argv)
    import kernels.gemm_wg as kw
    for item in a.set:
        name, _, value = item.partition("=")
        if not hasattr(kw, name) or not name.startswith("WG_") or not value:
            ap.error(f"--set {item!r}: want WG_<knob>=value of kernels.gemm_wg")
        setattr(kw, name, type(getattr(kw, name))(value) if not isinstance(getattr(kw, name), bool)
                else value.lower() in ("1", "true", "on"))
    try:
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in a.cases.split(",")]
    except (IndexError, ValueError):
        ap.error(f"--cases {a.cases!r}: want name:m pairs separated by commas")
    return emit((run_case(name, m) for name, m in cases), a.out)


if __name__ == "__main__":
    main()
