"""Static instruction counts of a kernel's hot loop, from its sm_90 PTX or SASS (CPU only: no GPU needed).

The hot loop is taken as the basic block with the most mma instructions (the unrolled mainloop of the mma
kernels). PTX is numba's output before ptxas; `--sass` assembles it with ptxas (CUDA toolkit) and disassembles
with nvdisasm (`pip install nvidia-cuda-nvdisasm`), which is what the GPU runs: ptxas does not merge `and` and `or`
with two constant operands into one LOP3, for one, so PTX counts can mislead.

    python -m tools.ptx_stats [--sass]      # the INT4 expert GEMMs (gate_up, down) with the default cuts
"""
import argparse
import collections
import glob
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


def sass_of(ptx):
    """SASS text (nvdisasm -c) of a PTX module assembled by ptxas for sm_90. numba's NVVM may write a newer PTX
    .version than the local ptxas reads: the module is stamped with ptxas's own (no newer feature is used)."""
    ptxas = shutil.which("ptxas") or next(iter(glob.glob("/usr/local/cuda*/bin/ptxas")), None)
    nvdisasm = shutil.which("nvdisasm") or next(iter(glob.glob(os.path.join(
        os.path.dirname(sys.executable), "..", "lib", "python*", "site-packages", "nvidia", "cu*", "bin",
        "nvdisasm"))), None)
    if not ptxas or not nvdisasm:
        raise SystemExit("--sass needs ptxas (CUDA toolkit) and nvdisasm (pip install nvidia-cuda-nvdisasm) "
                         f"on PATH; found ptxas={ptxas} nvdisasm={nvdisasm}")
    ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", ver).groups()
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:     # PTX ISA 9.0 came with CUDA 13.0 (8.x: CUDA 12.x)
            f.write(re.sub(r"\.version \d+\.\d+", f".version {int(major) - 4}.{minor}", ptx)
                    if int(major) >= 13 else ptx)
        subprocess.run([ptxas, "-arch=sm_90", "-O3", src, "-o", cubin], check=True)
        return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


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


def opcode_counts(block):
    """Counter of the opcodes' first component (fma, and, mma, ld, ...), predicates stripped."""
    ops = (re.sub(r"^@!?%p\d+\s+", "", ins) for ins in block)
    return collections.Counter(re.split(r"[\s.]", op, maxsplit=1)[0] for op in ops)


def expert_gemm_ptx(down, cfg=None):
    """PTX of the INT4 expert GEMM stage with the default cut (kernels.moe GATE_UP_CFG / DOWN_CFG), K2's G = 4."""
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    from numba import types as ty

    from kernels.gemm import INT4
    from kernels.moe import DOWN_CFG, GATE_UP_CFG, MOE_XS, _build_expert_gemm
    if not cuda.is_available():          # device functions compile for the current device: say sm_90

        class Device:
            compute_capability = (9, 0)
        dispatcher.get_current_device = Device
    c = cfg or (DOWN_CFG if down else GATE_UP_CFG)
    bounds = (32 * c.WR * c.WK, c.min_blocks) if c.min_blocks else None
    kern = _build_expert_gemm(INT4, down, c.T, c.R, MOE_XS, 4, c.U, 1, c.PF, bounds)
    u32, u16, i32, f32 = ty.uint32, ty.uint16, ty.int32, ty.float32
    sig = (u32[::1], u32[:, ::1], u16[:, ::1], u16[::1], f32[:, ::1], f32[:, ::1]) + (i32[::1],) * 5 + (i32,) * 5
    return cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))[0], c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="count the SASS of ptxas instead of numba's PTX")
    args = ap.parse_args(argv)
    for down in (0, 1):
        ptx, cfg = expert_gemm_ptx(down)
        if args.sass:
            block = sass_hot_block(sass_of(ptx))
            ops = collections.Counter(op.split(".")[0].lower() for op in block)
            mma, loads, kind = ops["hmma"], ops["ldg"], "SASS"
        else:
            block = hot_block(ptx)
            ops = opcode_counts(block)
            mma, loads, kind = ops["mma"], ops["ld"], "PTX"
        steps = cfg.U                                   # the unrolled mainloop holds U k-steps
        print(f"expert {'down' if down else 'gate_up'} (R={cfg.R}, U={cfg.U}): {len(block) / steps:.0f} {kind} "
              f"instructions per k-step, {mma / steps:.0f} mma, {loads / steps:.0f} loads; "
              + ", ".join(f"{k} {v / steps:.0f}" for k, v in ops.most_common(10)))


if __name__ == "__main__":
    main()
