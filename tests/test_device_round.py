"""The cuda backend's decoding (numbaengine/device_round.py rounds, driven by generate.decode) on a GPU: batched
device rounds replayed as CUDA graphs give the reference's tokens. The same round runs on the simulator in
test_backend_sim.py (tiny model).

Reference: the numpy backend on the same checkpoint. Greedy outputs must be equal except after a near-tie of the
reference's logits (the kernels round differently: bf16 MoE activations, bf16 q/P in MLA), and every token must be a
near-argmax of the reference given the cuda output's own prefix."""
import functools
from pathlib import Path

import numpy as np
import pytest

from numbaengine.weights import SHIPPED_PAIR

ROOT = Path(__file__).resolve().parents[1]
PAIR = SHIPPED_PAIR
TOL = 1e-2
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass ", "    for i in range(len(items)):\n        if"]


@functools.cache
def engines():
    from numbaengine import Engine
    return (Engine.load(PAIR / "target", PAIR / "draft", backend="numpy"),
            Engine.load(PAIR / "target", PAIR / "draft", backend="cuda"))


def assert_reference_tokens(ref, prompt, got, want, what):
    """got (cuda) vs want (numpy): equal, or different only after a near-tie; each token a near-argmax."""
    ids = ref.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    logits = ref.forward_logits(ids + got[:-1])[len(ids) - 1:]
    scale = np.abs(logits).max()
    for i, t in enumerate(got):
        assert logits[i].max() - logits[i, t] <= TOL * scale, f"{what}: step {i} token {t} is not a near-argmax"
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = np.sort(logits[i])[-2:]
        assert top2[1] - top2[0] <= TOL * scale, f"{what}: {got} != reference {want} at step {i}"


