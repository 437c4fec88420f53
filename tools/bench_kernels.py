"""Kernel benchmark on a GPU at Kimi K2.6 shapes: INT4 MoE, router, dense mma GEMMs, lm_head; GB/s against the
device copy bandwidth measured in the same run. Prints a table, writes JSON.

    python -m tools.bench_kernels --out bench_kernels.json [--quick]

Times are CUDA-event means over many replays after warm-up, three ways: `graph` replays a CUDA graph of one call
(each replay pays the host's graph launch, ~8 us: a floor for the small GEMMs), `chain` replays a graph of CHAIN_MIN or
more calls back to back on distinct weight copies (more bytes than L2 holds, as a captured round runs its layers: the
time per call, the headline % for the MoE and the GEMMs), `eager` calls the Python launcher in a loop (numba's launch
path included). Bytes are what must cross HBM: for the MoE the distinct live experts' packed weights and scales
(activations are tiny); for a GEMM the bf16 weight. % copy = GB/s over the copy bandwidth (bytes read + written).
If tools/bench_attention.py exists, its run(results, copy_bw) adds the attention kernels.
"""
import argparse
import importlib.util
import json
import time
from dataclasses import replace

import numpy as np

from tools.gpu import require_gpu

H, I, E, TOPK, GROUP = 7168, 2048, 384, 8, 32
NS = (1, 4, 9, 17, 33, 65)
CHAIN_BYTES = 160 << 20   # a chain's distinct weight copies hold at least this many bytes (3x the 50 MB L2) ...
CHAIN_MIN = 8      # ... and it has at least this many calls (the host's ~8 us graph launch spread over them)
ROUTER_GATES = 24      # distinct K2 gates (5.5 MB each) per timed router graph: more than the 50 MB L2
K2_GEMMS = {"lm_head": (163840, 7168), "q_kv_a": (2112, 7168), "o": (7168, 8192), "shared_gate_up": (4096, 7168),
            "shared_down": (7168, 2048), "q_b": (12288, 1536), "kv_b": (32768, 512), "q_a": (1536, 7168),
            "kv_a": (576, 7168)}      # q_a and kv_a are stacked into q_kv_a at load


# variants of the default cuts, timed at the listed sizes beside the default in the same run (overrides of ExpertConfig
# / GemmConfig fields, or of kernels.gemm_wg.WgConfig fields under "wg"); the measurements behind the defaults are in the knobs' comments
# and docs/KERNELS.md
MOE_VARIANTS = {
    # blocks_per_sm=4: one wave of blocks (4 fit per SM at the 128-register cap) instead of the default's two
    "gu_bps4": dict(gu=dict(blocks_per_sm=4)), "bps4": dict(gu=dict(blocks_per_sm=4), dn=dict(blocks_per_sm=4)),
    "regs": dict(tiled=0),                                                   # gate_up on the register path
    "bulk_s4u1": dict(gu=dict(S=4, U=1)), "bulk_s3u2": dict(gu=dict(S=3)),   # gate_up rings of other shapes
    "bound2_8w": dict(tiled=0, gu=dict(WR=4, WK=2, blocks_per_sm=4, min_blocks=2),   # register gate_up, 8-warp
                      dn=dict(WR=8, WK=1, blocks_per_sm=4, min_blocks=2)),           # blocks, 2 per SM
}
# many-token MoE (issue 49: prompts): token counts, and the kernels.moe.MoeConfig.token_tiles values compared there
MANY_NS = (512, 4096)          # about 11 and 85 slots per K2 expert: bytes decide, then arithmetic
MANY_TILES = (1, 2)
# tag -> (token counts it is timed at, overrides of gemm_config's cut); xs=2: the activations as hi + lo bf16 parts
GEMM_MS = (1, 9, 17, 33, 65)
GEMM_VARIANTS = {"mma": (GEMM_MS, dict(WG=0)),      # the mma path (gemm_config's cut without WG) against wgmma
                 # wgmma knobs (kernels/gemm_wg.py): clusters of up to 8 or 2, blocks aimed at per SM, x prepared by
                 # prep_b (wg_x0) or converted by the blocks up to 16 rows (wg_x16)
                 "wg_cl8": ((1, 17, 33), dict(wg=dict(cl_max=8, target=2.0))),
                 "wg_cl2": ((1, 17, 33), dict(wg=dict(cl_max=2))),
                 "wg_x0": ((1,), dict(wg=dict(xin_rows=0))), "wg_x16": ((9,), dict(wg=dict(xin_rows=16))),
                 "wg_t1": ((1, 17, 33), dict(wg=dict(target=1.0))),
                 "wg_nofence": ((1, 17, 33), dict(wg=dict(tmap_fence=False))),
                 # prompt-sized x (issue 49): token blocks of 128 / 256 rows read each weight strip half / a quarter
                 # as often as the default 64 (the default is timed at these m too)
                 "wg_nb128": ((130, 256, 1024), dict(wg=dict(nb_max=128))),
                 "wg_nb256": ((256, 1024), dict(wg=dict(nb_max=256))),
                 # the mma path's rings: weights in a 4-stage ring, no B in the ring, B in a 2-stage ring
                 "ring4": (GEMM_MS, dict(S=4, RB=0)), "no_rb": ((17, 33), dict(S=0, RB=0)),
                 "rb2": ((17,), dict(S=2, RB=1)), "rb2w4": ((17, 33), dict(S=2, RB=1, WR=4)),
                 "xs2": ((17, 33, 65), dict(xs=2)),
                 # the k split from other warp targets (gemm_config target_warps; the k order stays a function of
                 # n, k): kernels/gemm.py TARGET_WARPS
                 "tw1k_r1": ((1, 17, 33), dict(tw=1056, R=1)), "tw2k_r1": ((1, 17, 33), dict(tw=2112, R=1)),
                 "tw2k": ((1, 17, 33), dict(tw=2112)), "tw8k": ((1, 17, 33), dict(tw=8192)),
                 "tw2k_r1_u8": ((1,), dict(tw=2112, R=1, U=8)), "tw1k_r1_u8": ((1,), dict(tw=1056, R=1, U=8)),
                 "t1_uncapped": ((1,), dict(MB=0)),          # the one-tile cut without the register cap
                 # steps in flight and row tiles at 2-3 token tiles (t2_u4 and t3_u2 are the defaults' values)
                 "t2_u4": ((9,), dict(U=4)), "t2_u1": ((9,), dict(U=1)), "t3_u2": ((17,), dict(U=2)),
                 "t3_r2": ((17,), dict(R=2))}
