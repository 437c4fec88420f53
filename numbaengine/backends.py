"""Op tables: the named ops the model, drafter and DDTree round are written in, one table per backend.

`numpy` is the reference (kernels/*_ref). `sim` and `cuda` run the numba.cuda kernels (on the simulator or a GPU);
they are assembled by the cuda-backend work and fail with a clear error until then.
"""
from types import SimpleNamespace

from kernels.act import silu_mul_ref
from kernels.attention import attention_ref
from kernels.gemm import gemm_ref
from kernels.mla import head_gemm_ref
from kernels.moe import moe_ref, router_ref
from kernels.norm import add_rmsnorm_ref, rmsnorm_ref
from kernels.rope import rope_ref
from kernels.sample import sample_ref

BACKENDS = ("numpy", "sim", "cuda", "auto")

NUMPY = SimpleNamespace(
    name="numpy", rmsnorm=rmsnorm_ref, add_rmsnorm=add_rmsnorm_ref, gemm=gemm_ref, head_gemm=head_gemm_ref,
    rope=rope_ref, attention=attention_ref, silu_mul=silu_mul_ref, router=router_ref, moe=moe_ref,
    sample=sample_ref,
)


def get_ops(backend: str) -> SimpleNamespace:
    """The op table for `backend`. `auto` means numpy until the cuda op table lands (then: cuda when a GPU is usable)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "numpy"
    if backend == "numpy":
        return NUMPY
    raise NotImplementedError(f"backend {backend!r}: the numba.cuda op table is not assembled yet "
                              "(issue 'The cuda backend end to end'); use backend='numpy'")
