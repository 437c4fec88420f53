"""Kernel-vs-reference checks of the dense and MoE kernels, shared by the simulator cases and the GPU tests of
tests/test_cuda_dense.py and tests/test_cuda_moe.py. `env` is tests/cudasim.py's Env (NumPy arrays under the
simulator, numba device arrays on a GPU). Outputs are poisoned (NaN / -1) before every launch; failures report the
worst element."""
import numpy as np
from numba import (  # the simulator swaps `cuda` among a kernel's globals, not in a closure
    cuda,
    int32,
)

from numbaengine.weights.dtypes import bf16_to_f32, f32_to_bf16


def poisoned(env, shape, dtype):
    """A device array full of NaN (floats) or -1 / max (integers)."""
    return env.dev(np.full(shape, _poison(dtype), dtype))


def _poison(dtype):
    dtype = np.dtype(dtype)
    return np.nan if dtype.kind == "f" else (-1 if dtype.kind == "i" else np.iinfo(dtype).max)


def assert_close(name, got, ref, tol, scale=None):
    """max |got - ref| / scale <= tol, scale defaulting to max |ref|; reports the worst element."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} non-finite (poison left?)"
    scale = np.abs(ref).max() if scale is None else scale
    err = np.abs(got - ref) / max(scale, 1e-30)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] <= tol, f"{name}: worst rel err {err[worst]:.3g} at {worst}: got {got[worst]}, ref {ref[worst]}"


def rand_bf16(rng, *shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


# ------------------------------------------------------------------------------------------------------ dense
def check_gemm(env, m, n, k, xs, cfg=None, seed=0):
    from numbaengine.kernels.gemm import GemmWorkspace, gemm, gemm_workspace_words
    from numbaengine.reference import gemm_ref
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rand_bf16(rng, n, k)
    nxb, npart = gemm_workspace_words(m, n, k, xs, cfg)
    ws = GemmWorkspace(poisoned(env, (max(nxb, 1),), np.uint32), poisoned(env, (max(npart, 1),), np.float32))
    out = poisoned(env, (m, n), np.float32)
    gemm(env.dev(x), env.dev(w), out, ws, xs=xs, cfg=cfg)
    ref = gemm_ref(x, w, np.empty((m, n), np.float32))
    scale = (np.abs(x) @ np.abs(bf16_to_f32(w)).T).max()
    assert_close(f"gemm m={m} n={n} k={k} xs={xs}", env.host(out), ref, 2e-5 if xs == 2 else 4e-3, scale)
    return env.host(out)


def check_shared_arrays(env, threads=64):
    """Every thread of a block gets the same static shared array per source line, two lines get two arrays (on the
    simulator this needs kernels.device's lock around numba-cuda's allocation table)."""
    from numbaengine.kernels.device import SIM
    from numbaengine.kernels.launch import launch
    if SIM:
        from numba.cuda.simulator.kernelapi import FakeCUDAShared
        assert getattr(FakeCUDAShared.array, "locked", False), "the simulator's shared arrays are not locked"

    @cuda.jit
    def count(out):
        a = cuda.shared.array(1, int32)
        b = cuda.shared.array(1, int32)
        if cuda.threadIdx.x == 0:
            a[0], b[0] = 0, 0
        cuda.syncthreads()
        cuda.atomic.add(a, 0, 1)
        cuda.atomic.add(b, 0, 2)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            out[0], out[1] = a[0], b[0]
    out = poisoned(env, (2,), np.int32)
    launch(count, 1, threads, out)
    assert env.host(out).tolist() == [threads, 2 * threads], env.host(out)


def check_norm(env, n, d, add, seed=0):
    from numbaengine.kernels.norm import add_rmsnorm, rmsnorm
    from numbaengine.reference import add_rmsnorm_ref, rmsnorm_ref
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    res = rng.standard_normal((n, d)).astype(np.float32)
    w = rand_bf16(rng, d)
    out = poisoned(env, (n, d), np.float32)
    ref = np.empty((n, d), np.float32)
    if add:
        dres, kept = env.dev(res), (poisoned(env, (n, d), np.float32) if add == "keep" else None)
        add_rmsnorm(env.dev(x), dres, env.dev(w), 1e-6, out, kept)
        add_rmsnorm_ref(x, res, w, 1e-6, ref)
        assert_close("add_rmsnorm residual", env.host(dres), res, 1e-6)
        if kept is not None:
            assert_close("add_rmsnorm kept residual", env.host(kept), env.host(dres), 0)
    else:
        rmsnorm(env.dev(x), env.dev(w), 1e-6, out)
        rmsnorm_ref(x, w, 1e-6, ref)
    assert_close(f"rmsnorm add={add} n={n} d={d}", env.host(out), ref, 1e-5)


def check_norm_strided(env, seed=0):
    """In place on a column slice (the model's kv[:, :r]): strided rows, out aliasing x."""
    from numbaengine.kernels.norm import rmsnorm
    from numbaengine.reference import rmsnorm_ref
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((5, 80)).astype(np.float32)
    w = rand_bf16(rng, 64)
    dkv = env.dev(kv)
    rmsnorm(dkv[:, :64], env.dev(w), 1e-6, dkv[:, :64])
    ref = kv.copy()
    rmsnorm_ref(ref[:, :64], w, 1e-6, ref[:, :64])
    assert_close("rmsnorm strided in place", env.host(dkv), ref, 1e-5)


def check_silu_mul(env, n, inter, seed=0):
    from numbaengine.kernels.act import silu_mul
    from numbaengine.reference import silu_mul_ref
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((n, 2 * inter)) * 3).astype(np.float32)
    out = poisoned(env, (n, inter), np.float32)
    silu_mul(env.dev(gu), out)
    assert_close(f"silu_mul n={n} I={inter}", env.host(out), silu_mul_ref(gu, np.empty((n, inter), np.float32)), 1e-6)


