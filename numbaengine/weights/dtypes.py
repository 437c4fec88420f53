"""Bit-exact conversions for the two storage dtypes NumPy lacks: bfloat16 and float8 e4m3fn.

bf16 is kept as uint16 bit patterns (the top 16 bits of an IEEE float32); e4m3fn as uint8 codes
(1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits; no infinities; 0x7F/0xFF are NaN; max 448).
"""
from __future__ import annotations

import numpy as np

BF16_EPS = np.uint16(0x3C00)   # 2**-7, torch.finfo(torch.bfloat16).eps
E4M3_MAX = 448.0


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float32 (exact: append 16 zero bits)."""
    u16 = np.asarray(u16, dtype=np.uint16)
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round-to-nearest-even; NaN stays (quiet) NaN, overflow -> inf."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u32 = f.view(np.uint32)
    r = u32 >> 16
    r &= 1                       # lsb of the kept part: ties go to even
    r += 0x7FFF
    r += u32
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((u32[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn code 0..255."""
    code = np.arange(256, dtype=np.int64)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    vals = sign * mag
    vals[(code & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


E4M3_TABLE = _e4m3_table()            # [256] f32
_E4M3_POS = E4M3_TABLE[:0x7F]        # [127] f32, codes 0x00..0x7E, increasing


def e4m3_to_f32(u8: np.ndarray) -> np.ndarray:
    """e4m3fn codes -> float32 (table lookup)."""
    return E4M3_TABLE[np.asarray(u8, dtype=np.uint8)]


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes, round-to-nearest-even, saturating at +-448 (inf too, as torch does); NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.minimum(np.searchsorted(_E4M3_POS, a), 0x7E)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(take_hi, hi, lo).astype(np.uint8)
    code |= np.signbit(x).astype(np.uint8) << 7
    code[np.isnan(x)] = 0x7F
    return code