GEMM_DEFAULT_ONLY = ("q_a", "kv_a")     # stacked into q_kv_a: the default cut only
HEAD_GEMMS = {"w_uk": (64, 512, 128), "w_uv": (64, 128, 512)}
HEAD_VARIANTS = {"u4": dict(U=4), "r2": dict(R=2)}     # overrides of head_gemm_config's cut (not measured)


# ------------------------------------------------------------------------------------------------------ timing
def event_time(cp, fn, reps, stream):
    """Mean ms of fn() over reps, CUDA events on `stream`."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps


def capture(s, launches):
    """A CUDA graph of launches() captured on CuPy stream s (the current stream), uploaded."""
    s.begin_capture()
    try:
        launches()
    finally:
        graph = s.end_capture()
    graph.upload(s)
    return graph


def timed(cp, launches, reps):
    """(graph ms, eager ms) of the launch sequence `launches()`, on a fresh non-blocking stream."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        launches()                                   # warm-up: compiles, loads modules
        s.synchronize()
        eager = event_time(cp, launches, reps, s)
        graph = capture(s, launches)
        graph.launch(s)
        s.synchronize()
        replay = event_time(cp, lambda: graph.launch(s), reps, s)
    return replay, eager


def reps_for(nbytes, budget_ms=40.0):
    """Enough replays for ~budget_ms at ~4 TB/s, between 5 and 200."""
    return int(min(200, max(5, budget_ms / max(nbytes / 4e9, 1e-3))))


