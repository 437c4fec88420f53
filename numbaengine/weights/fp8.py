"""FP8 block-quantized weights (DeepSeek-V3 / Kimi-K2-Instruct style).

Byte layout, for a linear weight W [N out, K in]:
  weight           float8_e4m3fn codes, uint8 [N, K]
  weight_scale_inv float32 [ceil(N/128), ceil(K/128)]: W[r, c] = e4m3(weight[r, c]) * scale_inv[r // 128, c // 128]
Edge blocks are partial (N or K need not be multiples of 128).
"""
from __future__ import annotations

import numpy as np

from .dtypes import E4M3_MAX, e4m3_to_f32, f32_to_e4m3

BLOCK = 128


def scale_shape(n: int, k: int, block: int = BLOCK) -> tuple[int, int]:
    return (-(-n // block), -(-k // block))


def _expand(scale: np.ndarray, n: int, k: int, block: int) -> np.ndarray:
    """[ceil(N/b), ceil(K/b)] -> [N, K], each block scale repeated over its (possibly partial) block."""
    return np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:n, :k]


def dequant_fp8_block(w_u8: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """(codes u8 [N, K], scale_inv f32 [ceil(N/b), ceil(K/b)]) -> f32 [N, K]."""
    n, k = w_u8.shape
    if scale_inv.shape != scale_shape(n, k, block):
        raise ValueError(f"dequant_fp8_block: scale_inv shape {scale_inv.shape} does not fit weight {w_u8.shape} "
                         f"(expected {scale_shape(n, k, block)})")
    return e4m3_to_f32(w_u8) * _expand(scale_inv.astype(np.float32), n, k, block)


def quantize_fp8_block(w: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [N, K] -> (codes u8 [N, K], scale_inv f32 blocks) with scale_inv = max|w| / 448 per block
    (1 for an all-zero block); codes = e4m3(w / scale_inv), round-to-nearest-even."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    sn, sk = scale_shape(n, k, block)
    padded = np.zeros((sn * block, sk * block), np.float32)
    padded[:n, :k] = np.abs(w)
    amax = padded.reshape(sn, block, sk, block).max(axis=(1, 3))         # [sn, sk] f32
    scale_inv = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    return f32_to_e4m3(w / _expand(scale_inv, n, k, block)), scale_inv
