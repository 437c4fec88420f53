"""Rungs 3 and 4 of the correctness ladder: greedy DDTree / DFlash equal autoregressive decoding token for token;
sampled DDTree equals sampled autoregressive decoding for the same seed and matches the target's exact
distribution (chi-square); output rules (stop tokens, max_new_tokens, mask ids kept, context and budget errors)."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from numbaengine.backends import NUMPY
from numbaengine.drafter import load_drafter
from numbaengine.engine import Engine
from numbaengine.generate import generate, generate_batch
from numbaengine.reference import sample_ref
from numbaengine.weights.synth import synth_config, write_draft, write_target

stats = pytest.importorskip("scipy.stats", reason="a dev extra: pip install -e '.[dev]'")

SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4)
PROMPTS = [[5, 6, 7], [200, 2, 9, 41, 17], [8]]
N_NEW = 24
BLOCK = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A small K2-style target (vocab 256, 3 layers, INT4 experts) and a random 2-layer drafter of block 6."""
    root = tmp_path_factory.mktemp("pair")
    write_target(root / "target", synth_config("tiny", layers=3, **SMALL, vocab_size=256), seed=0)
    write_draft(root / "draft", root / "target", layers=2, block_size=BLOCK, seed=1, target_layer_ids=[0, 2])
    engine = Engine.load(root / "target", backend="numpy")
    return SimpleNamespace(root=root, engine=engine, target=engine.target,
                           drafter=load_drafter(root / "draft", engine.target, NUMPY))


class Oracle:
    """Drafter stand-in that knows each sequence's continuation (prompt + output): its logits peak at the known
    next tokens, so every round should accept the whole chain. Contexts are numbered in prefill order."""
    layer_ids = ()

    def __init__(self, sequences, vocab, block_size=BLOCK):
        self.sequences, self.vocab, self.block_size, self.made = sequences, vocab, block_size, 0

    def new_context(self, max_len):
        self.made += 1
        return SimpleNamespace(index=self.made - 1)

    def append(self, ctx, hidden, positions):
        pass

    def draft(self, ctx, bonus, start):
        full = self.sequences[ctx.index]
        logits = np.zeros((self.block_size - 1, self.vocab), np.float32)
        for j in range(1, self.block_size):
            if start + j < len(full):
                logits[j - 1, full[start + j]] = 12.0
        return logits


def run(pair, prompts, mode, drafter=None, budget=16, n=N_NEW, **kw):
    kw.setdefault("stop", [])
    return generate_batch(pair.target, drafter, None, prompts, n, mode=mode, budget=budget, **kw)


@pytest.fixture(scope="module")
def greedy_ar(pair):
    return [r.tokens for r in run(pair, PROMPTS, "ar")]


@pytest.mark.parametrize("budget", [1, 2, 8, 32, 128])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_ddtree_equals_ar(pair, greedy_ar, budget, batch):
    prompts, want = PROMPTS[:batch], greedy_ar[:batch]
    assert [r.tokens for r in run(pair, prompts, "ddtree", pair.drafter, budget)] == want
    oracle = Oracle([p + w for p, w in zip(prompts, want)], pair.target.cfg.vocab_size)
    results = run(pair, prompts, "ddtree", oracle, budget)
    assert [r.tokens for r in results] == want
    for r in results:                        # every round but the last accepts the whole drafted chain
        taus = [t for t, n in enumerate(r.stats["tau_hist"]) for _ in range(n)]
        assert max(taus) == min(budget + 1, BLOCK) and r.stats["tau_hist"][min(budget + 1, BLOCK)] >= r.stats[
            "rounds"] - 1


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_dflash_equals_ar(pair, greedy_ar, batch):
    prompts, want = PROMPTS[:batch], greedy_ar[:batch]
    assert [r.tokens for r in run(pair, prompts, "dflash", pair.drafter)] == want
    oracle = Oracle([p + w for p, w in zip(prompts, want)], pair.target.cfg.vocab_size)
    results = run(pair, prompts, "dflash", oracle)
    assert [r.tokens for r in results] == want
    assert all(len(r.stats["tau_hist"]) == BLOCK + 1 for r in results)      # tau reaches the block size


