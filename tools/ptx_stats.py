"""Static instruction counts of a kernel's hot loop, from its sm_90 PTX or SASS (CPU only: no GPU needed).

The hot loop is taken as the basic block with the most mma instructions (the unrolled mainloop of the mma
kernels). PTX is numba's output before ptxas; `--sass` assembles it with ptxas (CUDA toolkit) and disassembles
with nvdisasm (`pip install nvidia-cuda-nvdisasm`), which is what the GPU runs: ptxas does not merge `and` and `or`
with two constant operands into one LOP3, for one, so PTX counts can mislead.

    python -m tools.ptx_stats [--sass]                 # the INT4 expert GEMMs (gate_up, down), default cuts
    python -m tools.ptx_stats --sass --gemm q_kv_a:17  # a K2 dense GEMM (tools.bench_kernels.K2_GEMMS) at m rows
    python -m tools.ptx_stats --sass --gemm q_kv_a:17 --cut '{"S": 0, "RB": 0}'   # another cut
    python -m tools.ptx_stats --sass --mla 64          # the MLA kernel for 64 query rows (whole kernel, registers)
"""
import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def hot_block(ptx):
    """The instructions of the basic block of `ptx` with the most mma.sync (labels, directives, comments dropped)."""
    blocks, cur = [], []
    for line in (ln.strip() for ln in ptx.splitlines()):
        if re.match(r"^\$L__BB\d+_\d+:", line):
            blocks.append(cur)
            cur = []
        elif line and not line.startswith(("//", ".", "{", "}", ")", "(")):
            cur.append(line)
    blocks.append(cur)
    return max(blocks, key=lambda b: sum("mma.sync" in ins for ins in b))


def _assemble(ptx, d, *flags):
    """ptxas (sm_90, -O3, extra flags) on `ptx` in folder d -> (path of the cubin, ptxas's stderr)."""
    ptxas, _ = _tools()
    src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
    with open(src, "w") as f:
        f.write(_stamp(ptxas, ptx))
    r = subprocess.run([ptxas, "-arch=sm_90", "-O3", *flags, src, "-o", cubin], capture_output=True, text=True,
                       check=True)
    return cubin, r.stderr


def sass_of(ptx, *flags):
    """SASS text (nvdisasm -c) of a PTX module assembled by ptxas for sm_90 (extra ptxas flags)."""
    with tempfile.TemporaryDirectory() as d:
        cubin, _ = _assemble(ptx, d, *flags)
        return subprocess.run([_tools()[1], "-c", cubin], capture_output=True, text=True, check=True).stdout


def _tools():
    """(ptxas, nvdisasm) paths, or a clear exit."""
    ptxas = shutil.which("ptxas") or next(iter(glob.glob("/usr/local/cuda*/bin/ptxas")), None)
    nvdisasm = shutil.which("nvdisasm") or next(iter(glob.glob(os.path.join(
        os.path.dirname(sys.executable), "..", "lib", "python*", "site-packages", "nvidia", "cu*", "bin",
        "nvdisasm"))), None)
    if not ptxas or not nvdisasm:
        raise SystemExit("--sass needs ptxas (CUDA toolkit) and nvdisasm (pip install nvidia-cuda-nvdisasm) "
                         f"on PATH; found ptxas={ptxas} nvdisasm={nvdisasm}")
    return ptxas, nvdisasm