def check_rope(env, n, heads, nope, rope_dim, interleaved, seed=0):
    """Rope on the rope part of q (a strided view), in place, positions up to 200k."""
    from numbaengine.kernels.rope import rope
    from numbaengine.reference import rope_inv_freq, rope_ref
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, heads, nope + rope_dim)).astype(np.float32)
    pos = rng.integers(0, 200_000, n).astype(np.int32)
    inv, _ = rope_inv_freq(rope_dim, 50000.0)
    dq = env.dev(q)
    rope(dq[:, :, nope:], env.dev(pos), env.dev(inv), dq[:, :, nope:], interleaved=interleaved, attn_factor=1.25)
    ref = q.copy()
    rope_ref(ref[:, :, nope:], pos, inv, ref[:, :, nope:], interleaved=interleaved, attn_factor=1.25)
    assert_close(f"rope n={n} interleaved={interleaved}", env.host(dq), ref, 2e-5)


def check_qk_norm_rope(env, n, nq, nk, d, interleaved, seed=0):
    """Head norms + rope of the q|k heads of a stacked q|k|v row (a strided view); nq = 0: keys alone."""
    from numbaengine.kernels.rope import qk_norm_rope
    from numbaengine.reference import qk_norm_rope_ref, rope_inv_freq
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((n, nq + 2 * nk, d)) * 3).astype(np.float32)
    q_w, k_w = rand_bf16(rng, d), rand_bf16(rng, d)
    pos = rng.integers(0, 100_000, n).astype(np.int32)
    inv, _ = rope_inv_freq(d, 1e6)
    q_out = poisoned(env, (n, nq, d), np.float32) if nq else None
    k_out = poisoned(env, (n, nk, d), np.float32)
    dqkv = env.dev(qkv)
    qk_norm_rope(dqkv[:, :nq + nk], nq, env.dev(q_w), env.dev(k_w), 1e-6, env.dev(pos), env.dev(inv),
                 q_out, k_out, interleaved=interleaved)
    rq, rk = np.empty((n, nq, d), np.float32), np.empty((n, nk, d), np.float32)
    qk_norm_rope_ref(qkv[:, :nq + nk], nq, q_w, k_w, 1e-6, pos, inv, rq, rk, interleaved=interleaved)
    if nq:
        assert_close(f"qk_norm_rope q nq={nq}", env.host(q_out), rq, 2e-5)
    assert_close(f"qk_norm_rope k nq={nq} nk={nk}", env.host(k_out), rk, 2e-5)
    assert_close("qk_norm_rope leaves its input", env.host(dqkv), qkv, 0)


