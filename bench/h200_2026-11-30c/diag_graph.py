"""Session 9 diagnostic: greedy tokens of the pair's DDTree-16 round, eager vs graph, with/without branches, MLA_NK 64/32, twice each."""
import sys, time
sys.path.insert(0, "tests")
import kernels.mla as km
from test_device_round import engines, PROMPTS
from numbaengine import device_round
ref, dev = engines()
t0 = time.time()
for nk in (64, 32, 64):
    km.MLA_NK = nk
    outs = {}
    for rep in range(2):
        for graphs, branches in ((False, False), (True, False), (False, True), (True, True)):
            dev.target.ops.branches = branches
            res = device_round.generate_batch(dev.target, dev.drafter, dev.tokenizer, PROMPTS, 40, "ddtree", 16,
                                              0.0, 7, [], 4096, None, {}, graphs)
            outs[rep, graphs, branches] = [r.tokens for r in res]
    base = outs[0, False, False]
    for k, v in outs.items():
        diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(v, base)]
        print(f"NK={nk} rep={k[0]} graphs={k[1]} branches={k[2]} first diff per prompt vs eager/no-branch rep0: {diff}", flush=True)
    print(f"--- {time.time() - t0:.0f} s", flush=True)
dev.target.ops.branches = True
