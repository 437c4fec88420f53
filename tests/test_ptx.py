"""Every kernel of the dense, MoE and top-k families compiles for sm_90 on the CPU (numba.cuda.compile_ptx: the
real type inference and NVVM, which the simulator skips), with no float64 instruction and no local memory in the
mma kernels (RoPE: only libdevice's float64 reduction of huge angles). Needs the CUDA compiler wheels
(numba-cuda[cu13]); skipped without them."""
import re

import pytest
from cudasim import f64_lines, ptx_or_skip
from numba import types as ty

u16, u32, i32, f32 = ty.uint16, ty.uint32, ty.int32, ty.float32
A1, A2, A3 = (lambda t: t[::1]), (lambda t: t[:, :]), (lambda t: t[:, :, :])


@pytest.fixture(autouse=True, scope="module")
def cpu_compute_capability():
    """Device functions are compiled for the current device's compute capability; without a GPU, say sm_90."""
    from numba import cuda
    from numba.cuda import dispatcher
    if cuda.is_available():
        yield
        return

    class Device:
        compute_capability = (9, 0)
    real = dispatcher.get_current_device
    dispatcher.get_current_device = Device
    yield
    dispatcher.get_current_device = real


def _gemm():
    from numbaengine.kernels.gemm import _build_gemm, _build_reduce
    from numbaengine.kernels.prep import build_prep
    sig = (A1(u32), A1(u32), A2(f32), A3(f32)) + (i32,) * 5
    cases = {f"gemm_T{T}_R{R}_XS{XS}_PF{PF}_BF{BF}": (_build_gemm(T, R, XS, 2, PF, BF), sig, True)
             for T, R, XS, PF, BF in [(1, 2, 2, 0, 0), (1, 2, 2, 1, 1), (3, 2, 2, 0, 1), (5, 1, 1, 0, 1),
                                      (9, 1, 2, 1, 0)]}
    cases["prep_int4_order"] = (build_prep(1, 1), (A2(f32), A1(u32), i32, i32), True)
    cases["prep_bf16"] = (build_prep(1, 0), (A2(f32), A1(u32), i32, i32), True)
    cases["gemm_reduce"] = (_build_reduce(), (A3(f32), A2(f32), i32, i32, i32), False)
    return cases


def _moe():
    from numbaengine.kernels.gemm import BF16, INT4
    from numbaengine.kernels.moe import (
        _build_combine,
        _build_expert_gemm,
        _build_plan,
        _build_router_logits,
        _build_router_select,
    )
    cases = {}
    for fmt, down, T, R, G in [(INT4, 0, 2, 2, 4), (INT4, 1, 1, 2, 4), (INT4, 1, 1, 1, 2), (INT4, 0, 1, 1, 1),
                               (BF16, 0, 2, 2, 1)]:
        w = ty.uint32[:, ::1]
        sc = ty.uint16[:, ::1] if fmt == INT4 else w
        sig = (A1(u32), w, sc, A1(u16), A2(f32), A2(f32)) + (A1(i32),) * 5 + (i32,) * 5 + (A2(i32),)
        name = f"expert_{'int4' if fmt == INT4 else 'bf16'}_{'down' if down else 'gate_up'}_T{T}_R{R}_G{G}"
        cases[name] = (_build_expert_gemm(fmt, down, T, R, G, 2, int(fmt == INT4), int(down)), sig, True)
    cases["router_logits"] = (_build_router_logits(4), (A1(f32), A1(u32), A3(f32), i32, i32, i32), False)
    cases["router_select"] = (_build_router_select(8), (A3(f32), A1(f32), A2(i32), A2(f32)) + (i32,) * 5 + (f32,),
                              False)
    for slots in (0, 32):                                       # block scan only; with the one-warp plan
        cases[f"plan_prep_int4_warp{slots}"] = (_build_plan(1, slots), (A2(i32), i32, i32, i32, i32, i32)
                                                + (A1(i32),) * 5 + (A2(f32), A1(u32), i32), False)
    cases["combine"] = (_build_combine(8), (A2(f32), A2(f32), A2(f32), A2(i32)) + (i32,) * 5, False)
    return cases


