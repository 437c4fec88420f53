"""Static instruction counts of a kernel's hot loop, from its sm_90 PTX (CPU only: numba's compiler, no GPU).

The hot loop is taken as the basic block with the most mma.sync instructions (the unrolled mainloop of the mma
kernels). PTX is before ptxas (which fuses and/or pairs into lop3, for one), so read the counts as relative: enough
to see what a mainloop spends its instructions on and whether a change cuts them, without the lent GPU.

    python -m tools.ptx_stats            # the INT4 expert GEMMs (gate_up, down) with the default cuts
"""
import argparse
import collections
import re


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
    ap.parse_args(argv)
    for down in (0, 1):
        ptx, cfg = expert_gemm_ptx(down)
        block = hot_block(ptx)
        ops = opcode_counts(block)
        steps = cfg.U                                   # the unrolled mainloop holds U k-steps
        print(f"expert {'down' if down else 'gate_up'} (R={cfg.R}, U={cfg.U}): {len(block) / steps:.0f} PTX "
              f"instructions per k-step, {ops['mma'] / steps:.0f} mma, {ops['ld'] / steps:.0f} loads; "
              + ", ".join(f"{k} {v / steps:.0f}" for k, v in ops.most_common(10)))


if __name__ == "__main__":
    main()
