"""The kernel op table: the model's named ops on the numba.cuda kernels of kernels/.

One class serves two backends that differ only in where arrays live:
  sim   NumPy arrays; the kernels run on numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 set before numba is
        imported). CPU CI checks the kernel backend end to end with it.
  cuda  CuPy arrays on the current device; every launch goes to CuPy's current stream (kernels.launch.launch).
Every op keeps the reference op's signature (backends.NUMPY) and writes into the caller's output. Scratch, both the
kernels' (GEMM B operand and k-split partials, MoE routing plan and per-slot outputs, router logits) and the model's
intermediates (`scratch`), is a view of one flat buffer per role, grown to the largest request and then reused: a
forward whose shapes were seen before allocates only the logits/hidden it returns and the small per-call inputs it
uploads (tokens, positions, visibility). The simulator poisons scratch (NaN / -1) on every request; the cuda
table does too with NUMBAENGINE_POISON=1 in the environment (a debugging mode: finds kernels that read what they did
not write; every scratch request then costs a fill launch).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from numba import cuda, int32, uint16, uint32

from numbaengine import env
from numbaengine.kernels.act import silu_mul
from numbaengine.kernels.attention import attention, kv_attention, kv_attention_work
from numbaengine.kernels.device import F0, SIM, bf16_f32, grid_dep, pack_bf16x2
from numbaengine.kernels.gemm import (
    TILES_MAX,
    GemmWorkspace,
    gemm,
    gemm_config,
    gemm_sync_words,
    gemm_workspace_words,
    head_gemm,
    head_gemm_workspace_words,
)
from numbaengine.kernels.gemm_wg import WG_GEMM_DEFAULT
from numbaengine.kernels.launch import contiguous, kernel, launch
from numbaengine.kernels.mla import MLA_DEFAULT, mla_attention, mla_work
from numbaengine.kernels.moe import (
    MAX_SLOTS,
    MOE_DEFAULT,
    ROUTER_XS,
    device_experts,
    moe_combine,
    moe_dims,
    moe_experts,
    moe_workspace,
    router,
    router_slices,
    stage_cuts,
)
from numbaengine.kernels.norm import add_rmsnorm, rmsnorm
from numbaengine.kernels.rope import qk_norm_rope, rope
from numbaengine.kernels.sample import sample
from numbaengine.reference import Experts, InOrder, all_gather_cols, visibility_ref

GEMM_ROWS = 8 * TILES_MAX    # token rows of one GEMM block; taller x runs as several row blocks of one launch
TALL_PART_BYTES = 64 << 20   # k-split partials a tall GEMM may use (else a launch per row block, partials reused)


@dataclass(frozen=True)
class DispatchConfig:
    """The op table's shape rules: which path a call takes by its shapes (one MLA split or several, flash-decoding
    splits of the drafter's attention, the router's logits GEMM). The defaults are what the engine runs, each with the
    measurement behind it. The op table holds one (KernelOps.dispatch); tools and tests pass others."""
    mla_one_split: int = 512     # caches up to this many rows run one split per sequence (no merge pass); not measured
    mla_split_rows: int = 256    # more query rows per sequence (a prompt) fill the GPU with row tiles: no split
    #                              scratch; not measured
    kv_min_split: int = 128      # drafter attention: fewest keys per split; capacities up to this run one split. H200,
    #                              pair drafter, 16 queries (python -m tools.bench_attention --only splits): one split
    #                              costs ~2 us per 32 keys (15 us at 128 keys, 70 at 1024); 128-key splits + merge
    #                              19-20 us at capacity 1024 and 23-31 us at 4096, against 18-24 and 34-63 us with
    #                              splits of 32 keys (2 blocks per SM)
    router_mma_from: int = 4     # router logits on the mma GEMM from this many tokens, the k-sliced GEMV below. H200,
    #                              K2 gate 384 x 7168 from HBM, us per call (python -m tools.bench_kernels --only moe):
    #                              GEMV / mma at n = 1 14.2 / 16.7 (9.0 / 7.7% of copy), n = 4 19.1 / 16.7, n = 17
    #                              44.7 / 21.8 (2.9 / 5.9%), n = 65 123.8 / 30.0 (1.0 / 4.3%); n = 2, 3 not measured


DISPATCH_DEFAULT = DispatchConfig()


# ----------------------------------------------------------------------------------------------- glue kernels
@kernel()
def _bf16_rows_k(src, idx, gather, out, d):
    """out f32[n, d] = rows of src u16[*, d] as float32: row idx[i] (gather: embedding lookup) or row i (cache
    read). Launch: grid (n, ceil(d / block)), block <= 256. Moves n*d*6 bytes."""
    grid_dep()
    i = cuda.blockIdx.x
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if j < d:
        row = idx[i] if gather else i
        out[i, j] = bf16_f32(src[row, j])


@kernel()
def _write_rows_k(src, dst, start, count, has_count, bf16, d):
    """Row i of block b of src f32[B*T, d] -> dst[b, start[b] + i] (bf16 bits, round to nearest even, when bf16;
    else float32) for i < count[b] (every row when not has_count). dst u16/f32[B, cap, d]. Launch: grid (B*T,
    ceil(d / block)), block <= 256. Moves B*T*d*(4 + 2 or 4) bytes."""
    grid_dep()
    r = cuda.blockIdx.x
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    T = src.shape[0] // dst.shape[0]
    b, i = r // T, r % T
    if j < d and (not has_count or i < count[b]):
        if bf16:
            dst[b, start[b] + i, j] = uint16(pack_bf16x2(src[r, j], F0) & uint32(0xFFFF))
        else:
            dst[b, start[b] + i, j] = src[r, j]


@kernel()
def _block_inputs_k(bonus, lengths, mask_id, tokens, positions, kv_len):
    """Drafter block inputs of sequence b (one block of Lb threads): tokens i32[B, Lb] = [bonus[b], mask_id...],
    positions i32[B*Lb] = lengths[b] + j, kv_len[b] = lengths[b] + Lb (context plus the block). Launch: grid B,
    block >= Lb. Moves B*(2*Lb + 1)*4 bytes out."""
    grid_dep()
    b, j = cuda.blockIdx.x, cuda.threadIdx.x
    Lb = tokens.shape[1]
    if j < Lb:
        tokens[b, j] = bonus[b] if j == 0 else mask_id
        positions[b * Lb + j] = lengths[b] + j
    if j == 0:
        kv_len[b] = lengths[b] + Lb


def _rows_launch(n, d):
    """(grid, block) of the row kernels: a block covers up to 256 columns of one row, rounded up to a warp."""
    block = min(256, 32 * math.ceil(d / 32))
    return (n, math.ceil(d / block)), block


def pack_mask(mask):
    """Visibility among the new tokens bool[T, T] -> u32[T, ceil(T/32)] (bit j of word w: sees token 32w + j),
    the layout kernels.mla.mla_attention reads."""
    T = len(mask)
    bits = np.zeros((T, 32 * -(-T // 32)), np.uint8)
    bits[:, :T] = np.asarray(mask, bool)
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


@dataclass
class LatentVis:
    """What the absorbed MLA kernel needs to know about one forward: committed rows, new rows, and the packed
    tree mask (None: causal), as device arrays (the shape of kernels.mla.mla_attention's batch of one)."""
    lengths: object          # i32[1]
    ntok: object             # i32[1]
    mask: object             # u32[1, T, W] or None


# --------------------------------------------------------------------------------------------------- the table
class KernelOps:
    """Op table over the numba.cuda kernels. `xp` is numpy (simulator) or cupy (GPU)."""
    cache_dtypes = ("bf16",)     # the MLA kernel reads a bf16 latent cache
    max_shards = 1               # one shard per table: several devices are several ranks (numbaengine/devices.py)
    prefill_form = "absorbed"    # causal MLA kernel over the latent rows, no per-head K/V of the prompt in memory.
                                 # H200: attention alone 1.47 vs 22.5 ms naive (1024 tokens, 64 heads; bench_attention
                                 # --only prefill); whole eager prompt forward, 1024 tokens (bench.py --prefill 1024):
                                 # pair naive 59.2 ms vs absorbed 26.9 ms (0.03% of its byte floor: launch-bound),
                                 # K2.6 x 2 layers 144 vs 111 ms (2.6% of its floor)

    def __init__(self, name, xp, poison=False, trim_warps=False, comm=None, mla=MLA_DEFAULT, gemm_wg=WG_GEMM_DEFAULT,
                 dispatch=DISPATCH_DEFAULT, moe_cfg=MOE_DEFAULT):
        self.name, self.xp, self.poison, self.trim_warps = name, xp, poison, trim_warps
        self.mla = mla               # absorbed MLA's kernel choices (kernels.mla.MlaConfig)
        self.gemm_wg = gemm_wg       # the wgmma GEMM's choices (kernels.gemm_wg.WgConfig)
        self.dispatch = dispatch     # this table's shape rules (DispatchConfig)
        self.moe_cfg = moe_cfg       # the routed experts' layout `upload` makes (kernels.moe.MoeConfig)
        self.comm = comm         # this rank's collectives (devices.NcclComm / ThreadComm) or None: one device
        self._flat = {}          # (role, dtype) -> flat buffer grown to the largest request
        self._moe_ws = {}        # (top_k, H, I, E) -> MoeWorkspace grown by n_max
        self._work = {}          # flash-decoding scratch per attention shape
        self._gemm_sync = {}     # "gemm" / "gemm.side" (in a branch) -> u32 k-split counters of the fused GEMM
        #                          reduce (zero between calls)
        self.branches = xp is not np   # False: branch() runs in order (tools/profile_round.py times one launch at
        self._side = None              # a time); the second stream and its fork/join events, made on first use

    def fresh(self) -> KernelOps:
        """A table over the same device with its own scratch (a captured graph owns the buffers it points at)."""
        table = KernelOps(self.name, self.xp, self.poison, self.trim_warps, self.comm, self.mla, self.gemm_wg,
                          self.dispatch, self.moe_cfg)
        table.branches = self.branches
        return table

    # -- arrays --------------------------------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """A backend array of host (or backend) data; no copy when it already is one of that dtype."""
        return self.xp.asarray(a, dtype)

    def to_host(self, a):
        return np.asarray(a) if self.xp is np else self.xp.asnumpy(a)

    def empty(self, shape, dtype=np.float32):
        return self.xp.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype)

    def scratch(self, role, shape, dtype=np.float32):
        """A reused buffer for one role: a view of a flat array grown to the largest size asked for. Two buffers
        live at once must have different roles."""
        n = math.prod(shape)
        key = (role, np.dtype(dtype).str)
        buf = self._flat.get(key)
        if buf is None or buf.size < n:
            buf = self._flat[key] = self.xp.empty(max(n, 1), dtype)
        view = buf[:n].reshape(shape)
        if self.poison:
            view.fill(_poison(dtype))
        return view

    @staticmethod
    def copy(src, dst):
        """dst[...] = src (broadcasting)."""
        dst[...] = src
        return dst

    def upload(self, weights):
        """Checkpoint records -> the same records on the device: contiguous arrays (transposed views such as
        w_uk become copies), routed experts as kernels.moe.DeviceExperts (INT4 words in the int4_tiles layout, gate_up
        in the bulk layout where it fits, made on the device)."""
        if isinstance(weights, np.ndarray):
            return self.asarray(np.ascontiguousarray(weights))
        if isinstance(weights, Experts):
            return device_experts(weights, lambda a: self.asarray(np.ascontiguousarray(a)), xp=self.xp,
                                  cfg=self.moe_cfg)
        if isinstance(weights, list):
            return [self.upload(w) for w in weights]
        if dataclasses.is_dataclass(weights):
            return dataclasses.replace(weights, **{f.name: self.upload(getattr(weights, f.name))
                                                   for f in dataclasses.fields(weights)})
        return weights

    # -- glue: embedding, latent cache, visibility, all-reduce -----------------------------------------------------
    def embed(self, table, tokens, out):
        """tokens i32[n] -> out f32[n, H] = bf16 rows of table u16[V, H]."""
        grid, block = _rows_launch(*out.shape)
        launch(_bf16_rows_k, grid, block, table, tokens, True, out, int32(out.shape[1]))
        return out

    def cache_write(self, rows, visible, latent):
        """Latent rows f32[T, D] of the new tokens -> bf16 cache rows where `visible` (from visibility) puts them:
        start.. for one sequence (naive: start = S - T), lengths[b].. for block b of a batch (LatentVis)."""
        if isinstance(visible, LatentVis):
            B = len(visible.lengths)
            return self.write_rows(latent, rows.reshape(B, -1, rows.shape[-1]), visible.lengths, visible.ntok)
        start = visible.shape[1] - len(latent)
        return self.write_rows(latent, rows[None, start:start + len(latent)], self._zero_start(), None)

    @staticmethod
    def block_inputs(bonus, lengths, mask_id, tokens, positions, kv_len):
        """The drafter's block per sequence from device state (see _block_inputs_k)."""
        launch(_block_inputs_k, tokens.shape[0], 32 * -(-tokens.shape[1] // 32), bonus, lengths, int32(mask_id),
               tokens, positions, kv_len)

    def write_rows(self, src, dst, start, count=None):
        """Scatter rows of blocks: row i of block b of src f32[B*T, ...] -> dst[b, start[b] + i] for i < count[b]
        (all T rows when count is None); dst u16 (rounded to bf16) or f32 [B, cap, ...]; start, count i32[B] on
        the device (a captured round's cache and drafter-context appends)."""
        B, cap = dst.shape[:2]
        d = math.prod(dst.shape[2:])
        grid, block = _rows_launch(src.shape[0], d)
        launch(_write_rows_k, grid, block, src.reshape(-1, d), dst.reshape(B, cap, d), start,
               start if count is None else count, count is not None, dst.dtype == np.uint16, int32(d))
        return dst

    def cache_read(self, rows, end, out):
        """Cache rows [0, end) -> out f32[end, D]."""
        grid, block = _rows_launch(end, out.shape[1])
        launch(_bf16_rows_k, grid, block, rows, self._placeholder_idx(), False, out, int32(out.shape[1]))
        return out

    def visibility(self, start, T, tree_mask, form):
        """naive: bool[T, start+T] for `attention`; absorbed: LatentVis for `latent_attention`."""
        if form == "naive":
            return self.asarray(visibility_ref(start, T, tree_mask))
        mask = None if tree_mask is None else self.asarray(pack_mask(tree_mask)[None])
        return LatentVis(self.asarray(np.array([start], np.int32)), self.asarray(np.array([T], np.int32)), mask)

    def all_reduce(self, parts):
        """This rank's partial result (one shard per table) summed over the ranks in place (NCCL on cuda)."""
        if len(parts) != 1:
            raise ValueError(f"all_reduce: a kernel table holds one shard, got {len(parts)} partial results")
        return parts[0] if self.comm is None else self.comm.all_reduce(parts[0])

    def all_gather(self, part, out):
        """Every rank's part f32[m, v] side by side -> out f32[m, ranks * v] (vocabulary-parallel lm_head)."""
        return all_gather_cols(self.comm, part, out, self.scratch("gather", (self.comm.size,) + part.shape))

    # -- math ops (reference signatures) -------------------------------------------------------------------------
    rmsnorm = staticmethod(rmsnorm)
    add_rmsnorm = staticmethod(add_rmsnorm)
    rope = staticmethod(rope)
    qk_norm_rope = staticmethod(qk_norm_rope)
    silu_mul = staticmethod(silu_mul)

    def gemm(self, x, w, out, xs=None):
        """out f32[m, n] = x f32[m, k] @ bf16(w u16[n, k])^T (mma GEMM; k % 32 == 0; xs: the activations as bf16 or
        as hi + lo parts, None: the cut's choice, kernels.gemm). x taller than GEMM_ROWS (a
        batch of trees, a prompt) is one launch over blocks of GEMM_ROWS rows (each block reads the weights again:
        from L2 when they fit) when x is contiguous and the k-split partials stay under TALL_PART_BYTES; else a
        launch per block. GEMMs issued inside ops.branch() use scratch and k-split counters of their own: they may
        run at the same time as the GEMMs of the current stream."""
        (m, k), n = x.shape, w.shape[0]
        if self.trim_warps:      # simulator time: few k-pieces, no warps without rows
            cfg = gemm_config(m, n, k, target_warps=64, wg=self.gemm_wg)
            cfg = dataclasses.replace(cfg, WR=max(1, min(cfg.WR, math.ceil(n / 16 / cfg.R))))
        else:
            cfg = gemm_config(m, n, k, wg=self.gemm_wg)
        if m > GEMM_ROWS:
            if not (contiguous(x) and (cfg.SB == 1 or 4 * cfg.SB * m * n <= TALL_PART_BYTES)):
                for r in range(0, m, GEMM_ROWS):
                    self.gemm(x[r:r + GEMM_ROWS], w, out[r:r + GEMM_ROWS], xs)
                return out
            cfg = dataclasses.replace(cfg, BF=1, FR=0, S=0)
        nxb, npart = gemm_workspace_words(m, n, k, xs, cfg, self.gemm_wg)
        nsync = gemm_sync_words(m, n, k, cfg, xs)
        role = "gemm.side" if self._on_side() else "gemm"
        sync = self._gemm_sync.get(role)
        if sync is None or sync.size < nsync:    # never poisoned: every call leaves it zero
            sync = self._gemm_sync[role] = self.xp.zeros(max(nsync, 1024), np.uint32)
        ws = GemmWorkspace(self.scratch(f"{role}.xb", (max(nxb, 1),), np.uint32),
                           self.scratch(f"{role}.part", (max(npart, 1),), np.float32), sync)
        return gemm(x, w, out, ws, xs, cfg, self.gemm_wg)

    def head_gemm(self, x, w, out):
        """Per head: out[:, h] = x[:, h] @ bf16(w[h])^T; x f32[n, h, a], w u16[h, b, a] -> out f32[n, h, b], one
        launch (x and out may be strided views such as q[:, :, :nope])."""
        nxb, npart = head_gemm_workspace_words(x.shape[0], *w.shape)
        ws = GemmWorkspace(self.scratch("gemm.xb", (max(nxb, 1),), np.uint32),
                           self.scratch("gemm.part", (max(npart, 1),), np.float32))
        return head_gemm(x, w, out, ws)

    @staticmethod
    def attention(q, k, v, visible, scale, out):
        return attention(q, k, v, visible, scale, out)

    def latent_attention(self, q, rows, visible: LatentVis, scale, out):
        """Absorbed MLA over the bf16 latent cache for B = len(visible.lengths) blocks of query rows: q f32[B*T, h, D]
        ([q_lat | q_pe]), rows u16[(B,) cap, D] -> out f32[B*T, h, r]. On the GPU long caches are split across
        blocks (flash-decoding scratch made once per shape); the simulator runs one split per sequence."""
        B, (n, h, D), r = len(visible.lengths), q.shape, out.shape[-1]
        cache = rows.reshape(B, -1, D)
        work, rule = None, self.dispatch
        if self.xp is not np and cache.shape[1] > rule.mla_one_split and n // B <= rule.mla_split_rows:
            key = ("mla", B, n // B, h, r, cache.shape[1], D)
            if key not in self._work:
                self._work[key] = mla_work(self.zeros, B, n // B, h, r, cache.shape[1], D=D, cfg=self.mla)
            work = self._work[key]
        mla_attention(q.reshape(B, n // B, h, D), cache, visible.lengths, visible.ntok, visible.mask, scale,
                      out.reshape(B, n // B, h, r), work, cfg=self.mla)
        return out

    def kv_attention(self, q, k, v, kv_len, scale, out):
        """kv_attention_ref on the kernels: q f32[B, n, h, d] over k/v f32[B, cap, hk, d] rows [0, kv_len[b])."""
        B, n, h, _ = q.shape
        work, min_split = None, self.dispatch.kv_min_split
        if self.xp is not np and k.shape[1] > min_split:
            key = ("kv", B, n, h, v.shape[-1], k.shape[1])
            if key not in self._work:
                self._work[key] = kv_attention_work(self.zeros, B, n, h, v.shape[-1], k.shape[1], min_split=min_split)
            work = self._work[key]
        return kv_attention(q, k, v, kv_len, scale, out, work)

    def router(self, x, w_gate, bias, top_k, n_group, topk_group, norm_topk, scaling, idx_out, w_out):
        """kernels.moe.router; from dispatch.router_mma_from tokens (a shape, fixed per captured graph) the logits come
        from this table's mma GEMM (x as bf16 hi + lo parts: ROUTER_XS), below from the CUDA-core GEMV in k slices."""
        n = x.shape[0]
        mma = n >= self.dispatch.router_mma_from
        shape = (1 if mma else router_slices(x.shape[1]), n, w_gate.shape[0])
        ws = SimpleNamespace(logits=self.scratch("router.logits", shape), n_max=n)
        return router(x, w_gate, bias, top_k, n_group, topk_group, norm_topk, scaling, idx_out, w_out, ws,
                      logits_gemm=functools.partial(self.gemm, xs=ROUTER_XS) if mma else None)

    def branch(self):
        """`with ops.branch() as side:` issues its ops on a second stream that starts after what the current
        stream holds; they overlap with the ops issued next on the current stream until side.join() (in a captured
        round: a parallel branch of the graph, so independent chains of short launches stop adding up)."""
        if not self.branches:
            return InOrder()
        if self._side is None:     # first use is in an eager round or a prompt forward, never inside a capture
            cp = self.xp.cuda
            self._side = (cp.Stream(non_blocking=True), cp.Event(disable_timing=True), cp.Event(disable_timing=True))
        return Branch(*self._side)

    def _on_side(self):
        """True while ops are issued inside ops.branch() (the current stream is this table's side stream)."""
        return self._side is not None and self.xp.cuda.get_current_stream().ptr == self._side[0].ptr

    def moe(self, x, idx, wts, experts, out, shared=None, after=None):
        """Routed experts (+ shared[t] when given) -> out f32[n, H], in blocks of tokens the routing plan holds.
        after: the branch computing `shared`, joined just before the combine that reads it."""
        n, top_k = idx.shape
        rows = MAX_SLOTS // top_k
        if n > rows:
            for r in range(0, n, rows):
                c = slice(r, r + rows)
                self.moe(x[c], idx[c], wts[c], experts, out[c], None if shared is None else shared[c], after)
            return out
        _, n_exp, _, inter = moe_dims(experts)
        key = (top_k, x.shape[1], inter, n_exp)
        ws = self._moe_ws.get(key)
        if ws is None or ws.n_max < n:
            ws = self._moe_ws[key] = moe_workspace(n, top_k, x.shape[1], inter, n_exp, self._alloc)
        cuts = stage_cuts(experts, n, top_k, self.moe_cfg)      # token tiles by n (a shape fixed per graph)
        moe_experts(x, idx, wts, experts, ws, *cuts)            # kernels.moe.moe, with the join before the combine
        if after is not None:
            after.join()
        moe_combine(out, shared, ws, idx, experts)
        return out

    def sample(self, logits, temperature, seed, seq, pos, out):
        """sample_ref; host seq/pos are uploaded, a host `out` is filled from the device (one sync)."""
        seq, pos = self.asarray(seq, np.int32), self.asarray(pos, np.int32)
        if self.xp is np or not isinstance(out, np.ndarray):
            return sample(logits, temperature, seed, seq, pos, out)
        dev = self.scratch("sample.out", out.shape, np.int32)
        sample(logits, temperature, seed, seq, pos, dev)
        out[:] = self.to_host(dev)
        return out

    # -- helpers -------------------------------------------------------------------------------------------------
    def _alloc(self, shape, dtype):
        a = self.xp.empty(shape, dtype)
        a.fill(_poison(dtype) if self.poison else 0)
        return a

    def _placeholder_idx(self):
        return self.scratch("placeholder.idx", (1,), np.int32)

    def _zero_start(self):
        if "zero" not in self._work:
            self._work["zero"] = self.zeros(1, np.int32)
        return self._work["zero"]


class Branch:
    """A fork of the current stream onto `side` (event `fork`) and, at join(), the current stream waiting for
    everything issued on `side` (event `done`). Events are reused: a wait binds to the latest record, and with one
    side stream per table a join also covers every branch opened before it."""

    def __init__(self, side, fork, done):
        self.side, self.fork, self.done = side, fork, done

    def __enter__(self):
        import cupy
        self.main = cupy.cuda.get_current_stream()
        self.fork.record(self.main)
        self.side.wait_event(self.fork)
        self.side.__enter__()
        return self

    def __exit__(self, *exc):
        self.side.__exit__(*exc)
        self.done.record(self.side)
        return False

    def join(self):
        self.main.wait_event(self.done)


def _poison(dtype):
    dtype = np.dtype(dtype)
    return np.nan if dtype.kind == "f" else (-1 if dtype.kind == "i" else np.iinfo(dtype).max)


# ---------------------------------------------------------------------------------------------------- builders
def simulator_loaded() -> bool:
    """True when numba.cuda is the CUDA simulator and kernels/ were built for it."""
    return SIM and cuda.jit.__module__.startswith("numba.cuda.simulator")


def sim_ops(comm=None) -> KernelOps:
    """The kernel table on the CUDA simulator (NumPy arrays, poisoned scratch)."""
    if not simulator_loaded():
        raise ValueError("backend 'sim' needs NUMBA_ENABLE_CUDASIM=1 in the environment before numba is imported "
                         "(e.g. NUMBA_ENABLE_CUDASIM=1 python -m numbaengine.run ...)")
    return KernelOps("sim", np, poison=True, trim_warps=True, comm=comm)


def cuda_ops(comm=None) -> KernelOps:
    """The kernel table on the current CuPy device (comm: this rank's NCCL communicator when several)."""
    if SIM:
        raise ValueError("backend 'cuda' cannot run with NUMBA_ENABLE_CUDASIM=1 (use backend 'sim')")
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"backend 'cuda' needs CuPy (pip install 'numbaengine[cuda]'): {e}") from None
    if not cuda.is_available():
        raise ValueError("backend 'cuda': numba finds no usable GPU")
    return KernelOps("cuda", cupy, poison=env.poison(), comm=comm)