def _elementwise():
    from numbaengine.kernels.act import _silu_mul_k
    from numbaengine.kernels.norm import _build as norm_build
    from numbaengine.kernels.rope import _build as rope_build
    from numbaengine.kernels.topk import _argmax_k, _build_topk
    return {
        "rmsnorm": (norm_build(False), (A2(f32), A2(f32), A1(u16), f32, A2(f32), i32, A2(f32), i32), False),
        "add_rmsnorm": (norm_build(True), (A2(f32), A2(f32), A1(u16), f32, A2(f32), i32, A2(f32), i32), False),
        "silu_mul": (_silu_mul_k, (A2(f32), A2(f32), i32, i32), False),
        "rope_interleaved": (rope_build(True), (A3(f32), A1(i32), A1(f32), A3(f32), f32, i32, i32, i32), None),
        "rope_half": (rope_build(False), (A3(f32), A1(i32), A1(f32), A3(f32), f32, i32, i32, i32), None),
        "argmax": (_argmax_k, (A2(f32), A1(i32), i32), False),
        "topk8": (_build_topk(8), (A2(f32), A2(i32), A2(f32), i32), False),
    }


CASES = {**_gemm(), **_moe(), **_elementwise()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ptx(name):
    kern, sig, mma = CASES[name]
    ptx = ptx_or_skip(kern.py_func, sig)
    if mma is None:   # rope: libdevice's accurate sinf/cosf reduce angles > ~1e5 rad through float64 (cold path)
        f64 = [ln for ln in f64_lines(ptx) if not re.search(r"cvt\.rn\.f(64|32)\.(s64|f64)|mul\.f64|\.reg", ln)]
        assert not f64, f"{name}: float64 instructions outside the sin/cos reduction:\n" + "\n".join(f64[:5])
        return
    assert not f64_lines(ptx), f"{name}: float64 instructions:\n" + "\n".join(f64_lines(ptx)[:5])
    if mma:
        assert "mma.sync.aligned.m16n8k16" in ptx or "prep" in name, f"{name}: no mma.sync"
        assert not re.search(r"\b(ld|st)\.local", ptx), f"{name}: local memory (an accumulator array not in registers)"


def test_ptx_stats_expert_mainloop():
    """tools/ptx_stats.py finds the INT4 expert GEMM's unrolled mainloop: U k-steps of 2*R*G mma and 4R + G loads
    (2R weight chunks, 2R scale pairs, G B fragments) each, at K2's G = 4 (the register path's cut: gate_up's
    default takes the bulk rings, whose loop reads shared memory)."""
    from numbaengine.kernels.moe import GATE_UP_CFG
    from tools.ptx_stats import expert_gemm_ptx, hot_block, opcode_counts
    ptx, cfg = expert_gemm_ptx(0, GATE_UP_CFG)
    ops = opcode_counts(hot_block(ptx))
    assert (ops["mma"], ops["ld"]) == (8 * cfg.R * cfg.U, (4 * cfg.R + 4) * cfg.U), ops


def test_ptx_stats_dense_gemm_mainloop():
    """tools/ptx_stats.py --gemm finds the dense GEMM's mainloop: whole k-steps of 2*R*T*XS mma at q_kv_a, m = 17
    (three token tiles)."""
    from tools.ptx_stats import dense_gemm_ptx, hot_block, opcode_counts
    ptx, cfg, per_step = dense_gemm_ptx(17, 2112, 7168)
    mma = opcode_counts(hot_block(ptx))["mma"]
    assert per_step == 2 * cfg.R * 3 * cfg.XS and mma and mma % per_step == 0, (mma, per_step, cfg)


def test_ptx_stats_load_placement_and_cap():
    """The load-placement count (global loads of a SASS hot block, those before its first HMMA) and the register cap
    the tools hand ptxas for a cut's launch bounds (compile_ptx of a py_func drops them)."""
    from tools.ptx_stats import load_placement, reg_cap
    block = ["LDG.E.128", "IMAD", "LDG.E.64", "HMMA.16816.F32.BF16", "LDG.E.128", "HMMA.16816.F32.BF16"]
    assert load_placement(block) == (3, 2)
    assert load_placement(["LDG.E", "FFMA"]) == (1, 1)       # no mma: every load counts as early
    assert (reg_cap(128, 4), reg_cap(256, 4), reg_cap(512), reg_cap(32)) == (128, 64, 128, 255)


def test_pdl_mode_values():
    """NUMBAENGINE_PDL: wait by default (or 1), off / 0; a misspelt or removed value is an error, not silently off."""
    from numbaengine.env import pdl_mode
    assert [pdl_mode(v) for v in ("", "wait", "1", "off", "0")] == ["wait", "wait", "wait", None, None]
    with pytest.raises(ValueError, match="NUMBAENGINE_PDL='trigger'"):
        pdl_mode("trigger")
    with pytest.raises(ValueError, match="NUMBAENGINE_PDL='wiat'"):
        pdl_mode("wiat")


def test_ptx_pdl_wait_before_any_memory_access(monkeypatch):
    """With kernels.device.PDL (NUMBAENGINE_PDL, "wait" by default) a kernel made by kernel() that starts with
    grid_dep() waits for the previous one before its body's first global load or store and never lets the next one
    launch early; the launch attribute exists in this cuda.core and kernels.launch.pdl sets it on this
    thread's launches only (rank threads launch concurrently), and only inside the context."""
    import numba.cuda.dispatcher as D
    from numba import cuda

    import numbaengine.kernels.device as dev
    import numbaengine.kernels.launch as kl
    for mode in ("wait",):
        monkeypatch.setattr(dev, "PDL", mode)

        @kl.kernel()
        def axpy(x, y):
            dev.grid_dep()
            i = cuda.grid(1)
            if i < x.shape[0]:
                y[i] += x[i] * 2.0
        assert axpy.grid_dep
        ptx = ptx_or_skip(axpy.py_func, "void(float32[::1], float32[::1])")
        body = ptx[ptx.index(".entry"):]
        first_mem = min(body.index(op) for op in ("ld.global", "st.global") if op in body)
        assert body.index("griddepcontrol.wait") < first_mem, mode
        trigger = body.find("griddepcontrol.launch_dependents")
        assert trigger < 0, mode
    import threading
    other = []                    # what another thread's launch gets while this one is inside pdl()
    with kl.pdl():
        cfg = D.LaunchConfig(grid=1, block=32)
        t = threading.Thread(target=lambda: other.append(D.LaunchConfig(grid=1, block=32)))
        t.start()
        t.join()
    assert cfg.programmatic_stream_serialization
    assert not getattr(other[0], "programmatic_stream_serialization", False)
    assert not getattr(D.LaunchConfig(grid=1, block=32), "programmatic_stream_serialization", False)


def test_ptx_diff_canonical_names_only(tmp_path):
    """tools/ptx_diff.py: PTX that differs only in numba's mangled names, the shared arrays' numbering or the order
    of declarations compares equal; one changed instruction does not (and compare says which kernel)."""
    from tools.ptx_diff import canonical, compare
    a = (".common .global .align 8 .u64 _ZN08NumbaEnv5mod_a1fE;\n.extern .shared .align 4 .b8 _cudapy_smem_8[];\n"
         ".visible .shared .align 4 .b8 _cudapy_smem_144[4];\n.visible .entry _ZN3mod_a6kernelE(\n"
         "\tmov.u64 %rd1, _cudapy_smem_8;\n\tadd.f32 %f1, %f2, %f3;\n")
    b = (".visible .shared .align 4 .b8 _cudapy_smem_20[4];\n.extern .shared .align 4 .b8 _cudapy_smem_21[];\n"
         ".visible .entry _ZN5mod_b26kernelE(\n\tmov.u64 %rd1, _cudapy_smem_21;\n\tadd.f32 %f1, %f2, %f3;\n")
    assert canonical(a) == canonical(b)
    assert canonical(a) != canonical(b.replace("add.f32", "sub.f32"))
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for folder, text in (("x", a), ("y", b)):
        (tmp_path / folder / "k.1.ptx").write_text(canonical(text))
    assert compare(tmp_path / "x", tmp_path / "y") == 0
    (tmp_path / "y" / "k.1.ptx").write_text(canonical(b.replace("add.f32", "sub.f32")))
    assert compare(tmp_path / "x", tmp_path / "y") == 1
