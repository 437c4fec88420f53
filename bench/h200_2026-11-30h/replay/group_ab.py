"""A/B of the grouped sampler's constants on the tree bench's rows (keys from tree_build), each variant a child."""
import json, subprocess, sys
VARIANTS = {
    "g8": [],
    "g4": [("GROUP_ROWS = 4 if SIM else 8", "GROUP_ROWS = 4 if SIM else 4")],
    "g2": [("GROUP_ROWS = 4 if SIM else 8", "GROUP_ROWS = 4 if SIM else 2")],
    "g1": [("GROUP_ROWS = 4 if SIM else 8", "GROUP_ROWS = 4 if SIM else 1")],
    "g8_u4": [("GROUP_UNROLL = 8 ", "GROUP_UNROLL = 4 ")],
    "g4_u4": [("GROUP_ROWS = 4 if SIM else 8", "GROUP_ROWS = 4 if SIM else 4"), ("GROUP_UNROLL = 8 ", "GROUP_UNROLL = 4 ")],
    "g4_b4096": [("GROUP_ROWS = 4 if SIM else 8", "GROUP_ROWS = 4 if SIM else 4"), ("SPLIT_BLOCKS = 2048 ", "SPLIT_BLOCKS = 4096 ")],
}
CHILD = r"""
import sys, types, json
import numpy as np, cupy as cp
import kernels
src = open('kernels/sample.py').read()
for old, new in json.loads(sys.argv[1]):
    assert old in src, old
    src = src.replace(old, new)
mod = types.ModuleType('kernels.sample'); mod.__file__ = 'kernels/sample.py'
sys.modules['kernels.sample'] = mod; kernels.sample = mod
exec(compile(src, 'kernels/sample.py', 'exec'), mod.__dict__)
from tools.bench_attention import Keep, gpu_us, _tree_case
from kernels.tree import tree_build, tree_topk
res = {}
for budget in (16, 64, 255):
    keep = Keep()
    tb, dl, tl, budgets, lengths, bonus, seq_ids = _tree_case(keep, budget)
    tree_topk(dl, tb); tree_build(tb, budgets, lengths, bonus, seq_ids)
    pos = cp.asnumpy(tb.sample_pos)
    for T in (1.0, 0.0):
        us, _ = gpu_us(lambda: mod.sample(tl, T, 7, tb.sample_seq, tb.sample_pos, tb.post, work=tb.sample_work), reps=10)
        res[f"b{budget}_T{T:g}"] = [round(us, 1), int(cp.asnumpy(tb.post).astype(np.int64).sum() % 1000003)]
    res[f"b{budget}_keys"] = int(len(set(pos.tolist())))
print("RES", json.dumps(res))
"""
for name in (sys.argv[1:] or VARIANTS):
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(VARIANTS[name])], capture_output=True, text=True, timeout=200)
    line = [l for l in r.stdout.splitlines() if l.startswith("RES")]
    print(name, line[0][4:] if line else "FAILED " + r.stderr[-800:], flush=True)
