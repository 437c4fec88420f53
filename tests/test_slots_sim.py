"""The server's device slots (numbaengine/rounds.py DeviceSlots over numbaengine/device_round.py DeviceRounds)
and its incremental text.

CPU: scheduler.settle (a TextStream decoding only recent tokens) gives the updates the full decode gives
(full_settle below, the rule it replaces) for random token streams: split UTF-8 characters, invalid bytes, stop
strings across update boundaries, on the shipped byte-level BPE, the id tokenizer and a plain byte tokenizer.
PTX: the per-row sampling kernels compile for sm_90 without float64 or spills.
Simulator (backend `sim`, a child process, the tiny pair of test_backend_sim): per-row temperatures and seeds in
one sampling launch equal sample_ref row by row; requests with different temperatures, seeds and budgets sharing
one DeviceRounds, one of them prefilled in pieces between the other's rounds, each give Engine.generate's tokens
for the same prompt and settings alone; a prompt prefilled in pieces gives the tokens (and cache rows) of one
prefill; batch buckets (rounds over 4, 2, then 1 slots as requests finish) and budget auto (probe, choice, the
size's verify; a measured cost table) give ar's / Engine.generate's tokens; prompt pieces through the staging slot
(the prefill graphs' path) equal pieces launched straight into the slot. The simulator cases take about 15 CPU
minutes in three children: marked slow (-m "not slow" leaves them out).
"""
import contextlib

import numpy as np
import pytest
from cudasim import f64_lines, ptx_or_skip, simulator_test
from test_ptx import cpu_compute_capability  # noqa: F401  (fixture: sm_90 for device functions without a GPU)

from numbaengine import generate as gen
from numbaengine.ddtree import Seq
from numbaengine.rounds import Run
from numbaengine.scheduler import Live, Request, first_stop, held, settle
from numbaengine.tokenizer import IdTokenizer, load_tokenizer
from numbaengine.weights import SHIPPED_PAIR

# --- incremental text == full decode ----------------------------------------------------------------------------------


class ByteTokenizer:
    """Token = one byte (ids 0..255), decoded as UTF-8 with replacement: every multi-byte character is split."""

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def full_settle(tokenizer, x, state):
    """The rule settle replaces (decode everything, search everything): state["sent"] is the text sent."""
    run, stops = x.run, x.req.stop_strings
    text = tokenizer.decode(run.tokens)
    cut = first_stop(text, stops)
    if cut >= 0:
        k = next(k for k in range(1, len(run.tokens) + 1) if first_stop(tokenizer.decode(run.tokens[:k]), stops) >= 0)
        run.tokens[k:], run.stop_reason, text = [], "stop", text[:cut]
    finish = None if run.stop_reason is None else ("length" if run.stop_reason in ("length", "context") else "stop")
    show = text if finish else held(text, stops)
    delta = show[len(state["sent"]):] if show.startswith(state["sent"]) else ""
    state["sent"] += delta
    return delta, len(run.tokens), finish


def live(stops, max_tokens):
    req = Request([1], max_tokens, stop_strings=tuple(stops), emit=None)
    return Live(req, Run([1], max_tokens, set(), limit=10 ** 6, seq=Seq(0, None, None, 1, 0)))


def stream_case(tokenizer, tokens, stops, rounds, max_tokens):
    """Both rules over the same rounds (lists of new tokens) -> (incremental updates, full-decode updates)."""
    a, b, state = live(stops, max_tokens), live(stops, max_tokens), {"sent": ""}
    got, want = [], []
    for new in rounds:
        for x in (a, b):
            gen.push(x.run, new)
        u = settle(tokenizer, a)
        got.append((u.text, u.tokens, u.finish_reason))
        want.append(full_settle(tokenizer, b, state))
        if u.finish_reason or want[-1][2]:
            break
    assert a.run.tokens == b.run.tokens
    return got, want


def utf8_tokens(rng, n):
    """Bytes of random text with 1- to 4-byte characters, a few invalid bytes among them."""
    chars = ["a", "b", " ", "\n", "é", "ß", "中", "文", "😀", "🎉"]
    out = []
    while len(out) < n:
        if rng.random() < 0.03:
            out.append(int(rng.choice([0x80, 0xBF, 0xC3, 0xE4, 0xF0, 0xFF])))
        else:
            out.extend(chars[rng.integers(len(chars))].encode())
    return out[:n]