def test_ar_matches_target_argmax(pair, greedy_ar):
    """The AR reference itself: each token is the argmax of a fresh full forward over prompt + output so far."""
    prompt, out = PROMPTS[0], greedy_ar[0][:6]
    for i, t in enumerate(out):
        assert np.argmax(pair.engine.forward_logits(prompt + out[:i])[-1]) == t


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_ddtree_equals_sampled_ar(pair, temperature):
    kw = dict(temperature=temperature, seed=5)
    want = [r.tokens for r in run(pair, PROMPTS, "ar", **kw)]
    assert want != [r.tokens for r in run(pair, PROMPTS, "ar", temperature=temperature, seed=6)]
    for budget in (4, 32):
        assert [r.tokens for r in run(pair, PROMPTS, "ddtree", pair.drafter, budget, **kw)] == want
    assert [r.tokens for r in run(pair, PROMPTS, "dflash", pair.drafter, **kw)] == want
    oracle = Oracle([p + w for p, w in zip(PROMPTS, want)], pair.target.cfg.vocab_size)
    results = run(pair, PROMPTS, "ddtree", oracle, 8, **kw)
    assert [r.tokens for r in results] == want
    assert all(r.stats["tau_mean"] > 3 for r in results)                     # deep paths were walked


# --- distribution exactness ---------------------------------------------------------------------------------------

V_SMALL, GOF_PROMPT, GOF_N = 16, [3, 5, 7], 1500


def small_pair(root, dims=SMALL, **draft_dims):
    """A 16-token-vocabulary pair, so the joint law of the first three tokens has 4096 cells."""
    cfg = synth_config("tiny", layers=2, quant="none", **{**dims, "vocab_size": V_SMALL})
    write_target(root / "target", cfg, seed=0)
    write_draft(root / "draft", root / "target", layers=1, block_size=4, seed=1, target_layer_ids=[1], **draft_dims)
    engine = Engine.load(root / "target", backend="numpy")
    return SimpleNamespace(root=root, engine=engine, target=engine.target,
                           drafter=load_drafter(root / "draft", engine.target, NUMPY))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_pair(tmp_path_factory.mktemp("small"))


def exact_joint(engine, temperature):
    """p(t1, t2, t3 | prompt) f64[V, V, V] at `temperature`, from the target's logits over every 2-token prefix."""
    p = np.zeros((V_SMALL,) * 3)
    for t1, t2 in itertools.product(range(V_SMALL), repeat=2):
        logits = engine.forward_logits(GOF_PROMPT + [t1, t2])[-3:].astype(np.float64) / temperature
        q = np.exp(logits - logits.max(axis=1, keepdims=True))
        q /= q.sum(axis=1, keepdims=True)
        p[t1, t2] = q[0, t1] * q[1, t2] * q[2]
    return p


def gof_pvalue(small, temperature, ops=NUMPY):
    """Chi-square p-value of GOF_N DDTree samples of (t1, t2, t3) against the exact law (cells with expected
    count < 5 pooled). Token 1 comes from the prefill, token 2 from the root, token 3 from a tree node whenever
    token 2 matched a depth-1 child (budget 24 over 16 tokens: almost always)."""
    results = generate_batch(small.target, small.drafter, None, [GOF_PROMPT] * GOF_N, 3, mode="ddtree", budget=24,
                             temperature=temperature, seed=11, stop=[], ops=ops)
    return gof_of(small, temperature, results)


def gof_of(small, temperature, results, min_walked=0.9):
    """Chi-square p-value of sampled continuations (results of GOF_PROMPT, 3 tokens each) against the exact law;
    at least `min_walked` of them must have gone through a tree walk (tau >= 2 in some round)."""
    counts = np.zeros((V_SMALL,) * 3)
    for r in results:
        counts[tuple(r.tokens)] += 1
    walked = np.mean([len(r.stats["tau_hist"]) > 2 for r in results])      # some round had tau >= 2
    assert walked > min_walked, f"the tree walk was not exercised enough ({walked:.2f} of the samples)"
    expected = exact_joint(small.engine, temperature).ravel() * GOF_N
    big = expected >= 5
    observed = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
    expected = np.append(expected[big], expected[~big].sum()).astype(np.float64)
    # the law sums to 1 up to float32 rounding; scipy's chisquare wants equal sums to ~1.5e-8 relative
    assert abs(expected.sum() - GOF_N) < 1e-4 * GOF_N, expected.sum()
    return stats.chisquare(observed, expected * (observed.sum() / expected.sum())).pvalue


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_ddtree_distribution_exact(small, temperature):
    """Fixed seed, so the outcome is deterministic (measured p = 0.82 at T 0.7, 0.84 at T 1.0). Power: 1500
    samples over ~60-80 pooled cells give p = 1.4e-3 for a temperature 15% too high and p ~ 1e-134 for the
    biased sampler below."""
    assert gof_pvalue(small, temperature) > 1e-3


def test_gof_detects_biased_sampler(small):
    """The same check fails when the sampler applies the temperature twice (logits / T^2)."""
    def biased(logits, temperature, seed, seq, pos, out):
        return sample_ref(logits / np.float32(temperature), temperature, seed, seq, pos, out)
    ops = SimpleNamespace(**{**vars(NUMPY), "sample": biased})
    assert gof_pvalue(small, 0.7, ops) < 1e-6


