"""DeviceSlots.overlap: the next round launched before the host handles this one's tokens. A toy device decodes by a
rule of each slot's state (the way the GPU round reads and advances lengths and bonus), so the loop's bookkeeping
can be checked on the CPU: the same tokens with and without overlap, whatever joins, ends or is cut short, and a
run that ends parked before the round launched ahead for the others."""
import numpy as np
import pytest

from numbaengine import generate as gen
from numbaengine.budget import LADDER, CostTable
from numbaengine.ddtree import Params
from numbaengine.device_round import Shape
from numbaengine.rounds import DeviceSlots, Run, ends

L = 4          # most tokens a round commits


class ToyDev:
    """DeviceRounds stand-in: slot b at committed length n with bonus t commits tau = 1 + (n + t) % L tokens, token
    i of them (31 t + 7 (n + i) + seed_b) % 997. start() computes the round from the slot state and advances it, as
    the device does; finish() hands the round's out_tokens over. log: "start", "finish", "prefill b"."""

    def __init__(self, batch, ladder=()):
        self.shape = Shape(batch, "ddtree", max(ladder) if ladder else L - 1, 4096, ladder)
        self.gpu_s, self.log = 0.0, []
        self.length, self.bonus, self.seed = np.zeros(batch, int), np.zeros(batch, int), np.zeros(batch, int)
        self.parked, self.out, self.starts_parked = set(range(batch)), None, []

    def prefill(self, b, ids, seq_index, temperature=0.0, seed=0, budget=None, start=0):
        self.log.append(f"prefill {b}")
        self.parked.discard(b)
        self.length[b], self.seed[b] = len(ids), sum(ids) % 101
        self.bonus[b] = (self.seed[b] * 3 + len(ids)) % 997
        return int(self.bonus[b])

    def retire(self, slots):
        self.log += [f"retire {b}" for b in slots]
        self.parked |= set(slots)

    def bucket(self):
        """DeviceRounds.bucket: the smallest power of two (or the batch) holding every slot not parked."""
        top = max(set(range(self.shape.batch)) - self.parked, default=0) + 1
        return min(self.shape.batch, 1 << (top - 1).bit_length())

    def start(self, size=None, scored=False):
        assert self.out is None, "a round launched before the last one was read"
        self.log.append("start scored" if scored else "start")
        self.starts_parked.append(frozenset(self.parked))
        out = np.zeros((self.shape.batch, L + 2), np.int32)
        for b in range(self.shape.batch):
            if b in self.parked:
                continue
            n, t = self.length[b], self.bonus[b]
            tau = 1 + (n + t) % L
            toks = [(31 * t + 7 * (n + i) + self.seed[b]) % 997 for i in range(tau)]
            out[b, 0], out[b, 1:tau + 1] = tau, toks
            self.length[b], self.bonus[b] = n + tau, toks[-1]
        self.out = out

    def probe(self):
        """Budget auto's first half: every pop certain (log-probability 0), each tree the chain of the tokens its slot
        goes on to commit (so what hindsight learns changes no choice)."""
        self.log.append("probe")
        N = self.shape.budget + 1
        self.trees = np.zeros((self.shape.batch, N), np.int32)
        for b in range(self.shape.batch):
            n, t, chain = self.length[b], self.bonus[b], [self.bonus[b]]
            while len(chain) < N:
                tau = 1 + (n + t) % L
                chain += [(31 * t + 7 * (n + i) + self.seed[b]) % 997 for i in range(tau)]
                n, t = n + tau, chain[-1]
            self.trees[b] = chain[:N]
        return self.scores()

    def probe_trees(self):
        N = self.shape.budget + 1
        return self.trees, np.tile(np.arange(-1, N - 1, dtype=np.int32), (self.shape.batch, 1))

    def scores(self):
        return np.zeros((self.shape.batch, self.shape.budget + 1))

    def finish(self):
        self.log.append("finish")
        out, self.out = self.out, None
        return out

    def step(self, size=None, scored=False):
        self.start(size, scored)
        return self.finish()


def decode(overlap, prompts, max_new, stop_after=None, join=None, batch=4, auto=False, trees=False):
    """Decode runs over ToyDev slots; stop_after {run index: tokens}: report ends that run as a stop string would
    (not foreseen by the rounds); join: (at which pass, or "stop": the pass a run is stopped so, prompt, max_new)
    of a run that arrives later; auto: budget auto with a table where size 0 pays (rounds coast after a probe), or
    with trees, one where size 2 pays (a probe, then scored rounds chosen from the last one's drafts).
    -> (tokens of each run, the device's log, the slots)."""
    ladder, budget = ((0, 2), "auto") if auto else ((), L - 1)
    slots = DeviceSlots(None, None, 4096, batch, overlap=overlap, ladder=ladder or LADDER,
                        table=CostTable((0, 2), {batch: (1.0, 1.5 if trees else 9.0)}) if auto else None)
    slots.dev = ToyDev(batch, ladder)
    slots.free = list(range(batch))
    runs = []
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        runs.append(Run(p, n, {5}, Params(mode="ddtree"), budget, index=i))
        slots.begin(runs[-1], runs[:-1])
    everyone, passes = list(runs), [0]

    def report(run, out):
        if isinstance(out, Exception):
            raise out
        if stop_after and run.index in stop_after and len(run.tokens) >= stop_after[run.index]:
            run.stop_reason = "stop"

    def admit(waiting, live):
        passes[0] += 1
        stopped = any(r.stop_reason == "stop" for r in everyone)
        if join is not None and len(everyone) == len(prompts) and (passes[0] == join[0] or join[0] == "stop" and
                                                                    stopped):
            run = Run(join[1], join[2], {5}, Params(mode="ddtree"), budget, index=len(everyone))
            slots.begin(run, [r for r in waiting + live if r.stop_reason is None])
            everyone.append(run)
            return [run]
        return [] if waiting or live else None
    gen.decode(slots, runs, report, gen.Timer(("prefill", "decode") + slots.PHASES), admit)
    return [r.tokens for r in everyone], slots.dev.log, slots