def random_rounds(rng, tokens):
    """tokens cut into rounds of 1..6 (the first of one: the prefill's token)."""
    rounds, i = [tokens[:1]], 1
    while i < len(tokens):
        k = int(rng.integers(1, 7))
        rounds.append(tokens[i:i + k])
        i += k
    return rounds


def random_stops(rng, tokenizer, tokens):
    """0-3 stop strings: pieces of the stream's own text (so they occur, often across rounds) or absent ones."""
    text = tokenizer.decode(tokens).replace("\ufffd", "")
    stops = []
    for _ in range(int(rng.integers(0, 4))):
        if text and rng.random() < 0.7:
            i = int(rng.integers(len(text)))
            stops.append(text[i:i + int(rng.integers(1, 6))])
        else:
            stops.append("@@" + str(int(rng.integers(100))))
    return [s for s in stops if s]


TOKENIZERS = {"bytes": (ByteTokenizer, lambda rng, n: utf8_tokens(rng, n)),
              "ids": (IdTokenizer, lambda rng, n: rng.integers(0, 50, n).tolist()),
              "shipped": (lambda: load_tokenizer(SHIPPED_PAIR / "target"),
                          lambda rng, n: rng.integers(0, 4096, n).tolist())}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_incremental_text_equals_full_decode(name):
    make, draw = TOKENIZERS[name]
    tokenizer = make()
    for case in range(60):
        seed = int(np.random.SeedSequence().entropy % 2 ** 31)
        rng = np.random.default_rng(seed)
        tokens = draw(rng, int(rng.integers(1, 120)))
        stops = random_stops(rng, tokenizer, tokens)
        max_tokens = int(rng.integers(1, 150))
        got, want = stream_case(tokenizer, tokens, stops, random_rounds(rng, tokens), max_tokens)
        assert got == want, f"{name} case {case} (seed {seed}, stops {stops!r}): {got} != {want}"


def test_split_character_held_back_then_sent():
    """A character split over rounds is sent once whole; a stop string split over rounds ends the text before it."""
    tok = ByteTokenizer()
    got, want = stream_case(tok, list("a中b".encode()), (), [[0x61], [0xE4], [0xB8], [0xAD, 0x62]], 10)
    assert got == want == [("a", 1, None), ("", 2, None), ("", 3, None), ("中b", 5, None)]
    rounds = [[0x78], [0x79, 0x20, 0x53], [0x54, 0x4F], [0x50, 0x7A]]          # "x", "y S", "TO", "Pz"
    got, want = stream_case(tok, list(b"xy STOPz"), ("STOP",), rounds, 10)
    assert got == want == [("x", 1, None), ("y ", 4, None), ("", 6, None), ("", 7, "stop")]


def test_settle_decodes_recent_tokens_only():
    """5000 rounds of 2 tokens: the tokens decoded over all updates stay a small multiple of the output (the
    full decode of every round would be ~25 million)."""
    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return super().decode(ids)
    tok, rng = Counting(), np.random.default_rng(3)
    x = live(("@@stop", "?!"), 10 ** 6)                                  # never in this text
    tokens = utf8_tokens(rng, 10000)
    for i in range(0, len(tokens), 2):
        gen.push(x.run, tokens[i:i + 2])
        assert settle(tok, x).finish_reason is None
    assert Counting.decoded < 10 * len(tokens), Counting.decoded
    assert x.stream.text == ByteTokenizer().decode(x.run.tokens)


# --- PTX of the per-row sampling kernels ------------------------------------------------------------------------------

ROW_SIGS = {
    "sample_rows_kernel": "void(float32[:,::1], float32[::1], uint64[::1], int32, int32[::1], int32[::1], int32[::1], "
                          "boolean, int32[::1])",
    "sample_rows_part_kernel": "void(float32[:,::1], float32[::1], uint64[::1], int32, int32[::1], int32[::1], "
                               "int32[::1], boolean, uint64[:,::1])",
}


@pytest.mark.parametrize("name", sorted(ROW_SIGS))
def test_ptx_sample_rows(name):
    import numbaengine.kernels.sample as S
    ptx = ptx_or_skip(getattr(S, name).py_func, ROW_SIGS[name])
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert ".local" not in ptx, "registers spilled to local memory"


# --- simulator -------------------------------------------------------------------------------------------------------

