"""Benchmarks of the attention and DDTree kernels on a GPU (issue 6): MLA absorbed attention over the bf16 latent
cache (GB/s on the cache bytes, % of copy bandwidth, TFLOP/s), prefill (absorbed vs naive), drafter attention, and
the per-round tree work (top-K, build, sampling, walk, commit, feature gather) in microseconds.

Every timing replays a CUDA graph of `reps` launches (numba launches captured on a CuPy stream), so Python launch
overhead is not measured. `run(results, copy_bw_gbs)` is called by tools/bench_kernels.py; alone:
    python -m tools.bench_attention [--out bench.json] [--quick] [--only mla|tree|prefill|drafter|splits]
    python -m tools.bench_attention --only mla --mla-variant '{"nk": 32}'     # a kernels.mla.MlaConfig
    python -m tools.bench_attention --only mla --quick --mla-max-batch 1 --mla-variant '[{}, {"merge": {"groups": 4}}]'
    python -m tools.bench_attention --only mla --mla-shapes '{"ctx": [4096], "heads": [64], "queries": [1]}'
    ncu -k regex:mla python -m tools.bench_attention --profile-mla 64:1:4096:64  # heads:queries:context:batch
    python -m tools.bench_attention --only mla --parallel --out v.json --mla-variant '[{}, {"wg": {"cluster": 0}}]'
(--parallel: a process per variant; all compile at once, then each times alone: tools/turns.py)
"""
import argparse
import contextlib
import json
import os
import time

import numpy as np

from tools.gpu import require_gpu

K2_D, K2_R, K2_V, K2_LAYERS, K2_HIDDEN = 576, 512, 163840, 61, 7168
K2_ROUND_US = 1300.0        # one K2 token-step at batch 1 on 8 GPUs: ~33 GB / 8 / 4.25 TB/s
K2_EXPERT_BYTES = 3 * 7168 * 2048 * (0.5 + 2 / 32)   # one routed expert: INT4 weights + a bf16 scale per 32


def k2_verify_floor_us(tokens, experts=384, topk=8, moe_layers=60):
    """Byte floor of a K2 round verifying `tokens` tokens at batch 1 on 8 GPUs (4.25 TB/s each): the one-token
    step (K2_ROUND_US) plus the routed experts the other tokens add, each token's top-8 drawn at random (expected
    distinct experts per layer: 384 (1 - (1 - 8/384)^n)). Correlated routing reads fewer; K2_ROUND_US is the
    floor whatever the routing."""
    distinct = experts * (1 - (1 - topk / experts) ** tokens)
    return K2_ROUND_US + moe_layers * (distinct - topk) * K2_EXPERT_BYTES / 8 / 4.25e12 * 1e6


def _cp():
    import cupy
    return cupy


def _nb(a):
    """A numba view of a CuPy array (made before capture; CuPy arrays cannot be passed while capturing)."""
    from numba import cuda
    return cuda.as_cuda_array(a)


class Keep(list):
    """Keeps the CuPy arrays behind numba views alive."""

    def arr(self, a):
        self.append(a)
        return _nb(a)

    def zeros(self, shape, dtype):
        return self.arr(_cp().zeros(shape, dtype))

    def normal(self, shape, scale=1.0):
        return self.arr((_cp().random.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32))

    def bf16(self, shape):
        x = _cp().random.standard_normal(shape, dtype=np.float32)
        return self.arr((x.view(np.uint32) >> 16).astype(np.uint16))


def _sm_count():
    cp = _cp()
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]


WARM = [False]              # True: gpu_us calls fn once (compiles) and times nothing (a --parallel child's warm pass)
PARTS = [False]             # True (--mla-parts): MLA rows that end in the merge launch also time its two halves


def gpu_us(fn, reps=10):
    """Microseconds per call of fn: a CUDA graph of `reps` calls, replayed; eager events if capture fails."""
    cp = _cp()
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        fn()                                    # compile, set attributes, make placeholders
        stream.synchronize()
        if WARM[0]:
            return 0.0, "warm"
        try:
            stream.begin_capture()
            for _ in range(reps):
                fn()
            graph = stream.end_capture()
            graph.launch(stream)
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) * 1000 / reps, "graph"
        except Exception as e:                  # noqa: BLE001 (report and fall back)
            try:
                stream.end_capture()
            except Exception:                   # noqa: BLE001
                pass
            start.record(stream)
            for _ in range(reps):
                fn()
            end.record(stream)
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) * 1000 / reps, f"eager ({type(e).__name__})"