def test_noise_log_bound():
    """The sampler's skip test (kernels.sample._bound_skips) bounds each id's noise -log(-log u) <= -log(1 - u) by
    (clz(2^23 - 1 - k) - 8) ln 2, integer work for u = (k + 1/2) 2^-23: above the true value for every one of the
    2^23 draws (exactness) and within ln 2 of it (the skip stays useful)."""
    k = np.arange(2 ** 23, dtype=np.int64)
    u = (k + 0.5) / 2.0 ** 23
    j = (2 ** 23 - 1) - k
    clz = 32 - np.where(j > 0, np.floor(np.log2(np.maximum(j, 1))) + 1, 0)      # 32-bit count of leading zeros
    bound = (clz - 8) * np.float64(np.float32(0.6931472))
    true = -np.log1p(-u)
    assert (bound >= true).all() and (bound - true <= np.log(2) + 1e-6).all()
    assert (-np.log(-np.log(u)) <= true + 1e-12).all()


def test_noise_draw_below_one():
    """Every id's uniform draw is strictly inside (0, 1), so its Gumbel noise is finite: with 24 bits the largest
    hash rounded to u = 1.0 (infinite noise: that id won at any logit). Regression: (seed 7, seq 0, pos 1000),
    id 871885 drew 1.0; and a row where that id has the lowest logit by far must not pick it."""
    from numbaengine.reference import gumbel, unit
    u = unit(np.array([0, 2 ** 64 - 1, 2 ** 63, 2 ** 41 - 1], np.uint64))
    assert (u > 0).all() and (u < 1).all(), u
    g = gumbel(7, 0, 1000, 871886)
    assert np.isfinite(g).all() and g[871885] < 30
    logits = np.zeros((1, 871886), np.float32)
    logits[0, 871885] = -100
    seq, pos = np.zeros(1, np.int32), np.full(1, 1000, np.int32)
    assert sample_ref(logits, 1.0, 7, seq, pos, np.empty(1, np.int32))[0] != 871885


# --- output rules ---------------------------------------------------------------------------------------------------

def test_stop_token_ends_output_inside_a_round(pair, greedy_ar):
    ref = greedy_ar[0]
    k = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    oracle = Oracle([PROMPTS[0] + ref], pair.target.cfg.vocab_size)
    for drafter in (pair.drafter, oracle):
        oracle.made = 0
        r = run(pair, PROMPTS[:1], "ddtree", drafter, 16, stop=[ref[k], 10**6])[0]
        assert r.tokens == ref[:k + 1] and r.stats["stop_reason"] == "stop"
    assert run(pair, PROMPTS[:1], "ar", stop=[ref[0]])[0].tokens == ref[:1]       # stop on the prefill token


def test_stop_default_is_eos(pair, monkeypatch):
    ref = run(pair, PROMPTS[:1], "ar")[0].tokens
    monkeypatch.setattr(type(pair.target.cfg), "eos_ids", property(lambda self: (ref[2],)))
    assert run(pair, PROMPTS[:1], "ddtree", pair.drafter, stop=None)[0].tokens == ref[:ref.index(ref[2]) + 1]


@pytest.mark.parametrize("n", [1, 2, 5, 7, 13])
def test_max_new_tokens_exact(pair, greedy_ar, n):
    oracle = Oracle([PROMPTS[0] + greedy_ar[0]], pair.target.cfg.vocab_size)
    r = run(pair, PROMPTS[:1], "ddtree", oracle, 32, n=n)[0]
    assert r.tokens == greedy_ar[0][:n] and r.stats["stop_reason"] == "length"
    assert r.stats["new_tokens"] == n


def test_mask_id_tokens_are_kept(pair, greedy_ar, tmp_path):
    ref = greedy_ar[0]
    write_draft(tmp_path / "draft", pair.root / "target", layers=2, block_size=BLOCK, seed=1, target_layer_ids=[0, 2],
                mask_token_id=ref[3])
    drafter = load_drafter(tmp_path / "draft", pair.target, NUMPY)
    assert drafter.mask_id == ref[3]
    assert run(pair, PROMPTS[:1], "ddtree", drafter, 8)[0].tokens == ref


def test_full_context_stops_cleanly(pair, greedy_ar):
    room = 10
    for mode, budget in (("ar", 0), ("ddtree", 8), ("dflash", 0)):
        r = run(pair, PROMPTS[:1], mode, pair.drafter, budget, max_context=len(PROMPTS[0]) + room)[0]
        assert r.tokens == greedy_ar[0][:room + 1] and r.stats["stop_reason"] == "context"