def check_sample_rows(env, groups=3, per=2, V=300, seed=5):
    """sample() with per-group temperatures (0 among them) and seeds, one block per row and split over chunks:
    row by row equal to sample_ref with that row's settings."""
    from numbaengine.kernels.sample import sample, sample_work
    from numbaengine.reference import sample_ref
    rng = np.random.default_rng(seed)
    n = groups * per
    logits = rng.normal(0, 3, (n, V)).astype(np.float32)
    seq, pos = rng.integers(0, 4, n).astype(np.int32), rng.integers(0, 50, n).astype(np.int32)
    temps = np.array([0.0, 0.7, 1.3][:groups], np.float32)
    seeds = np.array([11, 2 ** 40 + 3, 7][:groups], np.uint64)
    want = np.concatenate([sample_ref(logits[g * per:(g + 1) * per], float(temps[g]), int(seeds[g]),
                                      seq[g * per:(g + 1) * per], pos[g * per:(g + 1) * per], np.empty(per, np.int32))
                           for g in range(groups)])
    live = np.array([per, 1, per][:groups], np.int32)              # group 1 samples its first row only
    kept = np.arange(n) % per < live[np.arange(n) // per]
    for work in (None, env.dev(sample_work(np.zeros, n))):
        out = env.dev(np.full(n, -7, np.int32))
        sample(env.dev(logits), env.dev(temps), env.dev(seeds), env.dev(seq), env.dev(pos), out, work, env.dev(live))
        got = env.host(out)
        assert (got[kept] == want[kept]).all(), f"split {work is not None}: {got} != {want} (seed {seed})"
        assert work is not None or (got[~kept] == -7).all(), "a skipped row was sampled"


def sim_engine(max_context=24):
    from test_backend_sim import pair_dirs

    from numbaengine import Engine
    return Engine.load(*pair_dirs("tiny"), backend="sim", max_context=max_context)


def run_scheduler(engine, reqs, max_batch, prefill_chunk):
    """Requests submitted together to a Scheduler on `engine` -> (output tokens per request, the scheduler)."""
    import threading

    from numbaengine.scheduler import Scheduler
    sched = Scheduler(engine, max_batch=max_batch, prefill_chunk=prefill_chunk)
    finished, errors, lives = threading.Semaphore(0), [], {}

    def emit(update):
        if update.error is not None:
            errors.append(update.error)
        if update.finish_reason is not None:
            finished.release()
    real_fill = sched.rounds.fill

    def fill(run, n):                             # keep each Live (its tokens) for the check
        lives[id(run.owner.req)] = run.owner
        return real_fill(run, n)
    sched.rounds.fill = fill
    for r in reqs:
        r.emit = emit
        sched.submit(r)
    sched.start()
    for _ in reqs:
        assert finished.acquire(timeout=1200), "requests did not finish"
    sched.close(60)
    assert not errors, errors
    return [lives[id(r)].run.tokens for r in reqs], sched


def check_shared_rounds(env):
    """Two ddtree requests in one DeviceRounds (batch 2, made for the first one's budget 2): a greedy one, and a
    sampled one (temperature 0.8, a seed of its own, budget 1) whose 5-token prompt is prefilled in pieces of 2
    between the first one's rounds (its slot parked at its rows so far meanwhile). Each gives the tokens of
    Engine.generate alone (batch 1) with its settings."""
    e = sim_engine()
    rng = np.random.default_rng()
    seed = int(rng.integers(2 ** 31))
    a = Request(rng.integers(0, e.cfg.vocab_size, 2).tolist(), 6, "ddtree", 2, 0.0, 1, stop_ids=[])
    b = Request(rng.integers(0, e.cfg.vocab_size, 5).tolist(), 3, "ddtree", 1, 0.8, seed, stop_ids=[])
    got, sched = run_scheduler(e, [a, b], max_batch=2, prefill_chunk=2)
    assert sched.rounds.dev.shape.batch == 2 and sched.rounds.dev.shape.budget == 2
    for r, tokens in zip((a, b), got):
        want = e.generate(r.ids, r.max_tokens, r.mode, r.budget, r.temperature, r.seed, stop=[]).tokens
        assert tokens == want, (f"budget {r.budget} T {r.temperature} seed {r.seed} prompt {r.ids}: {tokens} != "
                                f"generate {want}")


def check_chunked_prefill(env):
    """DeviceRounds.prefill_part over [0, 2), [2, 4), then prefill(start=4) == one prefill of the 5-token prompt:
    the first token, the latent rows and drafter context rows of the prompt, and the next round's tokens."""
    from numbaengine.device_round import DeviceRounds, Shape
    e = sim_engine()
    ids = np.random.default_rng().integers(0, e.cfg.vocab_size, 5).tolist()
    outs = []
    for pieces in ((), ((0, 2), (2, 4))):
        dev = DeviceRounds(e.target, e.drafter, Shape(1, "dflash", 3, 16), graphs=False)
        for start, end in pieces:
            dev.prefill_part(0, ids, start, end)
        first = dev.prefill(0, ids, 0, 0.0, 0, None, pieces[-1][1] if pieces else 0)
        rows = (np.array(dev.cache[:, 0, :5]), np.array(dev.ctx_kv[0][0, :5]))
        outs.append((first, rows, dev.step()[0].tolist()))
    (f1, r1, s1), (f2, r2, s2) = outs
    assert (f1, s1) == (f2, s2), f"prompt {ids}: one prefill {f1} {s1}, in pieces {f2} {s2}"
    assert (r1[0] == r2[0]).all() and np.abs(r1[1] - r2[1]).max() <= 1e-5 * np.abs(r1[1]).max(), f"prompt {ids}"


def check_buckets(env):
    """Batch buckets: three requests on four slots (budget 1), finishing in reverse slot order, so the rounds cover
    slots [0, 4), then [0, 2), then [0, 1), each bucket its own plan over the shared slot state, each round
    launched before the last one's tokens are handled (Engine.overlap) where none ends with it; every request gives
    Engine.generate's tokens alone (without overlap)."""
    e = sim_engine()
    rng = np.random.default_rng()
    reqs = [Request(rng.integers(0, e.cfg.vocab_size, 2 + i).tolist(), n, "ddtree", 1, 0.0, 1, stop_ids=[])
            for i, n in enumerate((5, 3, 2))]
    got, sched = run_scheduler(e, reqs, max_batch=4, prefill_chunk=512)      # (Engine.overlap: on)
    e.overlap = False
    assert {n for n, _, _ in sched.rounds.dev.plans} == {1, 2, 4}, sorted(sched.rounds.dev.plans)
    for r, tokens in zip(reqs, got):
        want = e.generate(r.ids, r.max_tokens, r.mode, r.budget, stop=[]).tokens
        assert tokens == want, f"prompt {r.ids}: {tokens} != generate {want}"


def check_auto(env):
    """Budget auto on the device rounds (ladder 0, 2, 4; two sequences sampled with one seed; greedy auto == ar is
    a GPU test and a host test): with a table that picks 4 nodes, ar's tokens and every round at that size (after
    the first probe, rounds chosen from the last one's drafts: one scored graph each); with one that picks 0, ar's
    tokens from rounds that coast after the first probe (verify without a probe), their rows kept in the backlog
    and written to the drafter context at the next probe (the same context as the first table's rounds made, each
    slot's rows as its run ended: rounds after that park it and write throwaway rows); both with rounds launched
    before the last one's tokens are handled (overlap); rounds made without a table (one slot, ladder 0, 2)
    measure one from their own rounds (every size, 0 included) and still give ar's tokens."""
    from test_backend_sim import CHECKPOINT_SEEDS

    from numbaengine.budget import CostTable
    from numbaengine.device_round import SCORED
    from numbaengine.rounds import DeviceSlots
    e = sim_engine()
    rng = np.random.default_rng()
    seed = int(rng.integers(2 ** 31))
    prompts = [rng.integers(0, e.cfg.vocab_size, 3).tolist(), rng.integers(0, e.cfg.vocab_size, 2).tolist()]
    ladder = (0, 2, 4)
    for temperature in (0.9,):
        ctx = {}
        want = [r.tokens for r in e.generate_batch(prompts, 4, mode="ar", temperature=temperature, seed=seed,
                                                   stop=[])]
        for pick, secs in ((4, (9.0, 9.0, 1.0)), (0, (1.0, 9.0, 9.0))):      # 0: rounds coast (no probe)
            slots = DeviceSlots(e.target, e.drafter, e.max_context, 2, table=CostTable(ladder, {2: secs}),
                                ladder=ladder, graphs=False)
            kept = {}
            with rows_as_runs_end(kept):
                res = gen.generate_on(slots, None, prompts, 4, "ddtree", "auto", temperature, seed, stop=[])
            where = (f"T {temperature} seed {seed} table {secs} prompts {prompts} checkpoint seed "
                     f"{CHECKPOINT_SEEDS['tiny']}")
            assert [r.tokens for r in res] == want, f"{where}: {[r.tokens for r in res]} != ar {want}"
            assert all(r.stats["budget_hist"] == {pick: r.stats["rounds"]} for r in res), where
            assert all(r.stats["probes"] == (coast_probes(r.stats["rounds"]) if pick == 0 else r.stats["rounds"])
                       for r in res), where
            scored = any(stages == SCORED for _, _, stages in slots.dev.plans)
            assert scored == (pick > 0 and max(r.stats["rounds"] for r in res) > 1), (where, [r.stats for r in res])
            rows = [kept.get(b, [np.array(kv[b]) for kv in slots.dev.ctx_kv]) for b in range(len(prompts))]
            ctx[pick] = rows, np.array(slots.dev.ctx_from)
        (every, _), (coasted, ctx_from) = ctx[4], ctx[0]    # the rows coasting rounds committed reached the drafter
        for b, p in enumerate(prompts):                       # context at the next probe (the backlog), as the rows
            assert ctx_from[b] > len(p), f"{where}: slot {b}: no backlog row flushed ({ctx_from[b]})"   # appended
            for x, y in zip(every[b], coasted[b]):            # by every round of the trees
                a, c = x[:ctx_from[b]], y[:ctx_from[b]]
                err = np.abs(a - c).max() / np.abs(a).max()   # rows verified in trees of other sizes round apart
                assert err <= 1e-2, f"{where}: slot {b}: drafter context off by {err:.1e} (a wrong row: ~1)"
    slots = DeviceSlots(e.target, e.drafter, e.max_context, 1, ladder=(0, 2), graphs=False, cost_reps=1)
    res = gen.generate_on(slots, None, prompts[:1], 3, "ddtree", "auto", 0.0, seed, stop=[])
    table = slots.dev.table
    assert table.sizes == (0, 2) and set(table.seconds) == {1} and min(table.seconds[1]) > 0, table
    assert res[0].tokens == e.generate(prompts[0], 3, mode="ar", stop=[]).tokens, f"prompt {prompts[0]}"


@contextlib.contextmanager
def rows_as_runs_end(kept):
    """kept[slot] = DeviceRounds' drafter context rows of that slot (one array per layer) as its run ended, taken
    when the next round parks it: a parked slot's rounds write throwaway rows (its root at the park row, the rest of
    the tree's rows after it), so its context no longer holds its run's rows after they have run."""
    from numbaengine.device_round import DeviceRounds
    park, live = DeviceRounds._park, set()

    def keeping(dev):
        now = set(range(dev.shape.batch)) - dev.parked
        for b in live - now:
            kept[b] = [np.array(kv[b]) for kv in dev.ctx_kv]
        live.clear()
        live.update(now)
        park(dev)
    DeviceRounds._park = keeping
    try:
        yield kept
    finally:
        DeviceRounds._park = park


def coast_probes(rounds) -> int:
    """Rounds that draft among `rounds` when every choice is 0: one, then coasts of 1, 2, 4, ... rounds between."""
    probes, done, span = 0, 0, 1
    while done < rounds:
        probes, done, span = probes + 1, done + 1 + span, 2 * span
    return probes


def check_mixed_settings(env):
    """Runs of other settings sharing auto rounds without waiting for them to drain (ladder 0, 2, 4, a table that
    picks 4 nodes): an auto run starts them, a sampled ar run and a greedy fixed budget-2 run join, and all three
    decode in rounds of 3 slots. Each gives ar's tokens (Engine.generate, its temperature and seed); every round's
    trees have 4 drafted nodes (auto), none (ar: the root alone), 2 (budget 2), but for slots parked once their run
    ended (rounds launched ahead go on without them)."""
    from numbaengine.budget import CostTable
    from numbaengine.ddtree import Params
    from numbaengine.rounds import DeviceSlots
    e = sim_engine()
    rng = np.random.default_rng()
    seed = int(rng.integers(2 ** 31))
    slots = DeviceSlots(e.target, e.drafter, e.max_context, 3, table=CostTable((0, 2, 4), {3: (9.0, 9.0, 1.0)}),
                        ladder=(0, 2, 4), graphs=False)
    settings = (("ddtree", "auto", 0.0), ("ar", 16, 0.9), ("ddtree", 2, 0.0))
    runs = []
    for mode, budget, temperature in settings:
        run = Run(rng.integers(0, e.cfg.vocab_size, 3).tolist(), 4, set(), Params(mode, temperature, seed), budget)
        assert slots.fits(run, runs), f"{mode} budget {budget} does not join the auto rounds"
        slots.begin(run, runs)
        runs.append(run)
    launched, start = [], slots.dev.start         # each round's drafted nodes per slot, and the slots parked in it

    def recorded_start(size=None, scored=False):
        start(size, scored)
        launched.append(((slots.dev.base_target.ops.to_host(slots.dev.plan.tb.ntok)[:3] - 1).tolist(),
                         set(slots.dev.parked)))
    slots.dev.start = recorded_start

    def report(run, out):
        if isinstance(out, Exception):
            raise out
    gen.decode(slots, runs, report, gen.Timer(("prefill", "decode") + slots.PHASES))
    where = f"seed {seed} prompts {[r.ids for r in runs]}"
    want = [r.tokens for r in e.generate_batch([runs[0].ids, runs[2].ids], 4, mode="ar", stop=[])]
    want.insert(1, e.generate(runs[1].ids, 4, mode="ar", temperature=0.9, seed=seed, stop=[]).tokens)
    for r, w in zip(runs, want):
        assert r.tokens == w, f"{r.p.mode} budget {r.budget} {where}: {r.tokens} != ar {w}"
    trees = [4, 0, 2]                             # a parked slot (its run ended) runs the root alone
    assert any(n == trees for n, _ in launched) and all(
        n == [0 if b in parked else k for b, k in enumerate(trees)][:len(n)] for n, parked in launched), \
        f"{where}: {launched}"                    # (a smaller bucket once the last slots are parked)
    assert runs[0].picks.sizes and runs[1].picks is None and runs[2].picks is None, where


def check_staged_prefill(env):
    """Prompt pieces through the staging slot (the prefill graphs' path, eager under the simulator) == the pieces
    launched straight into their slot: slot 1's 6-token prompt in pieces [0, 4) and [4, 6) with slot 0's whole
    3-token prompt between them (the staging slot copies slot 1's rows back in); with graphs of 2 rows the first
    pieces run eagerly and the last through the staging slot. Slot 0 samples (temperature 0.8, a random seed, budget
    1), slot 1 is greedy. First tokens, latent and drafter context rows, and the next round's tokens."""
    from numbaengine.device_round import DeviceRounds, Shape
    e = sim_engine()
    rng = np.random.default_rng()
    a, c = rng.integers(0, e.cfg.vocab_size, 6).tolist(), rng.integers(0, e.cfg.vocab_size, 3).tolist()
    seed = int(rng.integers(2 ** 31))
    outs = []
    for rows in ((), DeviceRounds.prefill_rows, (2,)):
        dev = DeviceRounds(e.target, e.drafter, Shape(2, "ddtree", 2, 16), graphs=False)
        dev.prefill_rows = rows
        dev.prefill_part(1, a, 0, 4)
        firsts = (dev.prefill(0, c, 0, 0.8, seed, 1), dev.prefill(1, a, 1, start=4))
        cache = (np.array(dev.cache[:, 0, :3]), np.array(dev.cache[:, 1, :6]))
        ctx = (np.array(dev.ctx_kv[0][0, :3]), np.array(dev.ctx_kv[0][1, :6]))
        outs.append((rows, firsts, cache, ctx, dev.step()[:2].tolist()))
    (_, f, cache, ctx, step), where = outs[0], f"prompts {a} {c}, seed {seed}"
    for rows, f2, cache2, ctx2, step2 in outs[1:]:
        assert (f2, step2) == (f, step), f"{where}: graphs {rows}: {f2} {step2}, eager {f} {step}"
        for x, y in zip(cache, cache2):
            assert (x == y).all(), f"{where}: graphs {rows}: latent rows differ"
        for x, y in zip(ctx, ctx2):
            assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max(), f"{where}: graphs {rows}: drafter context"


def token_paths(tokens, parents, k) -> set:
    """The first k nodes of a tree (pop order) as their token paths from the root."""
    paths = []
    for i in range(k):
        paths.append(paths[parents[i]] + (int(tokens[i]),) if i else (int(tokens[0]),))
    return set(paths)


def check_probe_scores(env):
    """Budget auto's input: the node scores DeviceRounds.probe reads (path log-probabilities in pop order) give the
    host tree's expected accepted drafts at every ladder size for the same context, and probe_trees its nodes (the
    first pops up to a clear gap in path log-probability, as token paths), right after the prompt and after
    a probe's size-0 round and three coasting rounds (their rows kept in the backlog and written to the drafter
    context by the next probe's flush); the device and the numpy reference commit the same tokens meanwhile."""
    from test_backend_sim import pair_dirs

    from numbaengine import Engine
    from numbaengine.budget import prefix_accepts
    from numbaengine.ddtree import Params, decode_round, draft_trees, prefill
    from numbaengine.device_round import DeviceRounds, Shape
    dirs = pair_dirs("tiny")
    sim, host = (Engine.load(*dirs, backend=b, max_context=32) for b in ("sim", "numpy"))
    seed = int(np.random.default_rng().integers(2 ** 31))
    ids = np.random.default_rng(seed).integers(0, host.cfg.vocab_size, 5).tolist()
    ladder, p, timer = (0, 2, 4, 8), Params("ddtree"), gen.Timer()
    dev = DeviceRounds(sim.target, sim.drafter, Shape(1, "ddtree", max(ladder), 32, ladder), graphs=False)
    seq = prefill(0, ids, host.target, host.drafter, host.target.ops, p, 48)
    first, where = dev.prefill(0, ids, 0), f"seed {seed} prompt {ids}"
    assert first == seq.bonus, f"{where}: first token {first} != {seq.bonus}"
    for rounds in (0, 4):
        tree = draft_trees([seq], [max(ladder)], host.drafter, p, timer)[0]
        got, want = prefix_accepts(dev.probe()[0, 1:]), prefix_accepts(tree.scores[1:])
        assert len(want) == max(ladder) + 1 and np.isfinite(got[:len(want)]).all(), f"{where}: {got}"
        err = np.abs(got[list(ladder)] - want[list(ladder)]).max()   # bf16 rounding: up to 0.13% of want[-1];
        assert err <= 1e-2 * want[-1] + 1e-6, (                         # an unflushed backlog: 9-25% of it
            f"{where}, after {rounds} rounds: expected drafts per size {got[list(ladder)]} != host "
            f"{want[list(ladder)]}")
        tokens, parents = dev.probe_trees()          # hindsight's trees: the host's first k pops, as token paths
        gaps = np.flatnonzero(-np.diff(tree.scores[1:]) > 0.02)      # (pops closer than that may swap: bf16)
        k = 2 + int(gaps[-1]) if len(gaps) else 1
        got_paths, want_paths = (token_paths(t, par, k) for t, par in ((tokens[0], parents[0]),
                                                                         (tree.tokens, tree.parents)))
        assert got_paths == want_paths, f"{where}, after {rounds} rounds, first {k} pops: {got_paths} != {want_paths}"
        for i in range(4):                   # the probe's size-0 round, then 3 coasting ones (no probe)
            out = dev.step(0)[0]
            host_out = decode_round([seq], [0], host.target, host.drafter, host.target.ops, p, timer)[0]
            assert out[1:out[0] + 1].tolist() == host_out.tokens, f"{where}: round {rounds + i}"


SIM_PARTS = 3
SIM_COST = {"shared_rounds": 200, "chunked_prefill": 56, "sample_rows": 2, "buckets": 165, "auto": 205,
            "staged_prefill": 110, "mixed_settings": 210, "probe_scores": 60}
SIM_CASES = {
    "sample_rows": lambda env: check_sample_rows(env),
    "chunked_prefill": lambda env: check_chunked_prefill(env),
    "shared_rounds": lambda env: check_shared_rounds(env),
    "buckets": lambda env: check_buckets(env),
    "auto": lambda env: check_auto(env),
    "staged_prefill": lambda env: check_staged_prefill(env),
    "mixed_settings": lambda env: check_mixed_settings(env),
    "probe_scores": lambda env: check_probe_scores(env),
}

test_simulator = pytest.mark.slow(simulator_test(__name__))     # ~15 CPU minutes in all (SIM_COST)
