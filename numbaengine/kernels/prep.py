"""The B operand (activations) of the tensor-core GEMMs: f32 x -> bf16 words in the layout a GEMM reads. Row-major
[m, xs, k/2] (perm: INT4 column order), the mma fragments in warp order (tiled=1, kernels/gemm.py and moe.py), or the
wgmma GEMM's swizzled boxes per token block (tiled=3, kernels/gemm_wg.py)."""
import math

from numba import cuda, int32

from numbaengine.kernels.device import device, grid_dep, pack_bf16x2, split_bf16x2
from numbaengine.kernels.launch import cached, kernel, launch

RING_CHUNK = 128    # u32 words of one warp-wide 16-byte-per-lane chunk (a ring slot row, a tiled B fragment)

WG_NB_MAX = 64      # token rows per wgmma block (wgmma N) unless a WgConfig says otherwise (kernels/gemm_wg.py nb_max)


def token_blocks(m, nb_max=WG_NB_MAX):
    """(NB, ZB): token blocks of at most nb_max rows, NB a multiple of 8."""
    zb = -(-m // nb_max)
    per = -(-m // zb)
    return 8 * -(-per // 8), zb


def xb_words(m, k, nb_max=WG_NB_MAX):
    """u32 words of x in the tiled=3 layout of prep_b: ZB token blocks x k/64 boxes x NB rows x 32 words."""
    nb, zb = token_blocks(m, nb_max)
    return zb * nb * k // 2


def build_prep_unit(xs, perm, tiled, nb_max=WG_NB_MAX):
    @device
    def prep_unit(x, xb, m, kdim, row, blk):
        """Columns 8 blk .. 8 blk + 7 of row `row` of the B operand (see `build_prep`)."""
        if blk >= kdim // 8:
            return
        half = kdim // 2
        base, pstride = row * xs * half + blk * 4, half
        if tiled == 1:
            base = ((blk // 4 * ((m + 7) // 8) + row // 8) * xs) * RING_CHUNK + (4 * (row % 8) + blk % 4) * 4
            pstride = RING_CHUNK
        elif tiled == 3:       # wgmma B boxes (kernels/gemm_wg.py): [token block][k/64 box][NB rows][128 bytes],
            zb = (m + nb_max - 1) // nb_max          # chunk c of row r at chunk c ^ (r % 8) (128-byte swizzle)
            nb = ((m + zb - 1) // zb + 7) // 8 * 8
            z, r = row // nb, row % nb
            base = ((z * (kdim // 64) + blk // 8) * nb + r) * 32 + ((blk % 8) ^ (r % 8)) * 4
        if tiled:
            row = min(row, m - 1)
        k0 = blk * 8
        for q in range(4):
            if perm:
                e0, e1 = k0 + q, k0 + q + 4
            else:
                e0, e1 = k0 + 2 * q, k0 + 2 * q + 1
            v0, v1 = x[row, e0], x[row, e1]
            if xs == 2:
                hi, lo = split_bf16x2(v0, v1)
                xb[base + q] = hi
                xb[base + pstride + q] = lo
            else:
                xb[base + q] = pack_bf16x2(v0, v1)
    return prep_unit


def build_prep(xs, perm, tiled=0, nb_max=WG_NB_MAX):
    prep_unit = cached(build_prep_unit, xs, perm, tiled, nb_max)

    @kernel()
    def prep(x, xb, m, kdim):
        """x f32[m, k] (any strides) -> xb u32 flat [m, xs, k/2] (bf16 pairs; perm=1: INT4 column order), or
        (tiled=1) the mma B fragments in warp order: word ((s*ceil(m/8) + row//8)*xs + p)*128 + 4*lane + q with
        lane = 4*(row%8) + t holds part p of columns 32s + 8t + 2q, +1 (rows past m repeat row m-1), or
        (tiled=3, xs=1) kernels/gemm_wg.py's wgmma B boxes: token block z of NB rows, 64-column box b, row r:
        words ((z*k/64 + b)*NB + r)*32 + 4*(c ^ r%8) + q hold columns 64b + 8c + 2q, +1.
        Launch: grid (ceil(k/8/256), m, or the rows rounded up to 8 (tiled=1) or ZB*NB (3)), block
        256; moves m*k*4 bytes in, m*k*2*xs out."""
        grid_dep()
        prep_unit(x, xb, m, kdim, cuda.blockIdx.y, cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
    return prep


def prep_b(x, xb, xs, perm=0, tiled=0, nb_max=WG_NB_MAX):
    """x f32[m, k] -> xb (uint32 flat, >= m*xs*k/2 words; tiled=1: ceil(m/8)*8*xs*k/2, tiled=3:
    xb_words): the B operand of the mma GEMMs (tiled=3: of the wgmma GEMM, token blocks of <= nb_max rows)."""
    m, k = x.shape
    if tiled == 3 and (xs != 1 or perm):
        raise ValueError(f"prep_b: the tiled={tiled} layout is for bf16 activations in natural column order")
    if tiled == 3:
        nb, zb = token_blocks(m, nb_max)
        rows = nb * zb
    else:
        rows = math.ceil(m / 8) * 8 if tiled else m
    launch(cached(build_prep, xs, perm, tiled, nb_max), (math.ceil(k / 8 / 256), rows), 256, x, xb, int32(m),
           int32(k))
