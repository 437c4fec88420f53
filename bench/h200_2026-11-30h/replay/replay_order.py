"""Debug: generate_batch combos (gXbY: graphs X, branches Y) in a given order in a fresh process; prints each run's
first token index that differs from the majority of the runs. argv: comma list of combos"""
import os, sys, time, json, collections
sys.path.insert(0, os.getcwd()); sys.path.insert(1, os.path.join(os.getcwd(), "tests"))
from test_device_round import engines, PROMPTS
from numbaengine import device_round
ref, dev = engines()
runs = []
for combo in sys.argv[1].split(","):
    graphs, branches = combo[1] == "1", combo[3] == "1"
    dev.target.ops.branches = branches
    t = time.time()
    res = device_round.generate_batch(dev.target, dev.drafter, dev.tokenizer, PROMPTS, 40, "ddtree", 16, 0.0, 7, [],
                                      4096, None, {}, graphs)
    runs.append((combo, [r.tokens for r in res], round(time.time() - t, 1)))
dev.target.ops.branches = True
major = collections.Counter(json.dumps(r[1]) for r in runs).most_common(1)[0][0]
major = json.loads(major)
for i, (combo, toks, s) in enumerate(runs):
    d = [next((j for j, (a, b) in enumerate(zip(p, q)) if a != b), None) for p, q in zip(toks, major)]
    print(i, combo, s, "ok" if toks == major else f"DIFF first index per prompt {d}", flush=True)
