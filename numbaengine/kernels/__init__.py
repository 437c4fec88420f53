"""Kernel families, one per module: the NumPy reference op (`*_ref`) beside its numba.cuda kernels.

Every op writes into caller-provided outputs and never allocates them, so the same call sequence can be
captured as a CUDA graph. The reference ops do float32 math on checkpoint storage (bf16 as uint16 bits).
"""