def reg_cap(threads, blocks=1):
    """Registers per thread when `blocks` blocks of `threads` share the register file (what launch bounds ask for;
    compile_ptx of a kernel's py_func drops its launch bounds, so the tools pass the cap to ptxas themselves)."""
    return min(255, 65536 // (threads * blocks) // 8 * 8)


def ptxas_info(ptx, threads, blocks=1):
    """ptxas -v's register and spill line for the module, capped as the kernels cap themselves (the register file
    over `threads` x `blocks`: kernels.mla's max_registers, the expert GEMMs' min_blocks)."""
    with tempfile.TemporaryDirectory() as d:
        _, err = _assemble(ptx, d, "-v", f"-maxrregcount={reg_cap(threads, blocks)}")
    keep = [ln.split(":", 1)[-1].strip() for ln in err.splitlines() if "registers" in ln or "spill" in ln]
    return " | ".join(keep)


def _stamp(ptxas, ptx):
    """numba's NVVM may write a newer PTX .version than the local ptxas reads: stamp ptxas's own (PTX ISA 9.x came
    with CUDA 13.x, 8.x with 12.x; no newer feature is used)."""
    ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", ver).groups()
    return re.sub(r"\.version \d+\.\d+", f".version {int(major) - 4}.{minor}", ptx) if int(major) >= 13 else ptx


def sass_hot_block(sass):
    """Opcodes (full, e.g. LOP3.LUT) of the SASS basic block with the most HMMA instructions."""
    blocks, cur = [], []
    for line in sass.splitlines():
        if re.match(r"^\s*\.L_x_\d+:", line):
            blocks.append(cur)
            cur = []
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            cur.append(m.group(1))
    blocks.append(cur)
    return max(blocks, key=lambda b: sum(op.startswith("HMMA") for op in b))


def load_placement(block):
    """(global loads in a SASS hot block, those issued before its first HMMA): the loads a warp has in flight when
    its first mma of an iteration waits. Under a register cap ptxas issues later steps' loads between the mma of
    earlier ones, so an unroll of U steps need not put U steps of loads in flight."""
    first = next((i for i, op in enumerate(block) if op.startswith("HMMA")), len(block))
    loads = [i for i, op in enumerate(block) if op.startswith("LDG")]
    return len(loads), sum(i < first for i in loads)


def capped(ptx, threads, blocks=1):
    """(SASS hot block, a report of registers, spills and load placement) of `ptx` assembled at the register cap
    of `blocks` blocks of `threads` (what the kernel's launch bounds ask for)."""
    block = sass_hot_block(sass_of(ptx, f"-maxrregcount={reg_cap(threads, blocks)}"))
    nld, early = load_placement(block)
    return block, f"  {ptxas_info(ptx, threads, blocks)}\n  hot loop: {nld} global loads, {early} before its first mma"


def opcode_counts(block):
    """Counter of the opcodes' first component (fma, and, mma, ld, ...), predicates stripped."""
    ops = (re.sub(r"^@!?%p\d+\s+", "", ins) for ins in block)
    return collections.Counter(re.split(r"[\s.]", op, maxsplit=1)[0] for op in ops)


def _sm90():
    """Device functions compile for the current device: without a GPU, say sm_90."""
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    if not cuda.is_available():

        class Device:
            compute_capability = (9, 0)
        dispatcher.get_current_device = Device


def default_cut(down):
    """The engine's cut of an expert stage on K2 shapes: gate_up on the bulk rings (MoeConfig.tiled), down registers."""
    from numbaengine.kernels.moe import MOE_DEFAULT, default_cuts
    return default_cuts(MOE_DEFAULT.tiled)[down]


def expert_gemm_ptx(down, cfg=None):
    """PTX of the INT4 expert GEMM stage with the default cut (`default_cut`) or `cfg` (S > 0: the bulk-ring
    kernel), K2's G = 4."""
    from numba import cuda
    from numba import types as ty

    from numbaengine.kernels.gemm import INT4
    from numbaengine.kernels.moe import _build_expert_gemm
    _sm90()
    c = cfg or default_cut(down)
    bounds = (32 * c.WR * c.WK, c.min_blocks) if c.min_blocks else None
    kern = _build_expert_gemm(INT4, down, c.T, c.R, 4, c.U, 1, c.PF, bounds, c.S)
    u32, u16, i32, f32 = ty.uint32, ty.uint16, ty.int32, ty.float32
    sc = u32[:, ::1] if c.S else u16[:, ::1]        # bulk layout: the scales are inside the weight chunks
    sig = (u32[::1], u32[:, ::1], sc, u16[::1], f32[:, ::1], f32[:, ::1]) + (i32[::1],) * 5 + (i32,) * 5
    sig += (i32[:, ::1],)                          # stamps (ExpertConfig.stamps only)
    return cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))[0], c


def dense_gemm_ptx(m, n, k, over=None):
    """PTX of the bf16 mma GEMM kernel gemm() launches for x f32[m, k] @ w[n, k]^T with the default cut, or with
    `over` (GemmConfig fields) replaced in it, and (cut, mma per k-step). The k-split reduce runs as a launch."""
    import dataclasses

    from numba import cuda
    from numba import types as ty

    from numbaengine.kernels.gemm import _build_gemm, gemm_config, token_tiles
    _sm90()
    c = dataclasses.replace(gemm_config(m, n, k), **(over or {}))
    T = token_tiles(m, c)
    bf = 1 if c.BF == 1 else 2
    kern = _build_gemm(T, c.R, c.XS, c.U, c.PF, bf, 0, (32 * c.WR * c.WK, c.MB) if c.MB else None, c.S, c.RB)
    u32, i32, f32 = ty.uint32, ty.int32, ty.float32
    sig = (u32[::1], u32[::1], f32[:, :], f32[:, :, :]) + (i32,) * 5
    return cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))[0], c, 2 * c.R * T * c.XS


