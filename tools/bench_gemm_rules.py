"""Which GEMM cut rule above one token tile (T > 1: verify and draft rows) makes the shipped pair's rounds fastest,
and does each rule still give the reference's tokens. A rule rewrites `gemm_config`'s answer for small weights
(under SMALL_BYTES): BF=1 reads f32 x in the GEMM (no prep launch), FR=1 adds the k-split partials in the last
block (no reduce launch), SB=1 drops the k split altogether. On the lent GPU:

    python -m tools.bench_gemm_rules --out rules.json

Per rule: a fresh cuda engine; greedy tokens of ar x1, ddtree-16 x1 and dflash x3 against the numpy backend's
(exact match count: a mismatch after a near-tie is possible, a gross one is a bug), then tools.bench's rows for ar
and ddtree-16 at batch 1 (tokens/s, round and phase times, graph kernel count)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from tools.bench import ROOT, copy_bandwidth, run_case

SMALL_BYTES = 4 << 20
RULES = {"base": {}, "fr": dict(FR=1), "bf": dict(BF=1), "bf_fr": dict(BF=1, FR=1), "nosplit": dict(SB=1),
         "bf_nosplit": dict(BF=1, SB=1)}
CHECKS = [("ar", 0, 1), ("ddtree", 16, 1), ("dflash", 0, 3)]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass ", "    for i in range(len(items)):\n        if"]


def ruled(default, over):
    """gemm_config with `over` applied above one token tile to weights under SMALL_BYTES."""
    def config(m, n, k, target_warps=4096):
        cfg = default(m, n, k, target_warps)
        if math.ceil(m / 8) > 1 and 2 * n * k < SMALL_BYTES and over:
            cfg = dataclasses.replace(cfg, **over)
        return cfg
    return config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--out", default="gemm_rules.json")
    args = ap.parse_args(argv)
    import cupy as cp

    from numbaengine import Engine, ops_cuda
    pair = (ROOT / "weights/default/target", ROOT / "weights/default/draft")
    ref = Engine.load(*pair, backend="numpy")
    want = {c: [r.tokens for r in ref.generate_batch(PROMPTS[:c[2]], args.check_tokens, mode=c[0], budget=c[1],
                                                      stop=[])] for c in CHECKS}
    copy_bw = copy_bandwidth(cp)
    default, out = ops_cuda.gemm_config, dict(copy_gbs=copy_bw, small_bytes=SMALL_BYTES, rules={})
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    try:
        for name in args.rules.split(","):
            ops_cuda.gemm_config = ruled(default, RULES[name])
            engine = Engine.load(*pair, backend="cuda", max_context=1024)
            checks = {}
            for c in CHECKS:
                got = [r.tokens for r in engine.generate_batch(PROMPTS[:c[2]], args.check_tokens, mode=c[0],
                                                               budget=c[1], stop=[])]
                same = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want[c])]
                checks["%s-%d-%d" % c] = same           # per sequence: tokens equal before the first difference
            print(name, "tokens equal up to", checks, flush=True)
            rows = [run_case(engine, mode, budget, 1, args.new_tokens, copy_bw, cp) for mode, budget in
                    (("ar", 0), ("ddtree", 16))]
            out["rules"][name] = dict(over=RULES[name], checks=checks, rows=rows,
                                      speedup=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
            print(name, f"ddtree/ar {out['rules'][name]['speedup']:.3f}x", flush=True)
    finally:
        ops_cuda.gemm_config = default
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