def chain_copies(nbytes):
    """Distinct copies of an op's nbytes of weights a chain cycles through: more than CHAIN_BYTES in all (<= 32)."""
    return max(1, min(32, -(-CHAIN_BYTES // nbytes)))


def chained_ms(cp, call, copies, nbytes):
    """ms per call of one graph of max(CHAIN_MIN, copies) calls back to back, call(i) on copy i % copies."""
    calls = max(CHAIN_MIN, copies)

    def chain():
        for i in range(calls):
            call(i % copies)
    return timed(cp, chain, max(2, reps_for(nbytes) // calls))[0] / calls


def copy_bandwidth(cp, nbytes=2 << 30):
    """Device-to-device copy GB/s counting bytes read + written (the 100% line); best of cudaMemcpy and a copy
    kernel."""
    src = cp.random.random(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        memcpy = lambda: dst.data.copy_from_device_async(src.data, src.nbytes, s)  # noqa: E731
        kernel = lambda: cp.copyto(dst, src)  # noqa: E731
        out = {}
        for name, fn in (("memcpy", memcpy), ("copy_kernel", kernel)):
            fn()
            out[name] = 2 * src.nbytes / (event_time(cp, fn, 20, s) * 1e-3) / 1e9
    return max(out.values()), out


# --------------------------------------------------------------------------------------------------------- data
def rand_words(cp, shape):
    """Random uint32 words (random float bits: every nibble pattern occurs)."""
    return cp.random.random(shape, dtype=cp.float32).view(cp.uint32) ^ cp.uint32(0x5A5A5A5A)


def rand_bf16(cp, shape, scale=0.02, offset=0.0):
    out = cp.empty(shape, cp.uint16)
    flat, n = out.reshape(-1), out.size
    step = 1 << 28
    for i in range(0, n, step):
        f = (cp.random.standard_normal(min(step, n - i), dtype=cp.float32) * scale + offset)
        flat[i:i + step] = (f.view(cp.uint32) >> 16).astype(cp.uint16)
    return out


def routing(rng, n):
    idx = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(n)]).astype(np.int32)
    return idx, rng.random((n, TOPK)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------- MoE
EXPERT_BYTES = (2 * I * H // 2 + 2 * I * H // GROUP * 2) + (H * I // 2 + H * I // GROUP * 2)


def k2_experts(cp, dv, gate_up, gus, down, ds, R):
    """DeviceExperts of the bench's random K2 expert words and scales (CuPy); gate_up in the bulk layout when R > 0."""
    from numbaengine.kernels.moe import DeviceExperts, int4_bulk_tiles
    gu, gs = (dv(int4_bulk_tiles(gate_up, gus, R, cp)), None) if R else (dv(gate_up), dv(gus))
    return DeviceExperts(gu, dv(down), gs, dv(ds), tiled=R)


def moe_cuts(over):
    """(gate_up, down) cuts of a MOE_VARIANTS entry: the engine's defaults for its layout, fields overridden."""
    from numbaengine.kernels.moe import MOE_DEFAULT, default_cuts
    gate_up, down = default_cuts(over.get("tiled", MOE_DEFAULT.tiled))
    return replace(gate_up, **over.get("gu", {})), replace(down, **over.get("dn", {}))


def bench_moe(cp, cuda, results, copy_bw, quick, tags=None, sweep_ns=(1, 17)):
    from numbaengine.kernels.moe import (
        MOE_DEFAULT,
        moe_combine,
        moe_plan,
        moe_stage,
        moe_workspace,
        router,
    )
    rng = np.random.default_rng(0)
    dv = cuda.as_cuda_array
    gate_up, down = rand_words(cp, (E, 2 * I, H // 8)), rand_words(cp, (E, H, I // 8))
    gus, ds = rand_bf16(cp, (E, 2 * I, H // GROUP), 0.002, 0.01), rand_bf16(cp, (E, H, I // GROUP), 0.002, 0.01)
    tiled_ex, raw = {}, [gate_up, gus, down, ds]   # R -> the experts with gate_up in the bulk layout (R = 0: rows)

    def experts(over):
        R = over.get("tiled", MOE_DEFAULT.tiled)
        if R not in tiled_ex:
            tiled_ex[R] = k2_experts(cp, dv, *raw, R)
        return tiled_ex[R]
    ex = experts({})
    bias = dv(cp.zeros(E, cp.float32))
    alloc = lambda shape, dtype: dv(cp.zeros(shape, dtype))  # noqa: E731
    ws = moe_workspace(max(NS), TOPK, H, I, E, alloc)
    rows = results.setdefault("moe", [])

    def run(n, gu_cfg, dn_cfg, tag, stages=False, ex=ex):
        def layer_args():
            idx, wts = routing(rng, n)
            x = dv(cp.random.standard_normal((n, H), dtype=cp.float32))
            return len(np.unique(idx)), x, dv(cp.asarray(idx)), dv(cp.asarray(wts))

        def layer_parts(x, di, dw):
            return {"plan+prep": lambda: moe_plan(x, di, ex, ws, gu_cfg, dn_cfg),
                    "gate_up": lambda: moe_stage(0, ex, dw, ws, gu_cfg),
                    "down": lambda: moe_stage(1, ex, dw, ws, dn_cfg),
                    "combine": lambda: moe_combine(out, None, ws, di, ex)}

        out = dv(cp.zeros((n, H), cp.float32))
        layers = [layer_args() for _ in range(CHAIN_MIN)]   # each its own routing: as consecutive layers read
        distinct, x, di, dw = layers[0]
        nbytes = distinct * EXPERT_BYTES
        parts = layer_parts(x, di, dw)

        def full():
            for f in parts.values():
                f()

        chain_parts = [list(layer_parts(*a[1:]).values()) for a in layers]
        reps = reps_for(nbytes)
        g_ms, e_ms = timed(cp, full, reps)
        c_ms = chained_ms(cp, lambda i: [f() for f in chain_parts[i]], CHAIN_MIN, nbytes)
        c_bytes = np.mean([a[0] for a in layers]) * EXPERT_BYTES
        row = dict(op="moe_int4", tag=tag, n=n, distinct_experts=distinct, bytes=nbytes, graph_ms=g_ms,
                   eager_ms=e_ms, gbps=nbytes / g_ms / 1e6, pct_copy_single=100 * nbytes / g_ms / 1e6 / copy_bw,
                   chain_ms=c_ms, chain_bytes=c_bytes, pct_copy=100 * c_bytes / c_ms / 1e6 / copy_bw,
                   gate_up_cfg=gu_cfg.__dict__, down_cfg=dn_cfg.__dict__)
        if stages:   # each stage alone (its graph replays the same plan: run the plan first)
            full()
            for name, f in parts.items():
                row[f"{name}_ms"] = timed(cp, f, reps)[0]
            gu_bytes = distinct * (2 * I * H // 2 + 2 * I * H // GROUP * 2)
            dn_bytes = distinct * (H * I // 2 + H * I // GROUP * 2)
            row["gate_up_pct_copy"] = 100 * gu_bytes / row["gate_up_ms"] / 1e6 / copy_bw
            row["down_pct_copy"] = 100 * dn_bytes / row["down_ms"] / 1e6 / copy_bw
        rows.append(row)
        print(f"moe  {tag:>14} n={n:3d} experts={distinct:3d} {nbytes / 1e6:8.1f} MB  "
              f"graph {g_ms * 1e3:8.1f} us {row['pct_copy_single']:5.1f}%  chain {c_ms * 1e3:8.1f} us "
              f"{c_bytes / c_ms / 1e6:7.0f} GB/s {row['pct_copy']:5.1f}%  eager {e_ms * 1e3:8.1f} us"
              + (f"  [gate_up {row['gate_up_ms'] * 1e3:.1f} us {row['gate_up_pct_copy']:.0f}%, down "
                 f"{row['down_ms'] * 1e3:.1f} us {row['down_pct_copy']:.0f}%, plan+prep {row['plan+prep_ms'] * 1e3:.1f}"
                 f" us, combine {row['combine_ms'] * 1e3:.1f} us]" if stages else ""), flush=True)
        return row

    # a sweep of cuts at the target sizes (sweep_ns: n = 1, 17 unless --moe-sweep-ns), then every n with the best one
    variants = {"default": {}, **_chosen(MOE_VARIANTS, tags)}
    best, best_pct = "default", -1.0
    for tag, over in variants.items():
        pct = np.mean([run(n, *moe_cuts(over), tag, ex=experts(over))["pct_copy"]
                       for n in sweep_ns])
        if pct > best_pct:
            best, best_pct = tag, pct
    results["moe_best_cut"] = best
    over = variants[best]
    for n in NS:
        run(n, *moe_cuts(over), "best", stages=True, ex=experts(over))
    if quick:
        return

    # router: fp32 gate GEMV + sigmoid/top-k selection; one graph runs it on ROUTER_GATES distinct gate copies (more
    # than L2 holds: the weights come from HBM as in a decode step) and the time is per call. form "mma": the logits
    # from the dense mma GEMM (x as bf16 hi + lo; what KernelOps.router uses from DispatchConfig.router_mma_from tokens)
    from numbaengine.kernels.gemm import GemmWorkspace, gemm, gemm_workspace_words
    from numbaengine.kernels.moe import ROUTER_XS
    gates = [dv(rand_bf16(cp, (E, H), 0.02)) for _ in range(ROUTER_GATES)]
    nxb, npart = gemm_workspace_words(max(NS), E, H, ROUTER_XS)
    gws = GemmWorkspace(dv(cp.zeros(max(nxb, 1), cp.uint32)), dv(cp.zeros(max(npart, 1), cp.float32)),
                        dv(cp.zeros(4096, cp.uint32)))      # k-split counters, as KernelOps.gemm passes them
    for form in ("gemv", "mma"):
        mma = (lambda xx, w, out: gemm(xx, w, out, gws, ROUTER_XS)) if form == "mma" else None  # noqa: E731
        for n in NS:
            x = dv(cp.random.standard_normal((n, H), dtype=cp.float32))
            ii, ww = dv(cp.zeros((n, TOPK), cp.int32)), dv(cp.zeros((n, TOPK), cp.float32))

            def f():
                for g in gates:
                    router(x, g, bias, TOPK, 1, 1, True, 2.827, ii, ww, ws, logits_gemm=mma)
            nbytes = E * H * 2
            g_ms, e_ms = (t / len(gates) for t in timed(cp, f, 20))
            results.setdefault("router", []).append(dict(op="router", form=form, n=n, bytes=nbytes, graph_ms=g_ms,
                                                         eager_ms=e_ms, gbps=nbytes / g_ms / 1e6,
                                                         pct_copy=100 * nbytes / g_ms / 1e6 / copy_bw))
            print(f"router {form} n={n:3d} graph {g_ms * 1e3:7.1f} us eager {e_ms * 1e3:7.1f} us "
                  f"{nbytes / g_ms / 1e6:6.0f} GB/s {100 * nbytes / g_ms / 1e6 / copy_bw:5.1f}% (K2: one group, per "
                  f"call)", flush=True)
    del gate_up, down, gus, ds
    raw.clear()
    tiled_ex.clear()


# -------------------------------------------------------------------------------------------------------- dense
def dense_peak(cp, n=8192, reps=10):
    """FLOP/s of cuBLAS's fp16 n x n x n GEMM (CuPy; the tensor cores' bf16 rate is the same): the rate of the FLOP
    floors, measured in the same run."""
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b, c = a.T.copy(), cp.empty((n, n), cp.float16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        cp.matmul(a, b, out=c)
        ms = event_time(cp, lambda: cp.matmul(a, b, out=c), reps, s)
    return 2 * n ** 3 / (ms * 1e-3)


def bench_moe_many(cp, cuda, results, copy_bw):
    """The INT4 MoE layer (plan + prep, gate_up, down, combine: one graph) at prompt sizes, beside the larger of its
    byte floor (live experts' weights + x in + out, at copy bandwidth) and its FLOP floor (2 * n * k * 3 * H * I at
    the dense peak), for each token-tile count the engine can pick (kernels.moe.stage_cuts)."""
    from numbaengine.kernels.moe import (
        MOE_DEFAULT,
        MoeConfig,
        moe_combine,
        moe_experts,
        moe_workspace,
        stage_cuts,
    )
    peak = dense_peak(cp)
    results["dense_peak_tflops"] = peak / 1e12
    print(f"dense peak (cuBLAS fp16 8192^3): {peak / 1e12:.0f} TFLOP/s", flush=True)
    rng = np.random.default_rng(1)
    dv = cuda.as_cuda_array
    ex = k2_experts(cp, dv, rand_words(cp, (E, 2 * I, H // 8)), rand_bf16(cp, (E, 2 * I, H // GROUP), 0.002, 0.01),
                    rand_words(cp, (E, H, I // 8)), rand_bf16(cp, (E, H, I // GROUP), 0.002, 0.01), MOE_DEFAULT.tiled)
    ws = moe_workspace(max(MANY_NS), TOPK, H, I, E, lambda shape, dtype: dv(cp.zeros(shape, dtype)))
    rows = results.setdefault("moe_many", [])
    for n in MANY_NS:
        idx, wts = routing(rng, n)
        x, out = dv(cp.random.standard_normal((n, H), dtype=cp.float32)), dv(cp.zeros((n, H), cp.float32))
        di, dw = dv(cp.asarray(idx)), dv(cp.asarray(wts))
        distinct = len(np.unique(idx))
        nbytes, flops = distinct * EXPERT_BYTES + 2 * n * H * 4, 2 * n * TOPK * 3 * H * I
        byte_ms, flop_ms = nbytes / copy_bw / 1e6, flops / peak * 1e3
        for t in MANY_TILES:
            cuts = stage_cuts(ex, n, TOPK, MoeConfig(tiled=MOE_DEFAULT.tiled, token_tiles=t))

            def layer():
                moe_experts(x, di, dw, ex, ws, *cuts)
                moe_combine(out, None, ws, di, ex)
            g_ms, e_ms = timed(cp, layer, 3)
            row = dict(op="moe_int4_many", n=n, T=cuts[0].T, distinct_experts=distinct, bytes=nbytes, flops=flops,
                       graph_ms=g_ms, eager_ms=e_ms, byte_floor_ms=byte_ms, flop_floor_ms=flop_ms,
                       pct_floor=100 * max(byte_ms, flop_ms) / g_ms, tflops=flops / g_ms / 1e9,
                       gate_up_cfg=cuts[0].__dict__, down_cfg=cuts[1].__dict__)
            rows.append(row)
            print(f"moe many n={n:5d} T={row['T']} experts={distinct:3d} graph {g_ms:8.3f} ms  floors: bytes "
                  f"{byte_ms:.3f} ms, FLOPs {flop_ms:.3f} ms -> {row['pct_floor']:5.1f}% of the larger  "
                  f"{row['tflops']:6.1f} TFLOP/s", flush=True)


def bench_gemm(cp, cuda, results, copy_bw, quick, tags=None, shapes=None):
    """Each K2 shape at GEMM_MS tokens: the default cut and the variants at their token counts (the best per m is
    reported); then the per-head GEMMs."""
    from numbaengine.kernels.gemm import (
        SMEM_MAX,
        GemmWorkspace,
        gemm,
        gemm_config,
        gemm_smem,
        gemm_workspace_words,
        token_tiles,
    )
    from numbaengine.kernels.gemm_wg import WgConfig
    bench_read_floor(cp, cuda, results, copy_bw)
    dv = cuda.as_cuda_array
    rows = results.setdefault("gemm", [])
    most = max(NS + tuple(m for ms, _ in GEMM_VARIANTS.values() for m in ms))
    xb_words = -(-most // 8) * 8 * 2 * max(k for _, k in K2_GEMMS.values()) // 2     # tiled B: rows padded to 8
    ws = GemmWorkspace(dv(cp.zeros(xb_words, cp.uint32)), dv(cp.zeros(64 * max(NS) * 32768, cp.float32)),
                       dv(cp.zeros(1 << 14, cp.uint32)))

    def run(name, ws_chain, m, n, k, tag, over):
        wg = WgConfig(**over.get("wg", {}))      # the wgmma path's choices for this run (kernels.gemm_wg.WgConfig)
        if "wg" in over:
            over = {f: v for f, v in over.items() if f != "wg"} | {"WG": 1}
        x, out = dv(cp.random.standard_normal((m, k), dtype=cp.float32)), dv(cp.zeros((m, n), cp.float32))
        if tag != "default":      # the variants of the mma path's cut: not the wgmma path unless they say so
            over = {"WG": 0} | over
        cfg = replace(gemm_config(m, n, k, wg=wg, **({"target_warps": over["tw"]} if "tw" in over else {})),
                      **{f: v for f, v in over.items() if f not in ("xs", "tw")})
        nbytes, xs = n * k * 2, over.get("xs", cfg.XS)
        need = gemm_workspace_words(m, n, k, xs, cfg, wg)
        T = token_tiles(m, cfg)
        if (need[0] > ws.xb.size or need[1] > ws.part.size or cfg.WR * cfg.WK > 8
                or gemm_smem(T, cfg, xs * T * cfg.RB) > SMEM_MAX):
            return 0.0
        w = ws_chain[0]
        g_ms, e_ms = timed(cp, lambda: gemm(x, w, out, ws, xs=xs, cfg=cfg, wg=wg), reps_for(nbytes))
        c_ms = chained_ms(cp, lambda i: gemm(x, ws_chain[i], out, ws, xs=xs, cfg=cfg, wg=wg), len(ws_chain), nbytes)
        row = dict(op="gemm", name=name, tag=tag, m=m, n=n, k=k, xs=xs, cfg=cfg.__dict__, bytes=nbytes,
                   graph_ms=g_ms, eager_ms=e_ms, pct_copy_single=100 * nbytes / g_ms / 1e6 / copy_bw,
                   chain_ms=c_ms, chain_copies=len(ws_chain), gbps=nbytes / c_ms / 1e6,
                   pct_copy=100 * nbytes / c_ms / 1e6 / copy_bw, tflops=2.0 * m * n * k / c_ms / 1e9)
        rows.append(row)
        print(f"gemm {name:>15} {tag:>13} m={m:3d} n={n:6d} k={k:5d} {nbytes / 1e6:8.1f} MB  graph "
              f"{g_ms * 1e3:8.1f} us {row['pct_copy_single']:5.1f}%  chain {c_ms * 1e3:8.1f} us "
              f"{row['gbps']:7.0f} GB/s {row['pct_copy']:5.1f}%  eager {e_ms * 1e3:8.1f} us  xs={xs} {cfg}", flush=True)
        return row["pct_copy"]

    for name, (n, k) in K2_GEMMS.items():
        if shapes and name not in shapes:
            continue
        w0 = rand_bf16(cp, (n, k), 0.02)
        w = [dv(w0)] + [dv(w0.copy()) for _ in range(1, chain_copies(2 * n * k))]
        best = {m: ("default", run(name, w, m, n, k, "default", {})) for m in GEMM_MS}
        for tag, (ms, over) in ({} if quick or name in GEMM_DEFAULT_ONLY else _chosen(GEMM_VARIANTS, tags)).items():
            for m in ms:
                if m not in best:                 # a token count only this variant tries: time the default too
                    best[m] = ("default", run(name, w, m, n, k, "default", {}))
                pct = run(name, w, m, n, k, tag, over)
                if pct > best[m][1]:
                    best[m] = (tag, pct)
        results.setdefault("gemm_best", {})[name] = {m: b[0] for m, b in best.items()}
        print(f"gemm {name:>15} best: " + ", ".join(f"m={m} {t} {p:.1f}%" for m, (t, p) in best.items()), flush=True)
        del w, w0
    bench_head_gemm(cp, cuda, results, copy_bw, True)     # the default head cut only (quick: no variants)


READ_MB = (8, 16, 30, 59, 117, 235)     # the K2 projections' weight sizes, and two larger


def read_kernel(trigger=False, wait=False, prefetch=False):
    """The read floor's kernel: XOR of all words (kept, so no load is dead), 4 x 16-byte loads in flight per thread.
    Launch: grid (4 * SMs), block 512; reads nwords * 4 bytes. For tools/pdl_probe, at its start: an optional PDL
    trigger of the next kernel, an L2 prefetch of this thread's first 4 x 16 bytes, the PDL wait (plain cuda.jit:
    nothing else added)."""
    from numba import cuda, uint32

    from numbaengine.kernels.device import ld16
    if trigger or wait or prefetch:
        from numbaengine.kernels.device import (
            _launch_dependents,
            _wait_previous,
            prefetch_l2,
        )

    @cuda.jit
    def read_k(w, out, nwords):
        i = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * 4
        step = cuda.gridDim.x * cuda.blockDim.x * 4
        if trigger:
            _launch_dependents()
        if prefetch:
            for j in range(4):
                if i + j * step < nwords:
                    prefetch_l2(w, i + j * step)
        if wait:
            _wait_previous()
        acc = uint32(0)
        while i + 3 * step < nwords:
            a0, a1, a2, a3 = ld16(w, i)
            b0, b1, b2, b3 = ld16(w, i + step)
            c0, c1, c2, c3 = ld16(w, i + 2 * step)
            d0, d1, d2, d3 = ld16(w, i + 3 * step)
            acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3 ^ c0 ^ c1 ^ c2 ^ c3 ^ d0 ^ d1 ^ d2 ^ d3
            i += 4 * step
        while i < nwords:
            a0, a1, a2, a3 = ld16(w, i)
            acc ^= a0 ^ a1 ^ a2 ^ a3
            i += step
        if acc == uint32(0x9E3779B9):
            out[0] = acc
    return read_k


def bench_read_floor(cp, cuda, results, copy_bw):
    """The yardstick of one streaming kernel: a pure read (16-byte loads, 4 in flight per thread, every SM full) of
    the same bytes in the same chain as the GEMMs (distinct copies, more than L2 holds): what launch, ramp-up and
    tail cost a kernel of that size with no arithmetic at all."""
    from numbaengine.kernels.launch import launch
    read_k = read_kernel()

    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    dv = cuda.as_cuda_array
    out = dv(cp.zeros(1, cp.uint32))
    for mb in READ_MB:
        nwords = (mb << 20) // 4
        ws = [dv(cp.zeros(nwords, cp.uint32)) for _ in range(chain_copies(4 * nwords))]
        c_ms = chained_ms(cp, lambda i: launch(read_k, 4 * sms, 512, ws[i], out, np.int32(nwords)), len(ws),
                          4 * nwords)
        row = dict(op="read", mb=mb, bytes=4 * nwords, chain_ms=c_ms, gbps=4 * nwords / c_ms / 1e6,
                   pct_copy=100 * 4 * nwords / c_ms / 1e6 / copy_bw)
        results.setdefault("read_floor", []).append(row)
        print(f"read floor {mb:4d} MB  chain {c_ms * 1e3:7.1f} us  {row['gbps']:6.0f} GB/s {row['pct_copy']:5.1f}%",
              flush=True)
        ws.clear()


def bench_head_gemm(cp, cuda, results, copy_bw, quick):
    """MLA's per-head products (one launch), default cut and variants: bytes = weights + x + out."""
    from numbaengine.kernels.gemm import GemmWorkspace, head_gemm, head_gemm_config
    dv = cuda.as_cuda_array
    ws = GemmWorkspace(dv(cp.zeros(1, cp.uint32)), dv(cp.zeros(1, cp.float32)))
    for name, (h, b, a) in HEAD_GEMMS.items():
        w = dv(rand_bf16(cp, (h, b, a), 0.02))
        for n in (1, 17, 130, 1040):
            x = dv(cp.random.standard_normal((n, h, a + 64), dtype=cp.float32))[:, :, :a]
            out = dv(cp.zeros((n, h, b), cp.float32))
            nbytes = h * b * a * 2 + n * h * (a + b) * 4
            for tag, over in {"default": {}, **({} if quick else HEAD_VARIANTS)}.items():
                cfg = replace(head_gemm_config(n, h, b, a), **over)
                g_ms, e_ms = timed(cp, lambda: head_gemm(x, w, out, ws, cfg), reps_for(nbytes))
                row = dict(op="head_gemm", name=name, tag=tag, n=n, h=h, b=b, a=a, bytes=nbytes, graph_ms=g_ms,
                           eager_ms=e_ms, gbps=nbytes / g_ms / 1e6, pct_copy=100 * nbytes / g_ms / 1e6 / copy_bw,
                           cfg=cfg.__dict__)
                results.setdefault("head_gemm", []).append(row)
                print(f"head_gemm {name} {tag:>7} n={n:5d} {nbytes / 1e6:7.1f} MB graph {g_ms * 1e3:7.1f} us eager "
                      f"{e_ms * 1e3:7.1f} us {row['gbps']:6.0f} GB/s {row['pct_copy']:5.1f}%", flush=True)


def summary(results):
    """The acceptance lines of the issue: best graph-replay % of copy bandwidth per op and size."""
    lines = []
    moe = [r for r in results.get("moe", []) if r["tag"] == "best"]
    for r in moe:
        goal = " (goal >= 75%, target 85%)" if r["n"] <= 17 else ""
        lines.append(f"MoE INT4 n={r['n']:2d}: {r['pct_copy']:5.1f}% of copy{goal}")
    for r in results.get("moe_many", []):
        lines.append(f"MoE INT4 n={r['n']} T={r['T']}: {r['pct_floor']:5.1f}% of its floor (goal >= 50%)")
    best = {}
    for r in results.get("gemm", []):
        key = (r["name"], r["m"])
        best[key] = max(best.get(key, 0.0), r["pct_copy"])
    for (name, m), pct in sorted(best.items()):
        goal = " (goal >= 80%)" if name == "lm_head" else (" (goal >= 75%)" if m <= 33 else "")
        lines.append(f"gemm {name:>15} m={m:2d}: {pct:5.1f}% of copy{goal}")
    return lines


def profile(case):
    """One case launched eagerly three times, for a profiler (ncu -k regex:... --launch-skip 1 -c 1):
    moe[:n[:variant]] (a MOE_VARIANTS tag), router[:n], or a GEMM name[:m]."""
    import cupy as cp
    from numba import cuda

    from numbaengine.kernels.gemm import GemmWorkspace, gemm
    from numbaengine.kernels.moe import MOE_DEFAULT, moe, moe_workspace, router
    dv = cuda.as_cuda_array
    name, _, rest = case.partition(":")
    count, _, tag = rest.partition(":")
    if name in ("moe", "router"):
        n = int(count or 17)
        ws = moe_workspace(n, TOPK, H, I, E, lambda shape, dtype: dv(cp.zeros(shape, dtype)))
        idx, wts = routing(np.random.default_rng(0), n)
        x, out = dv(cp.random.standard_normal((n, H), dtype=cp.float32)), dv(cp.zeros((n, H), cp.float32))
        di, dw = dv(cp.asarray(idx)), dv(cp.asarray(wts))
    if name == "moe":
        over = MOE_VARIANTS[tag] if tag else {}
        ex = k2_experts(cp, dv, rand_words(cp, (E, 2 * I, H // 8)), rand_bf16(cp, (E, 2 * I, H // GROUP), 0.002, 0.01),
                        rand_words(cp, (E, H, I // 8)), rand_bf16(cp, (E, H, I // GROUP), 0.002, 0.01),
                        over.get("tiled", MOE_DEFAULT.tiled))
        gu, dn = moe_cuts(over)
        for _ in range(3):
            moe(x, di, dw, ex, out, ws, cfg_gate_up=gu, cfg_down=dn)
    elif name == "router":
        wg, bias = dv(rand_bf16(cp, (E, H), 0.02)), dv(cp.zeros(E, cp.float32))
        for _ in range(3):
            router(x, wg, bias, TOPK, 1, 1, True, 2.827, di, dw, ws)
    else:                # "<K2_GEMMS name>[:m]"
        (n, k), m = K2_GEMMS[name], int(count or 1)
        w = dv(rand_bf16(cp, (n, k), 0.02))
        ws = GemmWorkspace(dv(cp.zeros(1 << 20, cp.uint32)), dv(cp.zeros(1 << 24, cp.float32)))
        x, out = dv(cp.random.standard_normal((m, k), dtype=cp.float32)), dv(cp.zeros((m, n), cp.float32))
        for _ in range(3):
            gemm(x, w, out, ws)
    cp.cuda.runtime.deviceSynchronize()


def _chosen(variants, tags):
    """The variants named in tags (None: all)."""
    return {t: v for t, v in variants.items() if tags is None or t in tags}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--quick", action="store_true", help="default cuts only")
    ap.add_argument("--only", choices=("moe", "moe_many", "gemm", "attention"), action="append")
    ap.add_argument("--variants", help="comma-separated MOE_VARIANTS / GEMM_VARIANTS tags to sweep (default: all)")
    ap.add_argument("--gemm-shapes", help="comma-separated K2_GEMMS names to time (default: all)")
    ap.add_argument("--moe-sweep-ns", default="1,17", help="token counts the MoE variants are compared at")
    ap.add_argument("--profile", help="run one case for a profiler, then exit: moe[:n[:variant]], router[:n] or a "
                                      "GEMM name[:m] (lm_head:33)")
    args = ap.parse_args(argv)
    try:
        sweep_ns = tuple(int(v) for v in args.moe_sweep_ns.split(","))
    except ValueError:
        ap.error(f"--moe-sweep-ns {args.moe_sweep_ns!r}: want token counts separated by commas")
    require_gpu("python -m tools.bench_kernels")
    if args.profile:
        return profile(args.profile)
    import cupy as cp
    from numba import cuda
    t0 = time.time()
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    copy_bw, copies = copy_bandwidth(cp)
    results = dict(device=dev["name"].decode(), sms=dev["multiProcessorCount"], copy_gbps=copy_bw, copies=copies)
    print(f"device {results['device']}: copy {copy_bw:.0f} GB/s (read + write) {copies}", flush=True)
    only = set(args.only or ("moe", "moe_many", "gemm", "attention"))
    tags = set(args.variants.split(",")) if args.variants is not None else None
    sections = [("moe", lambda: bench_moe(cp, cuda, results, copy_bw, args.quick, tags, sweep_ns)),
                ("moe_many", lambda: bench_moe_many(cp, cuda, results, copy_bw)),
                ("gemm", lambda: bench_gemm(cp, cuda, results, copy_bw, args.quick, tags,
                                                    args.gemm_shapes and args.gemm_shapes.split(",")))]
    if importlib.util.find_spec("tools.bench_attention") is not None:
        sections.append(("attention", lambda: importlib.import_module("tools.bench_attention").run(results, copy_bw)))
    for name, run in sections:
        if name in only:
            try:
                run()
            except Exception as e:   # keep the other sections' numbers
                results.setdefault("errors", {})[name] = repr(e)
                print(f"{name}: FAILED {e!r}", flush=True)
            results["summary"] = summary(results)
            results["wall_s"] = time.time() - t0
            with open(args.out, "w") as f:          # after every section: a killed run keeps what it measured
                json.dump(results, f, indent=1, default=float)
    print("\n".join(results["summary"]))
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