def mla_ptx(M, D=576, r=512):
    """PTX of the absorbed MLA kernel for M query rows (T * heads) at K2's latent widths, and its geometry."""
    from numba import cuda

    from numbaengine.kernels.mla import MLA_PTX_SIG, mla_geometry, mla_kernel
    _sm90()
    geo = mla_geometry(M, D, r)
    kern = mla_kernel(geo[0], geo[1], geo[2], False, D, r)
    return cuda.compile_ptx(kern.py_func, MLA_PTX_SIG, cc=(9, 0))[0], geo


def counts(block, sass, steps):
    """One line of per-step counts of a hot block (`steps` k-steps in it): total, the ten most common opcodes,
    and in SASS the register moves (IMAD.MOV / MOV: operands rearranged for an mma, say)."""
    if sass:
        ops = collections.Counter(op.split(".")[0].lower() for op in block)
        moves = sum(op.startswith(("IMAD.MOV", "MOV")) for op in block)
        extra, kind = f", moves {moves / steps:.0f}", "SASS"
    else:
        ops, extra, kind = opcode_counts(block), "", "PTX"
    return (f"{len(block) / steps:.0f} {kind} instructions per k-step{extra}; "
            + ", ".join(f"{k} {v / steps:.0f}" for k, v in ops.most_common(10)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="count the SASS of ptxas instead of numba's PTX")
    ap.add_argument("--gemm", metavar="NAME:M", help="a K2 dense GEMM (tools.bench_kernels.K2_GEMMS) at M rows")
    ap.add_argument("--cut", metavar="JSON", help='with --gemm: GemmConfig fields to change, e.g. {"S": 0}')
    ap.add_argument("--mla", metavar="M", type=int, help="the MLA kernel for M query rows: registers, spills, SASS")
    ap.add_argument("--moe-cut", metavar="JSON", help='expert GEMMs: ExpertConfig fields to change, e.g. {"R": 1, '
                                                      '"WR": 4, "U": 8} (with --sass: registers, spills and load '
                                                      'placement at the cut\'s register cap)')
    args = ap.parse_args(argv)
    if args.gemm:
        from tools.bench_kernels import K2_GEMMS
        name, _, m = args.gemm.partition(":")
        if name not in K2_GEMMS:
            raise SystemExit(f"--gemm {name}: not one of {', '.join(K2_GEMMS)}")
        ptx, cfg, mma = dense_gemm_ptx(int(m or 1), *K2_GEMMS[name], json.loads(args.cut) if args.cut else None)
        block, report = capped(ptx, 32 * cfg.WR * cfg.WK, max(1, cfg.MB)) if args.sass else (hot_block(ptx), "")
        steps = sum(op.lower().startswith(("hmma", "mma")) for op in block) / mma
        print(f"gemm {name} m={m or 1} {cfg}: {counts(block, args.sass, steps)}" + ("\n" + report if report else ""))
        return
    if args.mla:
        ptx, (rg, kg, stages, threads, smem) = mla_ptx(args.mla)
        print(f"mla M={args.mla}: {16 * rg} rows x {threads} threads, {stages} stages, {smem // 1024} KB shared")
        print(ptxas_info(ptx, threads))
        return
    import dataclasses

    for down in (0, 1):
        cut = dataclasses.replace(default_cut(down), **json.loads(args.moe_cut or "{}"))
        ptx, cfg = expert_gemm_ptx(down, cut)
        steps = 1 if cfg.S else cfg.U   # the register mainloop unrolls U k-steps; a ring slot checks each of its U
        name = "down" if down else "gate_up"
        if not args.sass:
            print(f"expert {name} (R={cfg.R}, U={cfg.U}): {counts(hot_block(ptx), False, steps)}")
            continue
        block, report = capped(ptx, 32 * cfg.WR * cfg.WK, max(1, cfg.min_blocks))
        print(f"expert {name} {cfg}: {counts(block, True, steps)}\n{report}")


if __name__ == "__main__":
    main()