def bench_mla(contexts, heads, queries, copy_bw, tokens_per_batch=256 * 1024, q_bytes_cap=512 << 20, max_batch=64,
              variant=None):
    """MLA decode/verify: B sequences of `ctx` committed rows + T tree tokens (all-visible masks), at batch 1 and
    min(max_batch, tokens_per_batch / ctx). GB/s counts the cache rows read once; tflops the S and P V products.
    variant: the settings to try (mla_settings: e.g. {"nk": 32, "max_stages": 2, "wg": {"cluster": 0}})."""
    from numbaengine.kernels.mla import (
        mla_attention,
        mla_geometry,
        mla_step_keys,
        mla_work,
    )
    with mla_settings(variant) as cfg:
        return _bench_mla(contexts, heads, queries, copy_bw, tokens_per_batch, q_bytes_cap, max_batch,
                          mla_attention, mla_geometry, mla_step_keys, mla_work, cfg)


@contextlib.contextmanager
def mla_settings(variant):
    """The kernels.mla.MlaConfig a variant names, yielded: {"nk": 32, "wg": {"cluster": 0}, "merge": {"groups": 4}}
    sets fields of MlaConfig and of its wg (MlaWgConfig) and merge (attention.MergeConfig). An unknown name is a
    one-line error."""
    import dataclasses

    from numbaengine.kernels.attention import MergeConfig
    from numbaengine.kernels.mla import MlaConfig
    from numbaengine.kernels.mla_wg import MlaWgConfig
    variant = dict(variant or {})
    subs = {"wg": (MlaWgConfig, variant.pop("wg", {})), "merge": (MergeConfig, variant.pop("merge", {}))}
    bad = sorted(set(variant) - {f.name for f in dataclasses.fields(MlaConfig)})
    bad += [f"{part}.{k}" for part, (kind, given) in subs.items()
            for k in sorted(set(given) - {f.name for f in dataclasses.fields(kind)})]
    if bad:
        raise SystemExit(f"mla variant: unknown settings {bad} (MlaConfig fields; wg, merge: their configs' fields)")
    yield MlaConfig(**variant, **{part: kind(**given) for part, (kind, given) in subs.items()})


def _bench_mla(contexts, heads, queries, copy_bw, tokens_per_batch, q_bytes_cap, max_batch, mla_attention,
               mla_geometry, mla_step_keys, mla_work, cfg):
    import numbaengine.kernels.mla_wg as kw
    rows = []
    for ctx in contexts:
        for h in heads:
            for T in queries:
                fit = min(max_batch, tokens_per_batch // ctx, q_bytes_cap // (T * h * K2_D * 4))
                for B in sorted({1, max(1, fit)}):
                    keep = Keep()
                    q = keep.normal((B, T, h, K2_D))
                    cache = keep.bf16((B, ctx + T, K2_D))
                    lengths = keep.arr(_cp().full(B, ctx, np.int32))
                    ntok = keep.arr(_cp().full(B, T, np.int32))
                    words = -(-T // 32)
                    mask = keep.arr(_cp().full((B, T, words), 0xFFFFFFFF, np.uint32))    # cost does not depend on it
                    out = keep.zeros((B, T, h, K2_R), np.float32)
                    work = mla_work(keep.zeros, B, T, h, K2_R, ctx + T, cfg=cfg)
                    call = lambda: mla_attention(q, cache, lengths, ntok, mask, 0.04, out, work, cfg=cfg)  # noqa: E731
                    us, how = gpu_us(call)
                    if WARM[0]:                 # compiled, nothing timed: no row
                        continue
                    split_us, merge_us = split_merge_us(call) if PARTS[0] else (None, None)
                    nbytes = B * (ctx + T) * K2_D * 2
                    flops = 2.0 * B * (ctx + T) * T * h * (K2_D + K2_R)
                    gbs = nbytes / us / 1e3
                    cluster = 0
                    if kw.mla_wg_applies(h, K2_D, K2_R, cfg.wg):
                        kern, nk, stages = "wgmma", cfg.wg.nk, kw.wg_stages(K2_D, cfg.wg.nk)
                        cluster = work.cluster      # how the call's splits merged
                        smem = kw.wg_smem(K2_D, nk, stages)
                    else:
                        rg, kg, stages, _, smem = mla_geometry(T * h, K2_D, K2_R, cfg)
                        kern, nk = "mma.sync", mla_step_keys(rg, kg, K2_D, K2_R, cfg)
                    rows.append(dict(ctx=ctx, heads=h, queries=T, batch=B, split=work.split, splits=work.o.shape[1],
                                     partials="bf16" if work.o.dtype == np.uint16 else "f32",
                                     cluster=cluster, kernel=kern, nk=nk, stages=stages,
                                     smem_kb=smem // 1024,
                                     us=round(us, 2), cache_gbs=round(gbs, 1), pct_copy=round(100 * gbs / copy_bw, 1),
                                     tflops=round(flops / us / 1e6, 1), timing=how))
                    if split_us is not None:
                        rows[-1].update(split_us=round(split_us, 2), merge_us=round(merge_us, 2),
                                        split_pct_copy=round(100 * nbytes / split_us / 1e3 / copy_bw, 1))
                    print("mla", rows[-1], flush=True)
                    del keep
    return rows


def split_merge_us(call):
    """(split kernel alone, merge launch alone) in us for an mla_attention call that ends in kernels.attention's
    merge_splits (graph replays as gpu_us; the merge alone re-reads the same partials), else (None, None). Where
    the time of a split call goes: the difference to the whole call is what the kernels overlap or leave idle."""
    import numbaengine.kernels.mla as km
    seen, merge = [], km.merge_splits
    km.merge_splits = lambda *a: seen.append(a)
    try:
        split_us, _ = gpu_us(call)
    finally:
        km.merge_splits = merge
    if not seen:
        return None, None
    return split_us, gpu_us(lambda: merge(*seen[0]))[0]


def mma_peak_tflops(chains=8, steps=4096):
    """The tensor-core roof of mma.sync m16n8k16 (bf16 in, f32 accumulate) from numba: every warp runs `chains`
    independent accumulator chains for `steps` steps on register operands (no memory in the loop), 8 warps per
    block, 8 blocks per SM. The compute-bound MLA shapes are judged against it."""
    import cupy as cp
    from numba import cuda, float32, uint32

    from numbaengine.kernels.device import mma_bf16
    from numbaengine.kernels.launch import launch
    NACC = 4 * chains

    @cuda.jit
    def mma_loop(out, steps):
        lane = cuda.threadIdx.x & 31
        a = uint32(0x3F803F80) + uint32(lane)          # bf16 pairs near 1: finite sums
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0)
        for _ in range(steps):
            for c in range(chains):
                acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3] = mma_bf16(
                    a, a, a, a, a, a, acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3])
        tot = float32(0)
        for i in range(NACC):
            tot += acc[i]
        out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = tot   # keeps the loop alive

    blocks, threads = 8 * _sm_count(), 256
    out = _nb(cp.zeros(blocks * threads, np.float32))
    us, _ = gpu_us(lambda: launch(mma_loop, blocks, threads, out, steps), reps=3)
    flops = 2.0 * 16 * 8 * 16 * chains * steps * blocks * threads // 32
    return round(flops / us / 1e6, 1)


