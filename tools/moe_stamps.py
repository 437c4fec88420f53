"""Where an INT4 MoE expert stage's time goes (issue 5): kernels/moe.py compiled with ExpertConfig.stamps has thread 0 of every
block write (SM cycles, global ns) at its entry and, per unit (item x row block), at the unit's start, after its main
loop and after its epilogue (k-split reduce, stores). One eager call of the stage per case, L2 flushed by a read
before it; then the blocks' start spread, each block's end (the max: the kernel's span from the first entry), and
per phase the median / min / max over units in microseconds (cycles at the GPU's median clock), with the bytes a unit
streams and its main loop's rate.
    python -m tools.moe_stamps [--cases 1,4,17] [--stages gate_up,down] [--variant '{"dn": {"U": 4}}'] [--out f.json]
(--variant: a tools/bench_kernels.py MOE_VARIANTS entry, e.g. {"tiled": 0} for gate_up on the register path.)
"""
import argparse
import dataclasses
import json

import numpy as np

from tools.gpu import require_gpu

PHASES = ("setup", "main loop", "epilogue", "between units")


def _wrap(d):
    return d % (1 << 32)


def timeline(stamps, unit_bytes, units_kept):
    """stamps int32 [grid, >= 4 + 6 * units_kept] (kernels/moe.py `_stamp` layout) -> summary dict. Blocks that ran no
    unit are left out; a block's units past units_kept are counted, not timed (then "block end us" is the end of its
    last kept unit, flagged all_units False, and not the span). 32-bit wrap-around is undone."""
    s = np.asarray(stamps, np.int64) & 0xFFFFFFFF
    ran = s[:, 3]
    s, ran = s[ran > 0], ran[ran > 0]
    if not len(s):
        raise ValueError("moe_stamps: no block ran a unit (no live item, or stamps off)")
    kept = np.minimum(ran, units_kept)
    pts = [(int(b), p) for b in range(len(s)) for p in range(1 + 3 * int(kept[b]))]   # (block, point) stamped
    cyc = np.zeros((len(s), 1 + 3 * units_kept), np.int64)
    ns = np.zeros_like(cyc)
    for b, p in pts:
        w = 0 if p == 0 else 4 + 2 * (p - 1)
        cyc[b, p], ns[b, p] = s[b, w], s[b, w + 1]
    last = 3 * kept                                              # each block's last stamped point
    rows = np.arange(len(s))
    dcyc, dns = _wrap(cyc[rows, last] - cyc[:, 0]), _wrap(ns[rows, last] - ns[:, 0])
    ghz = float(np.median(dcyc[dns > 0] / dns[dns > 0])) if (dns > 0).any() else 1.0
    per = {name: [] for name in PHASES}
    for b in range(len(s)):
        c = cyc[b, :1 + last[b]]
        us = _wrap(np.diff(c)) / ghz / 1e3                      # [3 * kept]: start, loop, epilogue of each unit
        per["setup"].append(us[0])
        per["main loop"] += list(us[1::3])
        per["epilogue"] += list(us[2::3])
        per["between units"] += list(us[3::3])
    t0 = ns[:, 0]
    since = _wrap(t0[None, :] - t0[:, None])                    # [ref, block]: ns from ref's entry to each entry
    ref = int(np.argmin(since.max(axis=1)))                     # the first block in
    ends = _wrap(ns[rows, last] - t0[ref]) / 1e3                # us from the first entry to each block's last point
    out = {name: dict(med=round(float(np.median(v)), 3), min=round(float(np.min(v)), 3),
                      max=round(float(np.max(v)), 3)) for name, v in per.items() if v}
    loop = np.median(per["main loop"])
    out["unit kB"] = round(unit_bytes / 1e3, 1)
    out["unit loop GB/s"] = round(unit_bytes / loop / 1e3, 1)
    out["ghz"] = round(ghz, 3)
    out["start spread us"] = dict(med=round(float(np.median(since[ref])) / 1e3, 3),
                                  max=round(float(since[ref].max()) / 1e3, 3))
    out["block end us"] = dict(med=round(float(np.median(ends)), 3), max=round(float(ends.max()), 3),
                               all_units=bool((ran <= units_kept).all()))   # False: ends of the kept units only
    out["blocks"], out["units"] = int(len(s)), int(ran.sum())
    sms, per_sm = np.unique(s[:, 2], return_counts=True)
    out["sms"], out["blocks per sm"] = int(len(sms)), dict(min=int(per_sm.min()), max=int(per_sm.max()))
    return out


