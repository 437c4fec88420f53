"""Debug: the graph/eager x branches comparison of test_gpu_graph_replay_equals_eager(0.0), with details.
argv: iters prewarm(0/1)"""
import os, sys, time, json
sys.path.insert(0, os.getcwd()); sys.path.insert(1, os.path.join(os.getcwd(), "tests"))
from test_device_round import engines, PROMPTS
from numbaengine import device_round
iters, prewarm = int(sys.argv[1]), int(sys.argv[2])
t0 = time.time()
ref, dev = engines()
if prewarm:
    other = ["x = 1\n", "while True:", "print('hi')"]
    for graphs in (False, True):
        for branches in (False, True):
            dev.target.ops.branches = branches
            device_round.generate_batch(dev.target, dev.drafter, dev.tokenizer, other, 40, "ddtree", 16, 0.0, 7, [],
                                        4096, None, {}, graphs)
    dev.target.ops.branches = True
print("ready", round(time.time() - t0, 1), flush=True)
for it in range(iters):
    out = {}
    t = time.time()
    for graphs, branches in ((False, False), (True, False), (False, True), (True, True)):
        dev.target.ops.branches = branches
        res = device_round.generate_batch(dev.target, dev.drafter, dev.tokenizer, PROMPTS, 40, "ddtree", 16, 0.0, 7,
                                          [], 4096, None, {}, graphs)
        out[f"g{int(graphs)}b{int(branches)}"] = [r.tokens for r in res]
    dev.target.ops.branches = True
    vals = list(out.values())
    if all(v == vals[0] for v in vals):
        print(it, "ok", round(time.time() - t, 1), flush=True)
        continue
    diffs = {}
    for k, v in out.items():
        diffs[k] = [next((i for i, (a, b) in enumerate(zip(p, q)) if a != b), None) for p, q in zip(v, out["g1b1"])]
    print(it, "DIFF vs g1b1 first index per prompt", json.dumps(diffs), flush=True)
    print(it, "TOKENS", json.dumps(out), flush=True)