def check_argmax_topk(env, n, vocab, k, seed=0):
    from numbaengine.kernels.topk import argmax, topk
    from numbaengine.reference import argmax_ref, topk_ref
    rng = np.random.default_rng(seed)
    lg = rng.standard_normal((n, vocab)).astype(np.float32)
    lg[0, [3, vocab - 1]] = 50.0                         # exact tie: the lower index wins
    lg[-1, :] = 1.0                                      # a constant row
    out = poisoned(env, (n,), np.int32)
    argmax(env.dev(lg), out)
    np.testing.assert_array_equal(env.host(out), argmax_ref(lg, np.empty(n, np.int32)))
    ii, vv = poisoned(env, (n, k), np.int32), poisoned(env, (n, k), np.float32)
    topk(env.dev(lg), k, ii, vv)
    ri, rv = topk_ref(lg, k, np.empty((n, k), np.int32), np.empty((n, k), np.float32))
    np.testing.assert_array_equal(env.host(ii), ri)
    np.testing.assert_array_equal(env.host(vv), rv)


# -------------------------------------------------------------------------------------------------------- MoE
def make_experts(rng, n_exp, hidden, inter, int4=True):
    """Random experts: INT4 words with every nibble value (any int32 is a valid packing) and bf16 scales."""
    from numbaengine.reference import Experts
    if not int4:
        return Experts(rand_bf16(rng, n_exp, 2 * inter, hidden, scale=0.05),
                       rand_bf16(rng, n_exp, hidden, inter, scale=0.05))

    def words(*shape):
        return rng.integers(-2 ** 31, 2 ** 31, shape, dtype=np.int64).astype(np.int32)

    def scales(*shape):
        return f32_to_bf16((rng.random(shape) * 0.02 + 0.001).astype(np.float32))
    return Experts(words(n_exp, 2 * inter, hidden // 8), words(n_exp, hidden, inter // 8),
                   scales(n_exp, 2 * inter, hidden // 32), scales(n_exp, hidden, inter // 32), 32)


def routing(rng, n, n_exp, k, mode):
    """idx i32[n, k] (distinct per token), wts f32[n, k]. mode: random | one_hot (all tokens on expert 0 as their
    first choice) | skip (expert 1 never used)."""
    choices = np.arange(n_exp)
    if mode == "skip":
        choices = choices[choices != 1]
    idx = np.stack([rng.choice(choices, k, replace=False) for _ in range(n)]).astype(np.int32)
    if mode == "one_hot":
        for t in range(n):
            row = [0] + [e for e in idx[t] if e != 0]
            idx[t] = row[:k]
    return idx, rng.random((n, k)).astype(np.float32)


def check_moe(env, n, hidden, inter, n_exp, k, mode, int4=True, cfgs=None, seed=0, shared=False, held=None,
              warp_slots=None, tiled=0, exact=True):
    """held=(offset, count): this device holds experts offset.. of n_exp (expert parallelism); the others' slots
    add nothing. warp_slots: kernels.moe.PLAN_WARP_SLOTS for this check (0: the block plan at any size).
    tiled=R: gate_up in the bulk layout (cfgs: a bulk cut for gate_up, or None for the defaults); with exact the
    result must also equal, bit for bit, the register path's on the int4_tiles layout (gate_up's cut with S = 0)."""
    import dataclasses

    import numbaengine.kernels.moe as M
    from numbaengine.kernels.moe import device_experts, moe, moe_workspace
    from numbaengine.reference import moe_ref
    if warp_slots is not None:
        saved, M.PLAN_WARP_SLOTS = M.PLAN_WARP_SLOTS, warp_slots
        try:
            return check_moe(env, n, hidden, inter, n_exp, k, mode, int4, cfgs, seed, shared, held, None, tiled,
                             exact)
        finally:
            M.PLAN_WARP_SLOTS = saved
    rng = np.random.default_rng(seed)
    idx, wts = routing(rng, n, n_exp, k, mode)
    ex = make_experts(rng, n_exp, hidden, inter, int4)
    if held is not None:
        e0, count = held
        ex = dataclasses.replace(ex, **{f: getattr(ex, f)[e0:e0 + count] for f in
                                        ("gate_up", "down", "gate_up_scale", "down_scale")
                                        if getattr(ex, f) is not None}, offset=e0)
        n_exp = count
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    sh = rng.standard_normal((n, hidden)).astype(np.float32) if shared else None
    ws = moe_workspace(n + 3, k, hidden, inter, n_exp, lambda shape, dtype: poisoned(env, shape, dtype))
    out = poisoned(env, (n, hidden), np.float32)
    kw = dict(cfg_gate_up=cfgs[0], cfg_down=cfgs[1]) if cfgs else {}
    args = (env.dev(x), env.dev(idx), env.dev(wts))
    dex = device_experts(ex, env.dev, tiled=tiled)
    assert dex.tiled == tiled
    moe(*args, dex, out, ws, shared=None if sh is None else env.dev(sh), **kw)
    ref = moe_ref(x, idx, wts, ex, np.empty((n, hidden), np.float32))
    if sh is not None:
        ref += sh
    assert_close(f"moe n={n} {mode} int4={int4} tiled={tiled}", env.host(out), ref, 2e-2)
    if tiled and exact:
        rows = poisoned(env, (n, hidden), np.float32)
        gu, dn = M._cfgs(dex, *(cfgs or (None, None)))
        moe(*args, device_experts(ex, env.dev, tiled=0), rows, ws, shared=None if sh is None else env.dev(sh),
            cfg_gate_up=dataclasses.replace(gu, S=0), cfg_down=dn)
        got, want = env.host(out), env.host(rows)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"moe tiled={tiled}: not the register path's bits (max diff {np.max(np.abs(got - want))})"


def check_moe_stamps(env, n, hidden, inter, n_exp, k, cfgs, seed=0, tiled=0):
    """ExpertConfig.stamps (tools/moe_stamps.py): each expert stage stamped alone leaves its outputs' bits as the unstamped
    stage's, and every block of its grid records its units: the count it was dealt (units b, b + grid, ...), the
    points of its first STAMP_UNITS units in time order (differences mod 2^32), on one SM. A stamped stage without
    ws.stamps (or with the workspace's [1, 1] placeholder) is refused; tools.moe_stamps.timeline reads what was
    written. tiled=R: gate_up in the bulk layout."""
    import dataclasses
    import math

    import numbaengine.kernels.moe as M
    from tools.moe_stamps import timeline
    rng = np.random.default_rng(seed)
    idx, wts = routing(rng, n, n_exp, k, "random")
    dex = M.device_experts(make_experts(rng, n_exp, hidden, inter, True), env.dev, tiled=tiled)
    ws = M.moe_workspace(n, k, hidden, inter, n_exp, lambda shape, dtype: poisoned(env, shape, dtype))
    placeholder = ws.stamps                                      # what unstamped launches pass: [1, 1]
    assert placeholder.shape == (1, 1), placeholder.shape
    x, di, dw = (env.dev(a) for a in (rng.standard_normal((n, hidden)).astype(np.float32), idx, wts))
    items = int(sum(math.ceil(c / (8 * cfgs[0].T)) for c in np.unique(idx, return_counts=True)[1]))
    M.moe_plan(x, di, dex, ws, *cfgs)
    for down, cfg in enumerate(cfgs):
        target = ws.y if down else ws.act
        M.moe_stage(down, dex, dw, ws, cfg)
        env.sync()
        plain = env.host(target).copy()
        grid = min(n * k * math.ceil((hidden if down else 2 * inter) / 16 / (cfg.WR * cfg.R)),
                   M._sm_count() * cfg.blocks_per_sm)
        stamped = dataclasses.replace(cfg, stamps=True)
        for ws.stamps in (placeholder, None):                    # the workspace's [1, 1], or none: refused
            try:
                M.moe_stage(down, dex, dw, ws, stamped)
                raise AssertionError(f"moe_stage stamped into {ws.stamps}")
            except ValueError as e:
                assert "ExpertConfig.stamps needs ws.stamps" in str(e), e
        ws.stamps = env.zeros((grid, M.STAMP_WORDS), np.int32)
        M.moe_stage(down, dex, dw, ws, stamped)
        env.sync()
        got = env.host(target)
        assert np.array_equal(got.view(np.uint8), plain.view(np.uint8)), f"stage {down}: stamps changed the output"
        st = env.host(ws.stamps).astype(np.int64) & 0xFFFFFFFF
        units = items * math.ceil((hidden if down else 2 * inter) / 16 / (cfg.WR * cfg.R))
        want = [len(range(b, units, grid)) for b in range(grid)]
        assert st[:, 3].tolist() == want, f"stage {down}: units per block {st[:, 3].tolist()} want {want}"
        for b in range(grid):
            kept = min(want[b], M.STAMP_UNITS)
            ns = [st[b, 1]] + [st[b, 4 + 2 * p + 1] for p in range(3 * kept)]
            steps = [(q - p) % (1 << 32) for p, q in zip(ns, ns[1:])]
            assert all(d < 1 << 31 for d in steps), f"stage {down} block {b}: points out of order {ns}"
        summ = timeline(st, 1000, M.STAMP_UNITS)
        assert summ["units"] == units and summ["blocks"] == sum(w > 0 for w in want), summ
        assert summ["block end us"]["all_units"] == (max(want) <= M.STAMP_UNITS), summ
    ws.stamps = placeholder


def check_plan(env, n, n_exp, k, mode, held=None, warp_slots=32, seed=0):
    """The MoE routing plan alone (kernels.moe.moe_plan) against a NumPy plan, exactly: live slots (experts held
    here: held=(offset, count)) in expert order, stable inside an expert; then per expert in order, work items
    of <= cap slots. warp_slots: PLAN_WARP_SLOTS (routings of up to that many slots take the one-warp plan)."""
    import dataclasses

    import numbaengine.kernels.moe as M
    rng = np.random.default_rng(seed)
    idx, _ = routing(rng, n, n_exp, k, mode)
    e0, count = held if held is not None else (0, n_exp)
    ex = dataclasses.replace(make_experts(rng, count, 64, 64, True), offset=e0)
    ws = M.moe_workspace(n + 2, k, 64, 64, count, lambda shape, dtype: poisoned(env, shape, dtype))
    saved, M.PLAN_WARP_SLOTS = M.PLAN_WARP_SLOTS, warp_slots
    try:
        M.moe_plan(env.dev(rng.standard_normal((n, 64)).astype(np.float32)), env.dev(idx),
                   M.device_experts(ex, env.dev), ws)
    finally:
        M.PLAN_WARP_SLOTS = saved
    cap = 8 * M.GATE_UP_CFG.T
    local = idx.reshape(-1) - e0
    live = [i for i in np.argsort(local, kind="stable") if 0 <= local[i] < count]
    items = [(e, start + q, min(cap, c - q)) for e, start, c in
             [(e, sum(1 for i in live if local[i] < e), int(np.sum(local == e))) for e in range(count)]
             for q in range(0, c, cap)]
    got_n = int(env.host(ws.n_items)[0])
    assert got_n == len(items), f"plan: {got_n} items, want {len(items)}"
    assert env.host(ws.sorted_slot)[:len(live)].tolist() == live, "plan: slot order"
    got = list(zip(*(env.host(a)[:got_n].tolist() for a in (ws.item_e, ws.item_start, ws.item_len))))
    assert got == items, f"plan: items {got[:6]} want {items[:6]}"


def check_router(env, n, hidden, n_exp, k, n_group, topk_group, seed=0, tokens_per_pass=4, token_blocks=None,
                 k_slices=None, twins=False, mma=None, nan_row=False):
    """Router vs router_ref; a tie in the choice may pick a different expert only when the two choices are
    within float rounding of each other. token_blocks / k_slices: the logits' block rows / k slices (None: the
    default rules). twins: expert e + E/2 has expert e's gate row and bias (exact ties: the lower index must come
    first, the picks must equal the reference's exactly). mma="gemm": the logits from kernels.gemm.gemm (x as hi +
    lo); mma="ops": through the simulator's op table (from its dispatch.router_mma_from tokens the gate must go
    through its gemm, below it must not). nan_row: x[0] is NaN (a garbage row): its picks must still be distinct
    expert ids; the other rows as usual."""
    from numbaengine.kernels.gemm import GemmWorkspace, gemm, gemm_workspace_words
    from numbaengine.kernels.moe import ROUTER_XS, moe_workspace, router
    from numbaengine.reference import router_ref
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    wg = rand_bf16(rng, n_exp, hidden, scale=0.05)
    bias = (rng.standard_normal(n_exp) * 0.02).astype(np.float32)
    if twins:
        wg[n_exp // 2:], bias[n_exp // 2:] = wg[:n_exp // 2], bias[:n_exp // 2]
    if nan_row:
        x[0] = np.nan
    ws = moe_workspace(n, k, hidden, 64, n_exp, lambda shape, dtype: poisoned(env, shape, dtype))
    ii, ww = poisoned(env, (n, k), np.int32), poisoned(env, (n, k), np.float32)
    if mma == "ops":
        from numbaengine.ops_cuda import sim_ops
        ops, shapes = sim_ops(), []
        mma_from = ops.dispatch.router_mma_from
        table_gemm = ops.gemm
        ops.gemm = lambda xx, w, out, **kw: shapes.append(w.shape) or table_gemm(xx, w, out, **kw)  # noqa: E731
        ops.router(env.dev(x), env.dev(wg), env.dev(bias), k, n_group, topk_group, True, 2.827, ii, ww)
        want = [wg.shape] if n >= mma_from else []
        assert shapes == want, f"router at n={n} (mma from {mma_from}): ops.gemm saw {shapes}, not {want}"
    else:
        logits_gemm = None
        if mma == "gemm":
            nxb, npart = gemm_workspace_words(n, n_exp, hidden, ROUTER_XS)
            gws = GemmWorkspace(poisoned(env, (max(nxb, 1),), np.uint32),
                                poisoned(env, (max(npart, 1),), np.float32))
            logits_gemm = lambda xx, w, out: gemm(xx, w, out, gws, ROUTER_XS)  # noqa: E731
        router(env.dev(x), env.dev(wg), env.dev(bias), k, n_group, topk_group, True, 2.827, ii, ww, ws,
               tokens_per_pass, token_blocks, k_slices, logits_gemm)
    ri, rw = router_ref(x, wg, bias, k, n_group, topk_group, True, 2.827, np.empty((n, k), np.int32),
                        np.empty((n, k), np.float32))
    gi, gw = env.host(ii), env.host(ww)
    if nan_row:
        assert ((0 <= gi[0]) & (gi[0] < n_exp)).all() and len(set(gi[0])) == k, f"NaN row picked {gi[0]}"
        x, gi, gw, ri, rw, n = x[1:], gi[1:], gw[1:], ri[1:], rw[1:], n - 1
    if twins:
        np.testing.assert_array_equal(gi, ri, err_msg="router with exact ties (twin experts)")
    choice = 1 / (1 + np.exp(-(x @ bf16_to_f32(wg).T))) + bias                     # [n, E]
    for t in range(n):
        if (gi[t] != ri[t]).any():   # allowed only for a near-tie: the picked choice values agree
            np.testing.assert_allclose(np.sort(choice[t, gi[t]]), np.sort(choice[t, ri[t]]), rtol=0, atol=1e-5,
                                       err_msg=f"router token {t}: {gi[t]} vs reference {ri[t]}")
    same = (gi == ri).all(axis=1)
    assert_close("router weights", gw[same], rw[same], 1e-5)