def run_case(n, stages, variant=None, seed=0):
    """One K2 MoE layer (384 random INT4 experts, random routing of n tokens): each stage in `stages` stamped once."""
    import cupy as cp
    from numba import cuda

    import numbaengine.kernels.moe as M
    from tools.bench_kernels import (
        GROUP,
        TOPK,
        E,
        H,
        I,
        k2_experts,
        moe_cuts,
        rand_bf16,
        rand_words,
        routing,
    )
    over = variant or {}
    gu_cfg, dn_cfg = moe_cuts(over)
    dv = cuda.as_cuda_array
    ex = k2_experts(cp, dv, rand_words(cp, (E, 2 * I, H // 8)), rand_bf16(cp, (E, 2 * I, H // GROUP), 0.002, 0.01),
                    rand_words(cp, (E, H, I // 8)), rand_bf16(cp, (E, H, I // GROUP), 0.002, 0.01),
                    over.get("tiled", M.MOE_DEFAULT.tiled))
    ws = M.moe_workspace(n, TOPK, H, I, E, lambda shape, dtype: dv(cp.zeros(shape, dtype)))
    stamps = cp.zeros((M._sm_count() * max(gu_cfg.blocks_per_sm, dn_cfg.blocks_per_sm), M.STAMP_WORDS), np.int32)
    ws.stamps = dv(stamps)
    idx, wts = routing(np.random.default_rng(seed), n)
    x, di, dw = dv(cp.random.standard_normal((n, H), dtype=cp.float32)), dv(cp.asarray(idx)), dv(cp.asarray(wts))
    flush = cp.zeros(256 << 20, cp.uint8)                         # more than the 50 MB L2, read (not written)
    distinct = len(np.unique(idx))
    rows = []
    for stage in stages:
        down = stage == "down"
        cfg = dataclasses.replace(dn_cfg if down else gu_cfg, stamps=True)
        nrows, kdim = (H, I) if down else (2 * I, H)
        unit_bytes = cfg.WR * cfg.R * 16 * (kdim // 2 + kdim // GROUP * 2)
        for _ in range(2):                                    # the first compiles
            M.moe_plan(x, di, ex, ws, gu_cfg, dn_cfg)
            if down:
                M.moe_stage(0, ex, dw, ws, gu_cfg)
            stamps[:] = 0
            flush.sum()                                       # L2 now holds clean lines of flush only (a
            cp.cuda.Device().synchronize()                    # written flush's write-backs slowed the stage)
            M.moe_stage(int(down), ex, dw, ws, cfg)
            cp.cuda.Device().synchronize()
        stage_bytes = distinct * nrows * (kdim // 2 + kdim // GROUP * 2)
        rows.append(dict(n=n, stage=stage, experts=distinct, cfg=cfg.__dict__, stage_MB=round(stage_bytes / 1e6, 1),
                         **timeline(stamps.get(), unit_bytes, M.STAMP_UNITS)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1,4,17", help="token counts n, comma-separated")
    ap.add_argument("--stages", default="gate_up,down")
    ap.add_argument("--variant", default="{}", help="a tools/bench_kernels.py MOE_VARIANTS entry (JSON)")
    ap.add_argument("--out", help="write the rows as JSON")
    a = ap.parse_args(argv)
    try:
        cases = [int(c) for c in a.cases.split(",")]
    except ValueError:
        ap.error(f"--cases {a.cases!r}: want token counts separated by commas")
    stages = a.stages.split(",")
    if not stages or any(st not in ("gate_up", "down") for st in stages):
        ap.error(f"--stages {a.stages!r}: gate_up and/or down")
    require_gpu("python -m tools.moe_stamps")
    from tools.mla_stamps import emit
    return emit((row for n in cases for row in run_case(n, stages, json.loads(a.variant))), a.out)


if __name__ == "__main__":
    main()
