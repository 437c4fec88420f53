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
from typing import Protocol

import numpy as np

from numbaengine.env import simulator
from numbaengine.reference import (
    InOrder,
    add_rmsnorm_ref,
    all_reduce_ref,
    attention_ref,
    cache_read_ref,
    cache_write_ref,
    copy_ref,
    embed_ref,
    gemm_ref,
    head_gemm_ref,
    kv_attention_ref,
    latent_attention_ref,
    moe_shared_ref,
    qk_norm_rope_ref,
    rmsnorm_ref,
    rope_ref,
    router_ref,
    sample_ref,
    silu_mul_ref,
    visibility_ref,
)

BACKENDS = ("numpy", "sim", "cuda", "auto")


class Ops(Protocol):
    """The op interface, declared once: the NumPy table below (numbaengine/reference.py) and ops_cuda.KernelOps
    implement it (tests/test_reference.py checks both against it). Arrays are the table's own (NumPy or CuPy);
    every math op writes its `out` and returns it."""
    name: str
    cache_dtypes: tuple          # latent cache storage it supports ("bf16", "float32")
    max_shards: int              # devices one table drives
    prefill_form: str            # MLA form of prompt forwards: "naive" | "absorbed"

    def asarray(self, a, dtype=None): ...
    def to_host(self, a): ...
    def empty(self, shape, dtype=None): ...
    def zeros(self, shape, dtype=None): ...
    def scratch(self, role, shape, dtype=None): ...
    def copy(self, src, dst): ...
    def upload(self, weights): ...
    def embed(self, table, tokens, out): ...
    def cache_write(self, rows, visible, latent): ...
    def cache_read(self, rows, end, out): ...
    def visibility(self, start, T, tree_mask, form): ...
    def all_reduce(self, parts): ...
    def branch(self): ...
    def rmsnorm(self, x, w, eps, out): ...
    def add_rmsnorm(self, x, residual, w, eps, out, res_out=None): ...
    def gemm(self, x, w, out): ...
    def head_gemm(self, x, w, out): ...
    def rope(self, x, pos, inv_freq, out, *, interleaved, attn_factor=1.0): ...
    def qk_norm_rope(self, qk, nq, q_w, k_w, eps, pos, inv_freq, q_out, k_out, *, interleaved): ...
    def attention(self, q, k, v, visible, scale, out): ...
    def kv_attention(self, q, k, v, kv_len, scale, out): ...
    def latent_attention(self, q, rows, visible, scale, out): ...
    def silu_mul(self, gate_up, out): ...
    def router(self, x, w_gate, bias, top_k, n_group, topk_group, norm_topk, scaling, idx_out, w_out): ...
    def moe(self, x, idx, wts, experts, out, shared=None, after=None): ...
    def sample(self, logits, temperature, seed, seq, pos, out): ...


NUMPY = SimpleNamespace(
    name="numpy", cache_dtypes=("bf16", "float32"), max_shards=1 << 16, prefill_form="naive",
    asarray=np.asarray, to_host=np.asarray, empty=np.empty, zeros=np.zeros,
    scratch=lambda role, shape, dtype=np.float32: np.empty(shape, dtype), copy=copy_ref,
    upload=lambda weights: weights,
    embed=embed_ref, cache_write=cache_write_ref, cache_read=cache_read_ref, visibility=visibility_ref,
    all_reduce=all_reduce_ref, branch=InOrder,
    rmsnorm=rmsnorm_ref, add_rmsnorm=add_rmsnorm_ref, gemm=gemm_ref,
    head_gemm=lambda x, w, out: head_gemm_ref(x, w, out, transpose_w=True),
    rope=rope_ref, qk_norm_rope=qk_norm_rope_ref, attention=attention_ref, kv_attention=kv_attention_ref,
    latent_attention=latent_attention_ref, silu_mul=silu_mul_ref,
    router=router_ref, moe=moe_shared_ref, sample=sample_ref,
)


def gpu_ready() -> bool:
    """A GPU that the cuda backend can drive: CuPy imports, numba sees a device, and the simulator is off."""
    if simulator():
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