def wgmma_loop_kernel(N=256, per_wait=8):
    """Kernel (out, steps) for wgmma_peak_tflops: a 128-thread block issues m64nNk16 wgmmas (kernels/wgmma.py) on
    one A and one B tile of zeros in shared memory into the same f32 accumulators, waiting every `per_wait`.
    (cupy-free, so tests/test_wgmma.py compiles it on the CPU.)"""
    from numba import cuda, uint32

    from numbaengine.kernels.device import F0, device
    from numbaengine.kernels.unroll import fill, tfold, unroll
    from numbaengine.kernels.wgmma import (
        fence_proxy_async,
        make_wgmma,
        smem_desc,
        wg_commit,
        wg_fence,
        wg_wait0,
    )
    NACC, NSM, PER_WAIT = N // 2, (64 + N) * 8, per_wait
    wgmma = make_wgmma(N)

    @device
    def issue(u, acc, da, db):
        return wgmma(da, db, acc, 1)

    @device
    def total(i, c, acc):
        return c if i == 0 else acc + c

    @cuda.jit
    def wgmma_loop(out, steps):
        sm = cuda.shared.array(NSM, uint32)
        for i in range(cuda.threadIdx.x, NSM, 128):
            sm[i] = uint32(0)
        fence_proxy_async()
        cuda.syncthreads()
        acc = fill(NACC, F0)                   # a tuple of registers (kernels/unroll.py), never indexed at run time
        da, db = smem_desc(sm, 0), smem_desc(sm, 2048)
        for _ in range(steps // PER_WAIT):
            wg_fence()
            acc = unroll(PER_WAIT, issue, acc, da, db)
            wg_commit()
            wg_wait0()
        out[cuda.blockIdx.x * 128 + cuda.threadIdx.x] = tfold(total, acc, F0)
    return wgmma_loop


def wgmma_peak_tflops(N=256, steps=2048, per_wait=8):
    """The warpgroup-MMA roof (sm_90a): wgmma_loop_kernel on 3 blocks per SM (154 registers x 128 threads each, by
    ptxas: 3 fit). Throughput only: the tiles hold zeros (the layout's correctness is tests/test_wgmma.py's)."""
    from numbaengine.kernels.launch import launch
    kern, blocks = wgmma_loop_kernel(N, per_wait), 3 * _sm_count()
    out = _nb(_cp().zeros(blocks * 128, np.float32))
    us, _ = gpu_us(lambda: launch(kern, blocks, 128, out, steps), reps=3)
    return round(2.0 * 64 * N * 16 * (steps // per_wait * per_wait) * blocks / us / 1e6, 1)


def profile_mla(case):
    """One MLA case launched eagerly three times, for a profiler: "heads:queries:ctx:batch" (ncu -k regex:mla)."""
    from numbaengine.kernels.mla import mla_attention, mla_work
    h, T, ctx, B = (int(v) for v in case.split(":"))
    keep = Keep()
    q, cache = keep.normal((B, T, h, K2_D)), keep.bf16((B, ctx + T, K2_D))
    lengths, ntok = keep.arr(_cp().full(B, ctx, np.int32)), keep.arr(_cp().full(B, T, np.int32))
    mask = keep.arr(_cp().full((B, T, -(-T // 32)), 0xFFFFFFFF, np.uint32))
    out = keep.zeros((B, T, h, K2_R), np.float32)
    with mla_settings(MLA_VARIANTS[0]) as cfg:
        work = mla_work(keep.zeros, B, T, h, K2_R, ctx + T, cfg=cfg)
        for _ in range(3):
            mla_attention(q, cache, lengths, ntok, mask, 0.04, out, work, cfg=cfg)
    _cp().cuda.runtime.deviceSynchronize()


def _tree_case(keep, budget, batch=1, L=15, V=K2_V):
    """A K2-shaped tree round's inputs: tree buffers for `budget`, drafter logits f32[batch, L, V] and target
    logits f32[batch (budget + 1), V] ~ N(0, 9), per-sequence budgets / lengths (1000) / bonus / seq ids."""
    from numbaengine.kernels.tree import tree_buffers
    cp = _cp()
    K, N = min(budget, V), budget + 1
    tb = tree_buffers(keep.zeros, batch, L, K, N, V)
    draft_logits, target_logits = keep.normal((batch, L, V), 3.0), keep.normal((batch * N, V), 3.0)
    budgets_d, lengths = keep.arr(cp.full(batch, budget, np.int32)), keep.arr(cp.full(batch, 1000, np.int32))
    bonus, seq_ids = keep.zeros(batch, np.int32), keep.arr(cp.arange(batch, dtype=np.int32))
    return tb, draft_logits, target_logits, budgets_d, lengths, bonus, seq_ids


def profile_tree(budget):
    """The tree round's stages launched eagerly three times at one budget, batch 1, for a profiler (ncu -k
    regex:topk|build|sample|walk|commit)."""
    from numbaengine.kernels.sample import sample
    from numbaengine.kernels.tree import tree_build, tree_topk
    keep = Keep()                                 # holds the arrays behind the numba views
    tb, draft_logits, target_logits, budgets_d, lengths, bonus, seq_ids = _tree_case(keep, int(budget))
    for _ in range(3):
        tree_topk(draft_logits, tb)
        tree_build(tb, budgets_d, lengths, bonus, seq_ids)
        sample(target_logits, 1.0, 7, tb.sample_seq, tb.sample_pos, tb.post, work=tb.sample_work)
    _cp().cuda.runtime.deviceSynchronize()


def bench_prefill(T=1024, h=64):
    """Prompt attention at T tokens: the absorbed kernel (causal mode) vs the naive form on the generic kernel."""
    from numbaengine.kernels.attention import attention
    from numbaengine.kernels.mla import mla_attention
    keep = Keep()
    q = keep.normal((1, T, h, K2_D))
    cache = keep.bf16((1, T, K2_D))
    zero, ntok = keep.zeros(1, np.int32), keep.arr(_cp().full(1, T, np.int32))
    out = keep.zeros((1, T, h, K2_R), np.float32)
    absorbed, how = gpu_us(lambda: mla_attention(q, cache, zero, ntok, None, 0.04, out), reps=3)
    qn, kn, vn = keep.normal((T, h, 192)), keep.normal((T, h, 192)), keep.normal((T, h, 128))
    causal = keep.arr(_cp().tril(_cp().ones((T, T), dtype=bool)))
    on = keep.zeros((T, h, 128), np.float32)
    naive, how2 = gpu_us(lambda: attention(qn, kn, vn, causal, 0.04, on), reps=3)
    row = dict(tokens=T, heads=h, absorbed_us=round(absorbed, 1), naive_us=round(naive, 1),
               faster="absorbed" if absorbed < naive else "naive", timing=f"{how}/{how2}")
    print("prefill", row, flush=True)
    return [row]


DRAFTERS = {"pair": dict(h=6, hk=2, d=64), "k2": dict(h=32, hk=8, d=128)}


def bench_drafter(cases, copy_bw, n=16):
    """DFlash drafter attention (kv_attention): B sequences, each a block of n queries over ctx context rows plus
    the block (f32 K/V caches of capacity ctx + n, no mask); GB/s on the K/V bytes read."""
    from numbaengine.kernels.attention import kv_attention, kv_attention_work
    rows = []
    for name, ctx, B, tc in cases:
        h, hk, d = DRAFTERS[name]["h"], DRAFTERS[name]["hk"], DRAFTERS[name]["d"]
        keep = Keep()
        S = ctx + n
        q, k, v = keep.normal((B, n, h, d)), keep.normal((B, S, hk, d)), keep.normal((B, S, hk, d))
        kv_len = keep.arr(_cp().full(B, S, np.int32))
        out = keep.zeros((B, n, h, d), np.float32)
        work = kv_attention_work(keep.zeros, B, n, h, d, S, tensor_cores=tc)
        us, how = gpu_us(lambda: kv_attention(q, k, v, kv_len, d ** -0.5, out, work, tc))
        gbs = B * S * hk * 2 * d * 4 / us / 1e3
        rows.append(dict(drafter=name, kernel="tensor cores" if tc else "f32", ctx=ctx, batch=B, queries=n, heads=h,
                         kv_heads=hk, head_dim=d, splits=work.o.shape[1], us=round(us, 1), kv_gbs=round(gbs, 1),
                         pct_copy=round(100 * gbs / copy_bw, 1), timing=how))
        print("drafter", rows[-1], flush=True)
        del keep
    return rows


def drafter_cases(quick=False):
    """(drafter, context, batch, tensor cores) cases: the shipped pair up to 4K, the K2-size drafter up to 16K
    (tensor-core kernel), a few on the f32 kernel for comparison."""
    f32 = [("pair", 4096, 16, False), ("k2", 4096, 8, False)]
    if quick:
        return [("pair", 1024, 1, True), ("pair", 4096, 32, True), ("k2", 4096, 1, True), ("k2", 4096, 16, True)] + f32
    return ([("pair", c, B, True) for c in (1024, 4096) for B in (1, 16, 128)]
            + [("k2", c, B, True) for c in (1024, 4096, 16384) for B in (1, 8, 64)] + f32)


PAIR_MLA = dict(h=6, D=160, r=128)


def bench_splits(caps=(1024, 4096), lengths=(128, 256, 512, 1024, 4000), mins=(0, 128, 256, 512)):
    """Flash-decoding split choice on the shipped pair's decode shapes, batch 1: MLA (T = 1 and 17 queries) and the
    drafter's kv_attention (16 queries) over a cache of capacity `cap` holding `length` keys, one split (no merge
    launch) vs splits of at least `min` keys (0: the default rule) with the merge. Microseconds, graph replays."""
    from numbaengine.kernels.attention import kv_attention, kv_attention_work
    from numbaengine.kernels.mla import mla_attention, mla_work
    cp = _cp()
    rows = []
    for cap in caps:
        for L in [x for x in lengths if x <= cap]:
            keep = Keep()
            h, D, r = PAIR_MLA["h"], PAIR_MLA["D"], PAIR_MLA["r"]
            cache = keep.bf16((1, cap, D))
            for T in (1, 17):
                q, out = keep.normal((1, T, h, D)), keep.zeros((1, T, h, r), np.float32)
                lengths_d = keep.arr(cp.full(1, L - T, np.int32))
                ntok = keep.arr(cp.full(1, T, np.int32))
                mask = keep.arr(cp.full((1, T, 1), 0xFFFFFFFF, np.uint32))
                row = dict(kernel="mla", cap=cap, keys=L, queries=T)
                for mn in mins:
                    work = mla_work(keep.zeros, 1, T, h, r, cap, D=D)
                    if mn and work.split < mn:
                        work = mla_work(keep.zeros, 1, T, h, r, cap, split=mn, D=D)
                    row[f"split{mn}_us"] = round(gpu_us(lambda: mla_attention(q, cache, lengths_d, ntok, mask, 0.1,
                                                                              out, work))[0], 2)
                    row[f"split{mn}_n"] = work.o.shape[1]
                row["one_us"] = round(gpu_us(lambda: mla_attention(q, cache, lengths_d, ntok, mask, 0.1, out))[0], 2)
                rows.append(row)
                print("splits", row, flush=True)
            dr = DRAFTERS["pair"]
            q, k, v = (keep.normal((1, 16, dr["h"], dr["d"])), keep.normal((1, cap, dr["hk"], dr["d"])),
                       keep.normal((1, cap, dr["hk"], dr["d"])))
            kv_len, out = keep.arr(cp.full(1, L, np.int32)), keep.zeros((1, 16, dr["h"], dr["d"]), np.float32)
            row = dict(kernel="drafter", cap=cap, keys=L, queries=16)
            for mn in mins:
                work = kv_attention_work(keep.zeros, 1, 16, dr["h"], dr["d"], cap, min_split=mn)
                row[f"split{mn}_us"] = round(gpu_us(lambda: kv_attention(q, k, v, kv_len, 0.1, out, work))[0], 2)
                row[f"split{mn}_n"] = work.o.shape[1]
            row["one_us"] = round(gpu_us(lambda: kv_attention(q, k, v, kv_len, 0.1, out))[0], 2)
            rows.append(row)
            print("splits", row, flush=True)
            del keep
    return rows


def bench_tree(budgets, L=15, V=K2_V, batch=1, F=5, seeds=(1, 2, 3), copy_bw_gbs=None):
    """One DDTree round's tree work for K2 shapes: per stage and in total, in microseconds (sampling through the
    split sampler with the tree's workspace; sample_T1_rows: one block per row, for comparison). The target
    logits are N(0, 9): the Gumbel bound skips fewer logs than on a real, peaked distribution. Each stage is the
    median over draws of the logits (cupy seeds `seeds`: the build's pops depend on the tree), the round the
    median of the draws' sums (their range beside it); with copy_bw_gbs, top-K and sampling as % of copy on the
    logits they read (f32: B L V and B (budget + 1) V values)."""
    from numbaengine.kernels.sample import sample
    from numbaengine.kernels.tree import tree_build, tree_commit, tree_topk, tree_walk
    cp = _cp()

    def topk_first_stage(logits, tb):
        """tree_topk's first launch alone (the per-chunk histograms and candidate lists)."""
        from numbaengine.kernels.topk import topk_launch
        topk_launch(logits, tb.cand, tb.cstats, tb.ids, tb.lp, merge=False)
    rows = []
    for Bud in budgets:
        runs = {}                                   # stage -> us per seed
        for seed in seeds:                          # the build's work depends on the tree: several draws
            cp.random.seed(seed)
            keep = Keep()
            N = Bud + 1
            tb, draft_logits, target_logits, budgets_d, lengths, bonus, seq_ids = _tree_case(keep, Bud, batch, L, V)
            cache = keep.bf16((K2_LAYERS, batch, 4096, K2_D))
            hidden = keep.normal((F, batch, N, K2_HIDDEN))
            feats = keep.zeros((batch, L + 1, F * K2_HIDDEN), np.float32)
            feat_pos = keep.zeros((batch, L + 1), np.int32)
            tree_topk(draft_logits, tb)
            tree_build(tb, budgets_d, lengths, bonus, seq_ids)
            stages = {
                "topk": lambda: tree_topk(draft_logits, tb),
                "build": lambda: tree_build(tb, budgets_d, lengths, bonus, seq_ids),
                "sample_T0": lambda: sample(target_logits, 0.0, 0, tb.sample_seq, tb.sample_pos, tb.post,
                                            work=tb.sample_work),
                "sample_T1": lambda: sample(target_logits, 1.0, 7, tb.sample_seq, tb.sample_pos, tb.post,
                                            work=tb.sample_work),
                "sample_T1_rows": lambda: sample(target_logits, 1.0, 7, tb.sample_seq, tb.sample_pos, tb.post),
                "walk": lambda: tree_walk(tb, lengths, bonus),          # advances lengths: cache has room
                "commit": lambda: tree_commit(tb, cache, hidden, feats, feat_pos),
                "topk_part": lambda: topk_first_stage(draft_logits, tb),   # last: leaves the row histogram dirty
            }
            for name, fn in stages.items():
                us, how = gpu_us(fn, reps=5)
                runs.setdefault(name, []).append(us)
                if how != "graph":
                    raise RuntimeError(f"tree bench: {name} was not timed as a graph ({how})")
            del keep
        rounds = [sum(runs[n][i] for n in ROUND_STAGES) for i in range(len(seeds))]
        row = dict(budget=Bud, batch=batch, depths=L, vocab=V, layers=K2_LAYERS, seeds=list(seeds))
        row.update({name + "_us": round(float(np.median(v)), 1) for name, v in runs.items()})
        row["round_us"] = round(float(np.median(rounds)), 1)
        row["round_us_min_max"] = [round(min(rounds), 1), round(max(rounds), 1)]
        row["pct_of_k2_round"] = round(100 * row["round_us"] / K2_ROUND_US, 1)
        row["k2_verify_floor_us"] = round(k2_verify_floor_us(Bud + 1), 0)
        row["pct_of_k2_verify_floor"] = round(100 * row["round_us"] / row["k2_verify_floor_us"], 2)
        if copy_bw_gbs:
            for name, nbytes in (("topk", 4 * batch * L * V), ("sample_T0", 4 * batch * (Bud + 1) * V),
                                 ("sample_T1", 4 * batch * (Bud + 1) * V)):
                row[name + "_pct_of_copy"] = round(100 * nbytes / (row[name + "_us"] * 1e3) / copy_bw_gbs, 1)
        rows.append(row)
        print("tree", row, flush=True)
    return rows


ROUND_STAGES = ("topk", "build", "sample_T1", "walk", "commit")     # one DDTree round's tree work (sampled)


OPT_IN = ("splits",)        # tables run only when asked for by name (--only)
MLA_VARIANTS = [{}]         # kernels.mla settings for the mla table, one table per entry (--mla-variant)
MLA_MAX_BATCH = [64]        # the mla table's largest batch (--mla-max-batch)
MLA_SHAPES = {}             # the mla table's contexts / heads / queries where not the defaults (--mla-shapes)


def mla_tables(ctxs, copy_bw_gbs):
    """The mla table for each of MLA_VARIANTS in one process (kernels compiled once); with several, each row names
    its variant."""
    rows = []
    for v in MLA_VARIANTS:
        print("mla variant", v, flush=True)
        table = bench_mla(MLA_SHAPES.get("ctx", ctxs), MLA_SHAPES.get("heads", [64, 8]),
                          MLA_SHAPES.get("queries", [1, 17, 65]), copy_bw_gbs, variant=v, max_batch=MLA_MAX_BATCH[0])
        rows += [dict(r, variant=v) for r in table] if len(MLA_VARIANTS) > 1 else table
    return rows


def mla_contexts(quick):
    return [1024, 4096] if quick else [1024, 4096, 16384, 65536]


def parallel_mla(args, folder):
    """--parallel: the mla table of each --mla-variant in its own child process (tools/turns.py: all compile at
    once, then each times alone); returns {"attention": {"copy_bw_gbs": [per variant], "mla": rows}}."""
    import sys

    from tools.turns import run_children
    shared = ["--mla-max-batch", str(MLA_MAX_BATCH[0])] + (["--quick"] if args.quick else []) + (
        ["--mla-parts"] if args.mla_parts else []) + (
        ["--mla-shapes", args.mla_shapes] if args.mla_shapes else [])
    cmds, outs = [], []
    for i, v in enumerate(MLA_VARIANTS):
        outs.append(os.path.join(folder, f"variant{i}.json"))
        cmds.append([sys.executable, "-m", "tools.bench_attention", "--only", "mla", "--mla-variant", json.dumps(v),
                     "--out", outs[-1], "--turn", f"{folder}:{i}:{len(MLA_VARIANTS)}"] + shared)
    codes = run_children(cmds, folder)
    rows, bws = [], []
    for v, out, code in zip(MLA_VARIANTS, outs, codes):
        if code or not os.path.exists(out):
            raise SystemExit(f"bench_attention --parallel: the child of variant {v} exited with {code}"
                             + ("" if code else f" and wrote no {out}"))
        with open(out) as f:
            child = json.load(f)
        bws.append(child["copy_bw_gbs"])
        rows += [dict(r, variant=v) for r in child["mla"]]
    return {"attention": {"copy_bw_gbs": bws, "mla": rows}}


def timed_child(args):
    """--turn FOLDER:I:N: one variant's mla table, compiled in a warm pass beside its siblings, then timed alone
    (copy bandwidth first) while holding the folder's lock."""
    from tools.turns import turn
    folder, index, count = args.turn.rsplit(":", 2)
    ctxs = mla_contexts(args.quick)
    WARM[0] = True
    mla_tables(ctxs, 1.0)
    WARM[0] = False
    with turn(folder, int(index), int(count)):
        bw = copy_bandwidth()
        print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
        result = {"copy_bw_gbs": bw, "mla": mla_tables(ctxs, bw)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def run(results: dict, copy_bw_gbs: float, quick=False, on_table=None, only=None):
    """Fill results['attention'] with every table above but the OPT_IN ones, or the one named `only` (called by
    tools/bench_kernels.py); on_table(results) after each table (to save partial results)."""
    t0 = time.time()
    ctxs = mla_contexts(quick)
    res = results.setdefault("attention", {})
    res["copy_bw_gbs"] = copy_bw_gbs
    res["k2_round_us"] = K2_ROUND_US
    res["mma_sync_tflops"] = mma_peak_tflops()
    print(f"mma.sync m16n8k16 bf16 roof: {res['mma_sync_tflops']} TFLOP/s", flush=True)
    try:                                         # a new building block: its failure must not cost the tables
        res["wgmma_tflops"] = wgmma_peak_tflops()
        print(f"wgmma m64n256k16 bf16 roof: {res['wgmma_tflops']} TFLOP/s", flush=True)
    except Exception as e:                       # noqa: BLE001
        res["wgmma_error"] = repr(e)[:500]
        print("wgmma roof FAILED", repr(e)[:300], flush=True)
    for name, fn in [("mla", lambda: mla_tables(ctxs, copy_bw_gbs)),
                     ("tree", lambda: bench_tree([16, 64, 255] if quick else [16, 32, 64, 128, 255],
                                                 copy_bw_gbs=copy_bw_gbs)),
                     ("prefill", lambda: bench_prefill()),
                     ("drafter", lambda: bench_drafter(drafter_cases(quick), copy_bw_gbs)),
                     ("splits", lambda: bench_splits())]:
        if (only and name != only) or (name in OPT_IN and name != only):
            continue
        try:
            res[name] = fn()
        except Exception as e:                   # noqa: BLE001 (keep the other tables)
            import traceback
            res[name + "_error"] = traceback.format_exc()[-3000:]
            print(name, "FAILED", e, flush=True)
        if name == "mla" and "mla" in res:    # compute-bound shapes: how close to the tensor-core roof
            for row in res["mla"]:
                row["pct_mma_roof"] = round(100 * row["tflops"] / res["mma_sync_tflops"], 1)
        if on_table:
            on_table(results)
    res["seconds"] = round(time.time() - t0, 1)
    return results


def copy_bandwidth():
    """Device-to-device copy GB/s (bytes read + written), the 100% mark."""
    cp = _cp()
    a = cp.empty(1 << 30, np.uint8)
    b = cp.empty_like(a)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    b[...] = a
    start.record()
    for _ in range(10):
        b[...] = a
    end.record()
    end.synchronize()
    return 2 * 10 * a.nbytes / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["mla", "tree", "prefill", "drafter", "splits"], default=None)
    ap.add_argument("--profile-mla", metavar="H:T:CTX:B", help="run one MLA case three times for a profiler, exit")
    ap.add_argument("--mla-variant", metavar="JSON",
                    help='MlaConfig settings for the mla table, e.g. {"nk": 32, "wg": {"cluster": 0}}, or a list (a table each)')
    ap.add_argument("--mla-max-batch", type=int, default=64, metavar="B",
                    help="the mla table's largest batch (1: the batch-1 rows only)")
    ap.add_argument("--mla-shapes", metavar="JSON",
                    help='the mla table\'s shapes, e.g. {"ctx": [4096, 16384], "heads": [64], "queries": [1]}')
    ap.add_argument("--profile-tree", metavar="BUDGET", help="run the tree stages three times for a profiler, exit")
    ap.add_argument("--mla-parts", action="store_true",
                    help="MLA rows merged by the merge launch also time the split kernel and the merge alone")
    ap.add_argument("--parallel", action="store_true",
                    help="with --only mla and several --mla-variant: a process per variant, compiling at once, "
                         "timing one at a time")
    ap.add_argument("--turn", metavar="FOLDER:I:N", help=argparse.SUPPRESS)    # a --parallel child
    args = ap.parse_args()
    require_gpu("python -m tools.bench_attention")
    if args.mla_variant:
        v = json.loads(args.mla_variant)
        MLA_VARIANTS[:] = v if isinstance(v, list) else [v]
    MLA_MAX_BATCH[0] = args.mla_max_batch
    PARTS[0] = args.mla_parts
    if args.mla_shapes:
        shapes = json.loads(args.mla_shapes)
        if not isinstance(shapes, dict) or set(shapes) - {"ctx", "heads", "queries"}:
            raise SystemExit(f"--mla-shapes {args.mla_shapes}: a JSON object of ctx / heads / queries lists")
        MLA_SHAPES.update(shapes)
    if args.profile_tree:
        return profile_tree(args.profile_tree)
    if args.profile_mla:
        return profile_mla(args.profile_mla)
    if args.turn:
        return timed_child(args)
    if args.parallel:
        if args.only != "mla" or not args.out:
            raise SystemExit("bench_attention --parallel: runs the mla table only (--only mla) and needs --out")
        import tempfile
        results = parallel_mla(args, tempfile.mkdtemp(prefix="bench_turns_", dir=os.path.dirname(
            os.path.abspath(args.out))))
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    def save(results):
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    run({}, bw, quick=args.quick, on_table=save, only=args.only)


if __name__ == "__main__":
    main()
