"""INT4 weights in compressed-tensors `pack-quantized` format (W4A16, symmetric, per-group bf16 scales).

Byte layout, for a linear weight W [N out, K in]:
  weight_packed int32 [N, K/8]: q in [-8, 7] stored as the nibble u = q + 8; word w of row n holds input
      columns 8w..8w+7, column 8w+j in bits 4j..4j+3 (column 8w in the lowest nibble). On a little-endian
      host byte b of a row holds columns 2b (low nibble) and 2b+1 (high nibble).
  weight_scale  bf16  [N, K/group]: W[n, k] = (u - 8) * scale[n, k // group]. No zero points.
Quantization matches compressed-tensors (calculate_qparams + _quantize, symmetric int): per group
scale = max|w| / 7.5 (range [-8, 7], (qmax - qmin) / 2 = 7.5), rounded to bf16 (a zero scale becomes bf16 eps
2**-7), then q = clamp(round_half_even(w / scale), -8, 7) using that bf16 scale, so dequant(quant(w)) is exactly
what a reader of the file computes.
"""
from __future__ import annotations

import numpy as np

from .dtypes import BF16_EPS, bf16_to_f32, f32_to_bf16

QMIN, QMAX = -8, 7
HALF_RANGE = (QMAX - QMIN) / 2     # 7.5


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q int8 [N, K] in [-8, 7] -> int32 [N, K/8]."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"pack_int4: K={k} is not a multiple of 8")
    u = (np.asarray(q, dtype=np.int16) + 8).astype(np.uint8)     # [N, K] nibbles
    packed = u[:, 0::2] | (u[:, 1::2] << 4)                      # [N, K/2] bytes
    return np.ascontiguousarray(packed).view("<i4").astype(np.int32, copy=False)


def unpack_int4(packed: np.ndarray, k: int) -> np.ndarray:
    """int32 [N, K/8] -> q int8 [N, K]."""
    n, words = packed.shape
    if words * 8 != k:
        raise ValueError(f"unpack_int4: {words} words per row hold {words * 8} values, not K={k}")
    b = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8)  # [N, K/2]
    u = np.empty((n, k), dtype=np.int8)
    u[:, 0::2] = b & 0xF
    u[:, 1::2] = b >> 4
    return u - np.int8(8)


def int4_scales(w: np.ndarray, group: int) -> np.ndarray:
    """w f32 [N, K] -> bf16 scales u16 [N, K/group] = bf16(max|w| / 7.5), zeros replaced by bf16 eps."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4: K={k} is not a multiple of the group size {group}")
    amax = np.abs(w.reshape(n, k // group, group)).max(axis=-1)       # [N, K/g] f32
    scale = f32_to_bf16(amax / np.float32(HALF_RANGE))
    scale[scale == 0] = BF16_EPS
    return scale


def quantize_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [N, K] -> (packed int32 [N, K/8], scale u16 bf16 [N, K/group])."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    scale = int4_scales(w, group)
    s = bf16_to_f32(scale)[:, :, None]                                  # [N, K/g, 1] f32
    q = np.clip(np.round(w.reshape(n, k // group, group) / s), QMIN, QMAX)
    return pack_int4(q.astype(np.int8).reshape(n, k)), scale


def dequant_int4(packed: np.ndarray, scale_u16: np.ndarray, group: int) -> np.ndarray:
    """(packed int32 [N, K/8], scale u16 [N, K/group]) -> f32 [N, K]."""
    n, words = packed.shape
    k = words * 8
    if scale_u16.shape != (n, k // group) or k % group:
        raise ValueError(f"dequant_int4: scale shape {scale_u16.shape} does not fit packed {packed.shape} "
                         f"with group {group} (expected {(n, k // group)})")
    q = unpack_int4(packed, k).reshape(n, k // group, group).astype(np.float32)
    return (q * bf16_to_f32(scale_u16)[:, :, None]).reshape(n, k)