CASES = [("ar", 0, 3), ("dflash", 0, 3), ("ddtree", 1, 1), ("ddtree", 16, 3), ("ddtree", 64, 8), ("ddtree", 255, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget,batch", CASES)
def test_gpu_matches_numpy(mode, budget, batch):
    ref, dev = engines()
    prompts = (PROMPTS * 3)[:batch]
    got = dev.generate_batch(prompts, 24, mode=mode, budget=budget, stop=[])
    want = ref.generate_batch(prompts, 24, mode=mode, budget=budget, stop=[])
    for p, g, w in zip(prompts, got, want):
        assert len(g.tokens) == 24
        assert_reference_tokens(ref, p, g.tokens, w.tokens, f"{mode} budget {budget} batch {batch}")
    taus = [g.stats["tau_mean"] for g in got], [w.stats["tau_mean"] for w in want]
    print(mode, budget, batch, "tau cuda", taus[0], "numpy", taus[1])
    if mode == "ddtree" and budget >= 16:
        assert min(taus[0]) > 1.5, f"acceptance collapsed on the device: tau {taus[0]} (numpy {taus[1]})"


@pytest.mark.gpu
def test_gpu_uploads_on_round_stream(monkeypatch):
    """Every host -> device copy of a decode (prompts, retired slots) and every zero-filled buffer of a new
    DeviceRounds goes to the rounds' own non-blocking stream: work on the null stream is not ordered before their
    kernels (a pageable copy can still be in flight when they run), which let _park read stale slot ids and reset
    a live sequence's length (greedy outputs differed between runs, first runs of a process only)."""
    import cupy

    from numbaengine.ops_cuda import KernelOps
    _, dev = engines()
    streams = []
    real_asarray, real_zeros = KernelOps.asarray, KernelOps.zeros

    def asarray(self, a, dtype=None):
        if isinstance(a, np.ndarray):
            streams.append(("asarray", cupy.cuda.get_current_stream().ptr))
        return real_asarray(self, a, dtype)

    def zeros(self, shape, dtype=np.float32):
        streams.append(("zeros", cupy.cuda.get_current_stream().ptr))
        return real_zeros(self, shape, dtype)
    monkeypatch.setattr(KernelOps, "asarray", asarray)
    monkeypatch.setattr(KernelOps, "zeros", zeros)
    res = dev.generate_batch(PROMPTS, 24, mode="ddtree", budget=13, stop=[])    # a shape of its own: new buffers
    rounds = next(iter(dev.rounds_cache.values()))
    assert rounds.shape.budget == 13 and len({len(r.tokens) for r in res}) == 1 and rounds.parked
    assert {k for k, _ in streams} == {"asarray", "zeros"}, streams
    assert {p for _, p in streams} == {rounds.stream.ptr}, (streams, rounds.stream.ptr)


@pytest.mark.gpu
def test_gpu_poisoned_scratch_same_tokens(monkeypatch):
    """NUMBAENGINE_POISON=1: every scratch request on the cuda table is filled with NaN / -1 first, so a kernel
    reading what it did not write this call shows. Same kernels, same inputs: the tokens must be identical to the
    plain table's (greedy values do not depend on the tree: each row's logits come from fixed reduction orders)."""
    from numbaengine import Engine
    _, dev = engines()
    monkeypatch.setenv("NUMBAENGINE_POISON", "1")
    poisoned = Engine.load(PAIR / "target", PAIR / "draft", backend="cuda")
    assert poisoned.target.ops.poison and not dev.target.ops.poison
    for mode, budget, batch in (("ddtree", 64, 8), ("ar", 0, 3)):
        prompts = (PROMPTS * 3)[:batch]
        got = [r.tokens for r in poisoned.generate_batch(prompts, 24, mode=mode, budget=budget, stop=[])]
        want = [r.tokens for r in dev.generate_batch(prompts, 24, mode=mode, budget=budget, stop=[])]
        assert got == want, f"{mode} budget {budget}: poisoned scratch changed the tokens"


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_graph_replay_equals_eager(temperature):
    """Same round launched eagerly and replayed from the captured graph, with and without the parallel branches
    of ops.branch(): identical tokens; the graph holds our kernels, no host sync (capture would have failed), and
    the branches make its longest chain shorter than its node count."""
    ref, dev = engines()
    out, depth = {}, {}
    try:
        for graphs, branches in ((False, False), (True, False), (False, True), (True, True)):
            dev.rounds_cache.clear()
            dev.target.ops.branches = branches
            res = dev.generate_batch(PROMPTS, 40, "ddtree", 16, temperature, 7, [], graphs=graphs)
            out[graphs, branches] = [r.tokens for r in res]
            rounds = next(iter(dev.rounds_cache.values()))
            if graphs:
                depth[branches] = (rounds.graph_depth(), len(rounds.kernel_nodes()))
    finally:
        dev.target.ops.branches = True
        dev.rounds_cache.clear()
    assert out[True, True] == out[False, True] == out[True, False] == out[False, False]
    print("graph (depth, kernel nodes): branches", depth[True], "in order", depth[False])
    assert depth[True][0] < depth[False][0] and depth[True][1] == depth[False][1], depth
    assert rounds.graph is not None
    names = rounds.kernel_nodes()
    print(len(names), "kernel names;", sorted(set(n[:60] for n in names))[:80])
    import os
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "round_graph.dot").write_text(str(rounds.graph.debug_dot_str())[:2_000_000])
    parts = ("build_kernel", "walk_kernel", "commit_kernel", "mla", "sample_rows_part_kernel", "sample_merge_kernel",
             "kv_attention")
    missing = [part for part in parts if not any(part in n for n in names)]
    assert not missing, f"no {missing} nodes among {len(names)} kernel nodes"


@pytest.mark.gpu
def test_gpu_sampling_reproducible():
    _, dev = engines()
    a = [r.tokens for r in dev.generate_batch(PROMPTS, 32, "ddtree", 16, temperature=1.0, seed=3, stop=[])]
    b = [r.tokens for r in dev.generate_batch(PROMPTS, 32, "ddtree", 16, temperature=1.0, seed=3, stop=[])]
    c = [r.tokens for r in dev.generate_batch(PROMPTS, 32, "ddtree", 16, temperature=1.0, seed=4, stop=[])]
    assert a == b and a != c


@pytest.mark.gpu
def test_gpu_sampled_matches_numpy_ar():
    """Sampled DDTree on the device == sampled autoregressive decoding on the device (same noise per absolute
    position), token for token, unless a near-tie flips."""
    _, dev = engines()
    tree = [r.tokens for r in dev.generate_batch(PROMPTS, 24, "ddtree", 32, temperature=0.8, seed=11, stop=[])]
    ar = [r.tokens for r in dev.generate_batch(PROMPTS, 24, "ar", 0, temperature=0.8, seed=11, stop=[])]
    same = sum(t == a for t, a in zip(tree, ar))
    assert same >= 2, f"sampled ddtree {tree} vs ar {ar}"


@pytest.mark.gpu
def test_gpu_sampled_ddtree_distribution_exact(tmp_path):
    """The reference's goodness-of-fit test on the cuda backend: 1500 sampled DDTree continuations of one prompt
    (15 device batches of 100, seeds 11..25: independent noise) against the target's exact joint law of three
    tokens (16-token vocabulary, kernel-sized dims; its random drafter leads the walk past the root in ~87% of the
    samples, the small CPU pair in > 90%)."""
    from test_backend_sim import TINY
    from test_generate import GOF_N, GOF_PROMPT, gof_of, small_pair

    from numbaengine import Engine
    small = small_pair(tmp_path, TINY, heads=2, kv_heads=1, head_dim=32, intermediate=64)
    dev = Engine.load(tmp_path / "target", tmp_path / "draft", backend="cuda", max_context=64)
    results = []
    for chunk in range(GOF_N // 100):
        results += dev.generate_batch([GOF_PROMPT] * 100, 3, "ddtree", 24, temperature=0.7, seed=11 + chunk, stop=[])
    assert gof_of(small, 0.7, results, min_walked=0.8) > 1e-3


@pytest.mark.gpu
def test_gpu_memory_error_is_clear():
    from numbaengine.generate import generate_on
    from numbaengine.rounds import DeviceSlots
    _, dev = engines()
    with pytest.raises(MemoryError, match="lower max_context") as e:
        generate_on(DeviceSlots(dev.target, dev.drafter, 1 << 23, 128), dev.tokenizer, ["x"] * 128, 1 << 22,
                    "ddtree", 255, 0.0, 0, [])
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [512, 4])
def test_gpu_slots_mixed_settings(chunk):
    """The server's scheduler on cuda: requests with different temperatures, seeds and budgets share one
    DeviceRounds (made for budget 16) and each gives Engine.generate's tokens alone; with chunk 4 the prompts are
    prefilled in pieces between the others' rounds (greedy ones then checked against the reference, as a
    prefill's GEMMs of other row counts may round differently)."""
    from test_slots_sim import run_scheduler

    from numbaengine.scheduler import Request
    ref, dev = engines()
    settings = [("ddtree", 16, 0.0, 0), ("ddtree", 8, 0.8, 3), ("ddtree", 16, 1.0, 7), ("ddtree", 4, 0.0, 0)]
    reqs = [Request(dev.tokenizer.encode(p), 24, m, b, t, s, stop_ids=[])
            for p, (m, b, t, s) in zip(PROMPTS * 2, settings)]
    got, sched = run_scheduler(dev, reqs, max_batch=4, prefill_chunk=chunk)
    assert sched.rounds.dev.shape.budget == 16
    for r, tokens in zip(reqs, got):
        want = dev.generate(r.ids, 24, r.mode, r.budget, r.temperature, r.seed, stop=[]).tokens
        assert len(tokens) == 24
        if chunk < len(r.ids) and r.temperature == 0:
            assert_reference_tokens(ref, r.ids, tokens, want, f"budget {r.budget} in pieces of {chunk}")
        elif chunk >= len(r.ids):
            assert tokens == want, f"budget {r.budget} T {r.temperature} seed {r.seed}: {tokens} != {want}"


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_auto_equals_ar(temperature):
    """Budget auto on cuda (probe graph, host choice, the size's verify graph; the cost table measured from the
    rounds' own graphs at every bucket and ladder size) gives ar's tokens at batches 1, 3 and 8; every round's size
    is recorded; with a table where size 0 pays, rounds coast (no probe) and still give ar's tokens."""
    from numbaengine.budget import LADDER, CostTable
    from numbaengine.device_round import buckets
    _, dev = engines()
    for batch in (1, 3, 8):
        prompts = (PROMPTS * 3)[:batch]
        want = [r.tokens for r in dev.generate_batch(prompts, 24, "ar", 0, temperature, 5, [])]
        got = dev.generate_batch(prompts, 24, "ddtree", "auto", temperature, 5, [])
        assert [r.tokens for r in got] == want, f"batch {batch} T {temperature}"
        rounds = next(iter(dev.rounds_cache.values()))
        assert rounds.table.sizes == LADDER and set(rounds.table.seconds) == set(buckets(batch)), rounds.table
        print("auto batch", batch, "sizes", [r.stats["budget_hist"] for r in got], "table",
              {n: [round(s * 1e3, 3) for s in row] for n, row in rounds.table.seconds.items()})
        for r in got:
            assert sum(r.stats["budget_hist"].values()) == r.stats["rounds"] and r.stats["budget"] == "auto"
    coast = CostTable(LADDER, {n: (1.0,) + (9.0,) * (len(LADDER) - 1) for n in buckets(3)})
    want = [r.tokens for r in dev.generate_batch((PROMPTS * 3)[:3], 24, "ar", 0, temperature, 5, [])]
    dev.overlap = False                                                      # coasting rounds read one by one
    try:
        got = dev.generate_batch((PROMPTS * 3)[:3], 24, "ddtree", "auto", temperature, 5, [], cost_table=coast)
    finally:
        dev.overlap = True
    assert [r.tokens for r in got] == want, f"coasting, T {temperature}"     # size 0 without probes (budget.Coast)
    ahead = dev.generate_batch((PROMPTS * 3)[:3], 24, "ddtree", "auto", temperature, 5, [], cost_table=coast)
    assert [r.tokens for r in ahead] == want, f"coasting with overlap, T {temperature}"
    assert all(r.stats["budget_hist"] == {0: r.stats["rounds"]} and r.stats["probes"] < r.stats["rounds"] / 2
               for r in got), [r.stats for r in got]


@pytest.mark.gpu
def test_gpu_probe_scores_match_the_host_tree():
    """Budget auto's input on the shipped pair at batch 1, after the rounds' cost table was timed on the same rounds
    (as DeviceSlots and tools.bench do without a table): the probe's node scores give the numpy tree's expected
    accepted drafts at every ladder size, right after the prompt and after a probe's size-0 round and three
    coasting ones (their rows written by the next probe's flush). A wrong or stale drafter context moves them by
    far more than bf16 rounding."""
    from numbaengine import generate as gen
    from numbaengine.budget import LADDER, prefix_accepts
    from numbaengine.ddtree import Params, decode_round, draft_trees, prefill
    from numbaengine.device_round import DeviceRounds, Shape
    ref, cuda = engines()
    p, timer = Params("ddtree"), gen.Timer()
    dev = DeviceRounds(cuda.target, cuda.drafter, Shape(1, "ddtree", max(LADDER), 256, LADDER), graphs=True)
    dev.costs(reps=1)
    later = 0                                  # prompts checked after the coast too (tokens may part at a near-tie)
    for prompt in PROMPTS:
        ids = ref.tokenizer.encode(prompt)
        seq = prefill(0, ids, ref.target, ref.drafter, ref.target.ops, p, 256)
        assert dev.prefill(0, ids, 0) == seq.bonus, prompt
        for rounds in (0, 4):
            later += rounds > 0
            tree = draft_trees([seq], [max(LADDER)], ref.drafter, p, timer)[0]
            got, want = prefix_accepts(dev.probe()[0, 1:]), prefix_accepts(tree.scores[1:])
            got, want = got[list(LADDER)], want[list(LADDER)]
            print(f"{prompt!r} after {rounds} rounds: expected drafts by size {np.round(got, 3)} (numpy "
                  f"{np.round(want, 3)})")
            assert np.abs(got - want).max() <= 0.05 * want[-1] + 1e-3, (
                f"{prompt!r} after {rounds} rounds: expected drafts by size {got} != numpy {want}")
            for i in range(4):                 # the probe's size-0 round, then 3 coasting ones (no probe)
                out = dev.step(0)[0]
                host = decode_round([seq], [0], ref.target, ref.drafter, ref.target.ops, p, timer)[0]
                parted = out[1:out[0] + 1].tolist() != host.tokens
                if parted:
                    print(f"{prompt!r}: device and numpy tokens parted (round {rounds + i}): next prompt")
                    break
            if parted:
                break
        dev.retire([0])
    assert later, "every prompt's tokens parted from numpy's before the second probe"


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget,temperature", [("ar", 0, 0.0), ("ddtree", 16, 0.0), ("ddtree", 16, 1.0)])
def test_gpu_overlap_same_tokens(mode, budget, temperature):
    """Engine.overlap (on by default: each round launched before the host handles the last one's tokens): the
    tokens of the rounds without it, for 8 prompts of different output lengths (so rounds where some end launch nothing ahead), and
    through the scheduler with requests joining the running rounds."""
    from test_slots_sim import run_scheduler

    from numbaengine.scheduler import Request
    _, dev = engines()
    prompts = (PROMPTS * 3)[:8]
    dev.overlap = False
    try:
        want = [dev.generate(p, 6 + 5 * i, mode, budget, temperature, 3, stop=[]).tokens
                for i, p in enumerate(prompts)]
        want_long = dev.generate(prompts[0], 40, mode, budget, temperature, 3, stop=[]).tokens
    finally:
        dev.overlap = True
    reqs = [Request(dev.tokenizer.encode(p), 6 + 5 * i, mode, budget, temperature, 3, stop_ids=[])
            for i, p in enumerate(prompts)]
    got, _ = run_scheduler(dev, reqs, max_batch=8, prefill_chunk=512)
    assert got == want, f"{mode} {budget} T {temperature}: scheduler with overlap"
    assert dev.generate(prompts[0], 40, mode, budget, temperature, 3, stop=[]).tokens == want_long, "generate"


@pytest.mark.gpu
def test_gpu_buckets():
    """Three requests on eight slots finishing in reverse slot order: rounds over 4, 2 and 1 slots, each its own
    graph; each request gives Engine.generate's tokens alone."""
    from test_slots_sim import run_scheduler

    from numbaengine.scheduler import Request
    _, dev = engines()
    reqs = [Request(dev.tokenizer.encode(p), n, "ddtree", 16, 0.0, 0, stop_ids=[])
            for p, n in zip(PROMPTS, (24, 12, 6))]
    got, sched = run_scheduler(dev, reqs, max_batch=8, prefill_chunk=512)
    plans = sched.rounds.dev.plans
    assert {n for n, _, _ in plans} >= {1, 2, 4} and all(p.graph is not None for p in plans.values()
                                                         if p.rounds > 1), sorted(plans)
    for r, tokens in zip(reqs, got):
        assert tokens == dev.generate(r.ids, r.max_tokens, "ddtree", 16, stop=[]).tokens, f"prompt {r.ids}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 100, 2000])
def test_gpu_prompt_lengths_match_numpy(n):
    """Prompts of 1, 100 and 2,000 tokens (2,000: three 512-row prefill graphs and one of 464 rows padded to 512,
    then rounds) give the reference's greedy tokens."""
    ref, dev = engines()
    prompt = np.random.default_rng(n).integers(0, dev.cfg.vocab_size, n).tolist()
    got = dev.generate(prompt, 16, "ddtree", 16, stop=[]).tokens
    want = ref.generate(prompt, 16, "ddtree", 16, stop=[]).tokens
    assert len(got) == 16
    assert_reference_tokens(ref, prompt, got, want, f"prompt of {n} tokens")


@pytest.mark.gpu
def test_gpu_prefill_graphs(monkeypatch):
    """Prompt pieces as captured graphs on the staging slot (each graph size; a 700-token prompt: pieces of 512 and
    188) give the tokens of the eager prefill straight into the slot, greedy, also when a graph replays (the second
    prompt of a size), against the reference where the two differ (GEMMs of padded row counts round otherwise)."""
    from numbaengine.device_round import DeviceRounds
    ref, dev = engines()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, dev.cfg.vocab_size, n).tolist() for n in (5, 7, 20, 100, 300, 700)]
    got = [dev.generate(p, 16, "ddtree", 16, stop=[]).tokens for p in prompts]
    rounds = next(iter(dev.rounds_cache.values()))
    assert {8, 32, 128, 512} <= set(rounds.prefill_plans) and rounds.prefill_plans[8].graph is not None
    monkeypatch.setattr(DeviceRounds, "prefill_rows", ())
    dev.rounds_cache.clear()
    eager = [dev.generate(p, 16, "ddtree", 16, stop=[]).tokens for p in prompts]
    dev.rounds_cache.clear()
    for p, g, w in zip(prompts, got, eager):
        if g != w:
            assert_reference_tokens(ref, p, g, w, f"prefill graphs, prompt of {len(p)}")
