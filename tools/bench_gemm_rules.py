"""Which GEMM cut makes the shipped pair's rounds fastest, and does each still give the reference's tokens. The
pair's weights are all under kernels.gemm.SMALL_WEIGHTS, where gemm_config picks one launch per GEMM (f32 x read in
the GEMM, the k split inside a block); the other rules are the cut for large weights and its variants. On the GPU:

    python -m tools.bench_gemm_rules --out rules.json

Per rule: a fresh cuda engine; greedy tokens of ar x1, ddtree-16 x1 and dflash x3 against the numpy backend's (per
sequence: how many tokens are equal before the first difference; one after a near-tie is possible, an early one is
a bug), then tools.bench's rows for ar and ddtree-16 at batch 1 (tokens/s, round and phase times, graph kernels)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from numbaengine.kernels.gemm import MAX_WARPS, SMALL_WEIGHTS, TARGET_WARPS, gemm_config
from numbaengine.weights import SHIPPED_PAIR
from tools.bench import copy_bandwidth, run_case
from tools.gpu import require_gpu


def big(**over):
    """The cut for large weights (prep launch and k-split reduce launch above one token tile), with `over`."""
    def rule(m, n, k, target_warps=TARGET_WARPS):
        return dataclasses.replace(gemm_config(m, n, k, target_warps, small=0), **over)
    return rule


def small_r2(max_tiles):
    """The small-weights cut with two row tiles per warp (half the blocks) up to `max_tiles` token tiles; the default
    (R=1) is faster on the pair's AR and DDTree rounds at 1 and 3 tiles."""
    def rule(m, n, k, target_warps=TARGET_WARPS, small=None):
        cfg = gemm_config(m, n, k, target_warps, small)
        if 2 * n * k >= (SMALL_WEIGHTS if small is None else small) or math.ceil(m / 8) > max_tiles:
            return cfg
        return dataclasses.replace(cfg, R=2, WR=max(1, min(MAX_WARPS // cfg.WK, math.ceil(n / 32))))
    return rule


RULES = {"base": gemm_config, "small_prep": lambda *a, **kw: dataclasses.replace(gemm_config(*a, **kw), BF=0),
         "big": big(), "big_read_x": big(BF=1), "big_last_block_reduce": big(FR=1),
         "small_r2": small_r2(5), "small_r2_at_1_tile": small_r2(1)}
CHECKS = [("ar", 0, 1), ("ddtree", 16, 1), ("dflash", 0, 3)]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass ", "    for i in range(len(items)):\n        if"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--out", default="gemm_rules.json")
    args = ap.parse_args(argv)
    require_gpu("python -m tools.bench_gemm_rules")
    import cupy as cp

    from numbaengine import Engine, ops_cuda
    pair = (SHIPPED_PAIR / "target", SHIPPED_PAIR / "draft")
    ref = Engine.load(*pair, backend="numpy")
    want = {c: [r.tokens for r in ref.generate_batch(PROMPTS[:c[2]], args.check_tokens, mode=c[0], budget=c[1],
                                                      stop=[])] for c in CHECKS}
    copy_bw = copy_bandwidth(cp)
    out = dict(copy_gbs=copy_bw, rules={})
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    try:
        for name in args.rules.split(","):
            ops_cuda.gemm_config = RULES[name]
            engine = Engine.load(*pair, backend="cuda", max_context=1024)
            checks = {}
            for c in CHECKS:
                got = [r.tokens for r in engine.generate_batch(PROMPTS[:c[2]], args.check_tokens, mode=c[0],
                                                               budget=c[1], stop=[])]
                checks["%s-%d-%d" % c] = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
                                          for g, w in zip(got, want[c])]
            print(name, "tokens equal up to", checks, flush=True)
            rows = [run_case(engine, mode, budget, 1, args.new_tokens, copy_bw, cp) for mode, budget in
                    (("ar", 0), ("ddtree", 16))]
            out["rules"][name] = dict(checks=checks, rows=rows,
                                      speedup=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
            print(name, f"ddtree/ar {out['rules'][name]['speedup']:.3f}x", flush=True)
    finally:
        ops_cuda.gemm_config = gemm_config
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
