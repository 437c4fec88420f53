"""Op tables: the named ops the model, drafter and DDTree round are written in, one table per backend.

An op table holds
  arrays   asarray, to_host, empty, zeros (fresh arrays), scratch(role, shape, dtype) (an intermediate the table may
           reuse across calls), copy(src, dst), upload(weights) (checkpoint records -> the backend's form)
  glue     embed, cache_write, cache_read, visibility, all_reduce, branch() (ops issued in `with ops.branch() as
           side:` may run beside the ops that follow until side.join(): a parallel branch of a captured round)
  math     rmsnorm, add_rmsnorm, gemm, head_gemm, rope, qk_norm_rope, attention, kv_attention, latent_attention,
           silu_mul, router, moe, sample
  facts    name, cache_dtypes (latent cache storage it supports), max_shards (devices one table drives),
           prefill_form (MLA form of prompt forwards: naive on the reference, absorbed on the kernels)
`numpy` is the reference (numbaengine/reference.py, fresh arrays everywhere; it imports no numba). `sim` and `cuda`
run the numba.cuda kernels on the CUDA simulator or a GPU (numbaengine/ops_cuda.py).
"""
from types import SimpleNamespace

import numpy as np

from numbaengine.reference import (
    add_rmsnorm_ref,
    attention_ref,
    gemm_ref,
    head_gemm_ref,
    kv_attention_ref,
    moe_ref,
    qk_norm_rope_ref,
    rmsnorm_ref,
    rope_ref,
    router_ref,
    sample_ref,
    silu_mul_ref,
)
from numbaengine.weights.dtypes import bf16_to_f32, f32_to_bf16

BACKENDS = ("numpy", "sim", "cuda", "auto")


def embed_ref(table, tokens, out):
    """tokens i32[n] -> out f32[n, H] = bf16 rows of table u16[V, H]."""
    out[:] = bf16_to_f32(table[np.asarray(tokens)])
    return out


def cache_write_ref(rows, visible, latent):
    """Latent rows f32[T, D] of new tokens -> cache rows start..start+T-1 (rounded to bf16 in a bf16 cache), where
    visible bool[T, start+T] is what visibility_ref gave for them."""
    start = visible.shape[1] - len(latent)
    rows[start:start + len(latent)] = f32_to_bf16(latent) if rows.dtype == np.uint16 else latent


def cache_read_ref(rows, end, out):
    """Cache rows [0, end) -> out f32[end, D]."""
    out[:] = bf16_to_f32(rows[:end]) if rows.dtype == np.uint16 else rows[:end]
    return out


def visibility_ref(start, T, tree_mask, form=None):
    """bool[T, start+T]: every committed row, then the new rows the mask allows (causal when mask is None).
    The reference attention ops take it in both MLA forms."""
    vis = np.ones((T, start + T), bool)
    vis[:, start:] = np.tril(np.ones((T, T), bool)) if tree_mask is None else np.asarray(tree_mask, bool)
    return vis


def latent_attention_ref(q, rows, visible, scale, out):
    """Absorbed MLA: q f32[T, h, r+rope] ([q_lat | q_pe]) against cache rows [0, S) (S = visible's width) as MQA,
    keys = whole latent rows, values = their c_kv part -> out f32[T, h, r]."""
    latent = cache_read_ref(rows, visible.shape[1], np.empty((visible.shape[1], rows.shape[1]), np.float32))
    return attention_ref(q, latent[:, None, :], latent[:, None, :out.shape[-1]], visible, scale, out)


def all_reduce_ref(parts):
    """Sum of the shards' partial outputs (what NCCL computes across GPUs)."""
    return parts[0] if len(parts) == 1 else np.sum(parts, axis=0, dtype=np.float32)


def moe_shared_ref(x, idx, wts, experts, out, shared=None, after=None):
    """Routed experts (moe_ref), plus the shared expert's output when given (after: the branch that computed it,
    joined before it is read; nothing to wait for here)."""
    moe_ref(x, idx, wts, experts, out)
    if shared is not None:
        out += shared
    return out


def copy_ref(src, dst):
    dst[...] = src
    return dst


class InOrder:
    """branch() of a table that runs every op in order (the reference, the simulator): nothing to join."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def join(self):
        pass


NUMPY = SimpleNamespace(
    name="numpy", cache_dtypes=("bf16", "float32"), max_shards=1 << 16, prefill_form="naive",
    asarray=np.asarray, to_host=np.asarray, empty=np.empty, zeros=np.zeros,
    scratch=lambda role, shape, dtype=np.float32: np.empty(shape, dtype), copy=copy_ref, upload=lambda w: w,
    embed=embed_ref, cache_write=cache_write_ref, cache_read=cache_read_ref, visibility=visibility_ref,
    all_reduce=all_reduce_ref, branch=InOrder,
    rmsnorm=rmsnorm_ref, add_rmsnorm=add_rmsnorm_ref, gemm=gemm_ref,
    head_gemm=lambda x, w, out: head_gemm_ref(x, w, out, True),
    rope=rope_ref, qk_norm_rope=qk_norm_rope_ref, attention=attention_ref, kv_attention=kv_attention_ref,
    latent_attention=latent_attention_ref, silu_mul=silu_mul_ref,
    router=router_ref, moe=moe_shared_ref, sample=sample_ref,
)


def gpu_ready() -> bool:
    """A GPU that the cuda backend can drive: CuPy imports, numba sees a device, and the simulator is off."""
    import os
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy
        from numba import cuda
        return bool(cuda.is_available()) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def get_ops(backend: str):
    """The op table for `backend`; `auto` is cuda when gpu_ready(), else numpy. sim and cuda build a fresh table
    (it owns its scratch) per call."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "cuda" if gpu_ready() else "numpy"
    if backend == "numpy":
        return NUMPY
    from numbaengine.ops_cuda import cuda_ops, sim_ops
    return sim_ops() if backend == "sim" else cuda_ops()