def launches(log) -> list:
    """The log's starts, finishes and prefills (no retires)."""
    return [x for x in log if not x.startswith("retire")]


CASES = {
    "lengths": dict(prompts=[[1, 2], [3, 4, 5], [6], [7, 8]], max_new=[9, 20, 14, 3]),
    "stop strings": dict(prompts=[[1, 2], [3, 4, 5], [6]], max_new=[30, 30, 30], stop_after={0: 4, 2: 11}),
    "join": dict(prompts=[[1, 2], [3, 4, 5]], max_new=[25, 6], join=(4, [9, 9, 9, 9], 12)),
    "join a freed slot": dict(prompts=[[1, 2], [3, 4, 5]], max_new=[40, 40], stop_after={1: 3},
                              join=("stop", [2], 10), batch=2),
    "auto, coasting": dict(prompts=[[1, 2], [3, 4, 5], [6]], max_new=[60, 45, 50], auto=True),
    "auto, join and stop": dict(prompts=[[1, 2], [3, 4, 5]], max_new=[60, 60], stop_after={1: 20},
                                join=(9, [7, 7], 30), auto=True),
    "auto, scored trees": dict(prompts=[[1, 2], [3, 4, 5], [6]], max_new=[60, 45, 50], auto=True, trees=True),
    "auto, scored trees, join and stop": dict(prompts=[[1, 2], [3, 4, 5]], max_new=[60, 60], stop_after={1: 20},
                                              join=(9, [7, 7], 30), auto=True, trees=True),
}


@pytest.mark.parametrize("case", CASES)
def test_overlap_same_tokens(case):
    """Every run's tokens with overlap == without; rounds were launched ahead (a start right after a finish, with no
    prefill between), and never two without a finish between (ToyDev asserts)."""
    want, plain_log, _ = decode(False, **CASES[case])
    got, log, slots = decode(True, **CASES[case])
    plain_log, log = launches(plain_log), launches(log)
    assert got == want, f"{case}: {got} != {want}"
    starts = sum(x.startswith("start") for x in log)
    ahead = sum(a == "finish" and b.startswith("start") for a, b in zip(log, log[1:]))
    assert ahead > 0 and ahead < starts, f"{case}: {log}"
    assert not plain_log[-1].startswith("start") and all(a.startswith("start") for a, b in zip(plain_log, plain_log[1:])
                                                         if b == "finish"), plain_log
    assert all(len(t) <= n for t, n in zip(got, CASES[case]["max_new"] + [99])), got
    if CASES[case].get("auto"):        # the same coast while nobody joins or leaves early (then a probe may come a
        #                                  round later: the round launched ahead coasted before the change was seen)
        alone = "join" not in CASES[case] and "stop_after" not in CASES[case]
        assert log.count("probe") > 0 and (not alone or log.count("probe") == plain_log.count("probe")), log
    if CASES[case].get("trees"):       # after the first probe, rounds chosen from the last one's drafts, ahead
        assert log.count("start scored") > log.count("probe"), log
        assert any(a == "finish" and b == "start scored" for a, b in zip(log, log[1:])), log


def test_overlap_no_round_ahead_of_an_end():
    """A run that reaches max_new, a stop token or its last cache row is parked before the next round is launched
    ahead for the others (it never decodes an extra round), and the last round of generate leaves nothing
    running."""
    want, _, _ = decode(False, prompts=[[1, 2], [3]], max_new=[4, 20])
    got, log, slots = decode(True, prompts=[[1, 2], [3]], max_new=[4, 20])
    assert got == want and slots.ahead is None and slots.dev.out is None and launches(log)[-1] == "finish", log
    end = next(i for i, x in enumerate(log) if x == "retire 0")
    assert log[end - 1:end + 3] == ["finish", "retire 0", "start", "retire 0"], log   # parked, then launched ahead
    assert 0 in slots.dev.starts_parked[log[:end].count("start")], slots.dev.starts_parked


def test_ends_matches_push():
    """ends() foresees exactly what generate.push decides (stop token, max_new, cache rows), for random rounds."""
    rng = np.random.default_rng()
    seed = int(rng.integers(2 ** 31))
    rng = np.random.default_rng(seed)
    for _ in range(500):
        run = Run([1], int(rng.integers(1, 12)), {int(rng.integers(0, 8))}, Params(), 4)
        run.tokens = rng.integers(0, 8, int(rng.integers(0, run.max_new))).tolist()
        run.limit = int(rng.integers(4, 30))
        run.seq = type("Seq", (), {"start": int(rng.integers(0, run.limit + 1))})()
        new = rng.integers(0, 8, int(rng.integers(1, 5))).tolist()
        said = ends(run, new)
        gen.push(run, new)
        assert said == (run.stop_reason is not None), f"seed {seed}: {run.tokens} {new} {run.stop_reason}"


def test_build_waits_for_the_round_ahead():
    """Remaking the rounds (another shape, or the same one reset) first reads the round launched ahead, so that no
    slot is reset under it."""
    slots = DeviceSlots(None, None, 4096, 2, overlap=True)
    dev = ToyDev(2)
    slots.cache[dev.shape] = slots.dev = dev
    dev.prefill(0, [1, 2], 0)
    dev.start()
    slots.ahead = []
    slots.build(dev.shape)
    assert launches(dev.log)[-1] == "finish" and dev.out is None and slots.ahead is None, dev.log
