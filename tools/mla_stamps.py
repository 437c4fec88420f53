"""Where a 64-head MLA split block's time goes (issue 6): kernels/mla_wg.py compiled with MlaWgConfig.stamps has thread 0
of every block write (SM cycles, global ns) at seven points of its timeline; one eager call per case, then the
phases' medians over the blocks in microseconds, the blocks' start spread and the kernel's span. Cycles are turned
into time by each block's own clock (its cycles over its global-ns span), so the 1 us ticks of %globaltimer on some
GPUs only blur the span, not the phases.
    python -m tools.mla_stamps [--cases 16384:16,65536:4,16384:1] [--out stamps.json]
(cases ctx:batch, one query, 64 heads; the merge launch runs after as usual and is not stamped.)
"""
import argparse
import json

import numpy as np

from tools.gpu import require_gpu

POINTS = ("entry", "ring issued", "q staged", "tile 0 landed", "main loop done", "stats", "O stored")
PHASES = ("ring init", "q prologue", "first tile wait", "main loop", "stats", "O store")


def phases(stamps, names=PHASES):
    """stamps int32 [blocks, >= 2 P + 2] for P = len(names) + 1 points (kernels/mla_wg.py STAMP_WORDS layout: point
    k's cycles at 2k, its global ns at 2k + 1, then the SM and the steps; kernels/gemm_wg.py's the same with more
    points; the phase named "main loop", else phase 3, is the main loop) -> summary dict: per phase the median / min
    / max in us over blocks
    that stamped every point, the main loop per step, the clock in GHz, the start spread and the span in us.
    32-bit wrap-around is undone (differences mod 2^32)."""
    P = len(names) + 1
    loop = names.index("main loop") if "main loop" in names else 3
    s = np.asarray(stamps, np.int64) & 0xFFFFFFFF
    cyc, ns = s[:, 0:2 * P:2], s[:, 1:2 * P:2]
    ok = (s[:, :2 * P] != 0).all(axis=1)
    if not ok.any():
        raise ValueError("mla_stamps: no block stamped all its points (an empty split everywhere, or stamps off)")
    cyc, ns, steps = cyc[ok], ns[ok], s[ok, 2 * P + 1]
    dcyc = (cyc[:, 1:] - cyc[:, :1]) % (1 << 32)              # cycles since entry, per point
    dns = (ns - ns[:, :1]) % (1 << 32)
    span_ns = np.maximum(dns[:, -1], 1)
    ghz = dcyc[:, -1] / span_ns                               # each block's own clock
    cum_us = dcyc / ghz[:, None] / 1e3                        # [blocks, P - 1] us since entry
    per = np.diff(np.concatenate([np.zeros((len(cum_us), 1)), cum_us], axis=1), axis=1)
    t0 = ns[:, 0]
    since = (t0[None, :] - t0[:, None]) % (1 << 32)          # [ref, block]: ns from block ref's entry to each's
    ref = int(np.argmin(since.max(axis=1)))                   # the first block in: the smallest spread after it
    rel = since[ref]
    out = {name: dict(med=round(float(np.median(per[:, k])), 3), min=round(float(per[:, k].min()), 3),
                      max=round(float(per[:, k].max()), 3)) for k, name in enumerate(names)}
    out["main loop per step"] = round(float(np.median(per[:, loop] / np.maximum(steps, 1))), 4)
    out["block"] = round(float(np.median(cum_us[:, -1])), 3)
    out["ghz"] = round(float(np.median(ghz)), 3)
    out["start spread us"] = round(float(rel.max()) / 1e3, 3)
    out["span us"] = round(float(((ns[:, -1] - t0[ref]) % (1 << 32)).max()) / 1e3, 3)
    out["blocks"], out["steps"] = int(ok.sum()), int(np.median(steps))
    out["sms"] = int(len(np.unique(s[ok, 2 * P])))
    return out


def emit(rows, out=None):
    """Print each row of the iterable as it comes ("stamps" + JSON), then write them all to `out` (JSON) if given."""
    done = []
    for row in rows:
        done.append(row)
        print("stamps", json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(done, f, indent=1)
    return done


def run_case(ctx, B, variant=None):
    import cupy as cp

    import numbaengine.kernels.mla_wg as kw
    from numbaengine.kernels.mla import mla_attention, mla_work
    from tools.bench_attention import K2_D, K2_R, Keep, gpu_us, mla_settings
    h, T = 64, 1
    variant = dict(variant or {})
    with mla_settings(dict(variant, wg=dict(variant.get("wg", {}), stamps=True))) as cfg:
        keep = Keep()
        q = keep.normal((B, T, h, K2_D))
        cache = keep.bf16((B, ctx + T, K2_D))
        lengths = keep.arr(cp.full(B, ctx, np.int32))
        ntok = keep.arr(cp.full(B, T, np.int32))
        mask = keep.arr(cp.full((B, T, 1), 0xFFFFFFFF, np.uint32))
        out = keep.zeros((B, T, h, K2_R), np.float32)
        work = mla_work(keep.zeros, B, T, h, K2_R, ctx + T, cfg=cfg)
        nsplit = work.o.shape[1]
        stamps_cp = cp.zeros((B * nsplit * (T * h // 64), kw.STAMP_WORDS), np.int32)
        work.count = keep.arr(stamps_cp)
        call = lambda: mla_attention(q, cache, lengths, ntok, mask, 0.04, out, work, cfg=cfg)  # noqa: E731
        us, how = gpu_us(call)
        if work.cluster:
            raise ValueError(f"mla_stamps: {ctx} x {B} ran a cluster merge, which the stamps leave out; "
                             f"pass --variant '{{\"wg\": {{\"cluster\": 0}}}}'")
        stamps_cp[:] = 0
        call()
        cp.cuda.runtime.deviceSynchronize()
        row = dict(ctx=ctx, batch=B, splits=nsplit, call_us=round(us, 2), timing=how, **phases(stamps_cp.get()))
        del keep
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="16384:16,65536:4,16384:1,65536:1", help="ctx:batch,...")
    ap.add_argument("--variant", default="{}", help='MlaConfig settings (JSON), e.g. {"wg": {"cluster": 0}}')
    ap.add_argument("--out", help="write the rows as JSON")
    a = ap.parse_args(argv)
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in a.cases.split(",")]
        if any(len(c) != 2 for c in cases):
            raise ValueError
    except ValueError:
        ap.error(f"--cases {a.cases!r}: want ctx:batch pairs separated by commas")
    require_gpu("python -m tools.mla_stamps")
    return emit((run_case(ctx, B, json.loads(a.variant)) for ctx, B in cases), a.out)


if __name__ == "__main__":
    main()
