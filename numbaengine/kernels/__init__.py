"""Kernel families, one per module: the numba.cuda kernels of the ops whose NumPy reference (`*_ref`) is in
numbaengine/reference.py.

Every op writes into caller-provided outputs and never allocates them, so the same call sequence can be
captured as a CUDA graph. The reference ops do float32 math on checkpoint storage (bf16 as uint16 bits).
"""