def test_stats(pair):
    r = run(pair, PROMPTS[:1], "ddtree", pair.drafter, 8)[0]
    s = r.stats
    assert sum(s["tau_hist"]) == s["rounds"] and s["new_tokens"] == N_NEW
    assert sum(t * n for t, n in enumerate(s["tau_hist"])) >= N_NEW - 1
    assert set(s["phase_s"]) == {"draft", "build", "verify", "walk", "commit"}
    assert s["prefill_s"] > 0 and s["tokens_per_s"] > 0 and s["prompt_tokens"] == 3


@pytest.mark.parametrize("kw,match", [
    (dict(budget=-1), "^budget: -1 is not an integer in 0..1024"),
    (dict(budget=1025), "^budget: 1025 is not an integer in 0..1024"),
    (dict(budget=2.5), "^budget: 2.5 is not"),
    (dict(mode="beam"), "^mode:"),
    (dict(prompt=[2] * 50, max_context=50), "^prompt: 50 tokens do not fit the context of 50"),
    (dict(prompt=[]), "^prompt: empty"),
    (dict(prompt=[256]), "^prompt: token id 256 is outside the vocabulary"),
    (dict(prompt="hello"), "^prompt: 'hello' is not a list of token ids"),
    (dict(n=0), "^max_new_tokens:"),
    (dict(temperature=-1.0), "^temperature:"),
    (dict(temperature=float("nan")), "^temperature: must be a finite number"),
    (dict(temperature=float("inf")), "^temperature: must be a finite number"),
    (dict(drafter=None), "needs a draft model"),
])
def test_bad_arguments(pair, kw, match):
    args = dict(prompt=[5, 6], n=4, mode="ddtree", budget=4, drafter=pair.drafter)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        generate(pair.target, args.pop("drafter"), None, args.pop("prompt"), args.pop("n"), **args)


def test_prompt_at_context_edge(pair):
    r = generate(pair.target, pair.drafter, None, [2] * 49, 4, budget=4, max_context=50, stop=[])
    assert len(r.tokens) == 2 and r.stats["stop_reason"] == "context"    # prefill token + one AR-sized round


# --- parallel branches ------------------------------------------------------------------------------------------------

def test_branches_are_joined_before_their_outputs_are_read(pair):
    """ops.branch() lets the kernel backends run a chain beside what follows (a second stream, a parallel graph
    branch); the reference runs it in order, so a missing join would race only on a GPU. Here a recording table
    keeps each branch open until join() and fails the ops that read a branch's output (the latent rows: attention
    and cache reads; the shared expert: the MoE's combine, which joins its `after`) while one is open, and every
    forward, draft and context append must end with none open."""
    open_ = []

    class Side:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            open_.append(self)
            return False

        def join(self):
            if self in open_:
                open_.remove(self)

    def reads(name, after_joins=False):
        def op(*args, **kw):
            if after_joins and kw.get("after") is not None:
                kw["after"].join()
            assert not open_, f"{name} read while {len(open_)} branch(es) were still open"
            return getattr(NUMPY, name)(*args, **kw)
        return op
    ops = SimpleNamespace(**{**vars(NUMPY), "branch": Side, "latent_attention": reads("latent_attention"),
                             "cache_read": reads("cache_read"), "moe": reads("moe", after_joins=True)})
    target = pair.target.with_ops(ops)
    drafter = pair.drafter.with_ops(ops, target)
    ids = np.arange(5, dtype=np.int32) + 7
    for form in ("absorbed", "naive"):
        target.forward(ids, np.arange(5, dtype=np.int32), target.new_cache(32), hidden_layers=(0, 2), form=form)
        assert not open_, f"{form} forward left a branch open"
    ctx = drafter.new_context(32)
    _, hidden = target.forward(ids, np.arange(5, dtype=np.int32), target.new_cache(32), hidden_layers=(0, 2))
    drafter.append(ctx, hidden, np.arange(5, dtype=np.int32))
    assert not open_, "the drafter-context append left a branch open"
    drafter.draft(ctx, 3, 5)
    assert not open_, "the draft left a branch open"


def test_generate_prefills_in_the_servers_pieces(monkeypatch):
    """Engine.generate asks its rounds for prompt pieces of rounds.PREFILL_CHUNK tokens (the server's --prefill-chunk
    default), or what prefill_chunk says: a request's pieces, and so its tokens, are the same offline and served."""
    from numbaengine import Engine
    from numbaengine.rounds import PREFILL_CHUNK
    from numbaengine.serve import parser
    engine, asked = Engine.load(), []
    real = engine.rounds
    monkeypatch.setattr(engine, "rounds", lambda batch, chunk=None, **kw: asked.append(chunk) or real(batch, chunk, **kw))
    engine.generate("def f(", 2, mode="ar")
    engine.generate("def f(", 2, mode="ar", prefill_chunk=7)
    assert asked == [PREFILL_CHUNK, 7]
    assert parser().parse_args([]).prefill_chunk == PREFILL_CHUNK
