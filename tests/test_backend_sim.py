"""Rung 6 of the correctness ladder: the kernel backend end to end equals the numpy backend. On the CUDA simulator
(backend `sim`, a child process, tiny shapes) and on a GPU (backend `cuda`, marked gpu): prefill logits
(Engine.forward_logits: absorbed MLA over the prompt on the kernels, naive on the reference), greedy
autoregressive decoding (Engine.generate, absorbed MLA, sampling kernel,
cache commit) and a tree verify (absorbed MLA with a packed tree mask, hidden features).

Tolerance: |logits - reference| <= 1e-2 * max |reference| (hidden features likewise). The kernels round on
purpose: the MoE experts take bf16 activations (W4A16, kernels/moe.py) and the absorbed MLA rounds q and
the softmax weights to bf16 (kernels/mla.py); dense GEMMs on large weights take bf16 activations too (kernels/gemm.py
XS_DEFAULT), on small weights (these tests' models) hi + lo parts (SMALL_XS, ~1e-5), as the router's
logits and MLA's per-head products. Measured on the simulator and an H200: 1e-3 .. 3e-3 (logits and hidden); with
bf16 activations in the small GEMMs too, 1.1e-2 once (H200, tiny, prefill).
Greedy tokens must be equal up to the first step where the reference's top-2 logits are within that tolerance
(a near-tie may flip); every kernel token must be a near-argmax of the reference given the same prefix. Logit
checks redraw inputs whose reference routing has a near-tie between the k-th and (k+1)-th expert (ROUTE_TIE).
"""
import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from cudasim import f64_lines, ptx_or_skip, simulator_test
from test_ptx import cpu_compute_capability  # noqa: F401  (fixture: sm_90 for device functions without a GPU)

TOL = 1e-2
ROUTE_TIE = 1e-3   # a token whose reference expert scores (sigmoid + bias) have the k-th and (k+1)-th this close is a
#   routing near-tie: the kernels' rounding may pick the other expert there and move the logits far more than TOL
#   (seen on the simulator: margin 3.5e-4, tree-verify logits 0.52 apart; a margin over the ungrouped scores, a proxy
#   with expert groups). Logit checks draw such inputs again (at most DRAWS times), as the greedy checks forgive a
#   near-tie of the logits.
DRAWS = 5
# tiny dims inside the kernels' limits (GEMM k % 32, MoE H and I % 64, MLA latent % 32 and kv_lora % 64): the
# simulator spends ~1 ms per simulated thread, and these keep a forward at a few thousand threads per launch
TINY = dict(hidden_size=128, intermediate_size=64, moe_intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
            v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, vocab_size=128)
# a wider model for the GPU: several blocks per GEMM, k-splits, 16 experts in 4 groups, 8 heads
WIDE = dict(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, vocab_size=4096)
# K2's 64 heads and 576-wide latent: MLA on kernels/mla_wg.py (warpgroup MMA) on an sm_90 GPU
WIDE64 = dict(WIDE, num_attention_heads=64, num_key_value_heads=64)
DIMS = {"tiny": TINY, "wide": WIDE, "wide64": WIDE64}


CHECKPOINT_SEEDS = {}        # dims -> seed of the random checkpoint, for failure messages


def write_pair(d, dims, seed):
    """A 2-layer checkpoint (dense layer 0, INT4 MoE layer 1) in d/target and a 1-layer DFlash drafter (block 4) in
    d/draft, both from seed; returns the two folders."""
    from numbaengine.weights.synth import synth_config, write_draft, write_target
    target, draft = os.path.join(d, "target"), os.path.join(d, "draft")
    write_target(target, synth_config("tiny", layers=2, quant="int4", **DIMS[dims]), seed=seed)
    write_draft(draft, target, layers=1, block_size=4, seed=seed + 1,
                **(dict(heads=2, kv_heads=1, head_dim=32, intermediate=64) if dims == "tiny" else {}))
    return target, draft


@functools.cache
def pair_dirs(dims="tiny"):
    """write_pair in a temporary folder, random seed (printed in failure messages)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    d = tempfile.mkdtemp(prefix=f"backend_{dims}_")
    atexit.register(shutil.rmtree, d, True)
    CHECKPOINT_SEEDS[dims] = seed
    return write_pair(d, dims, seed)


@functools.cache
def engines(backend, dims="tiny"):
    from numbaengine import Engine
    target, draft = pair_dirs(dims)
    return Engine.load(target, draft, backend="numpy"), Engine.load(target, draft, backend=backend)


def seeds(dims, seed):
    return f"(checkpoint seed {CHECKPOINT_SEEDS[dims]}, input seed {seed})"


def assert_close(name, got, ref, where):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and np.isfinite(got).all(), f"{name}: shape {got.shape} / non-finite values"
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= TOL, f"{name} {where}: max error {err:.2e} of max |reference| > {TOL}"
    return err


def selection_margins(scores, top_k, n_group, topk_group):
    """Per token, the smallest gap the grouped top-k router (reference.router_ref) decides on: between the
    topk_group-th and next group score (sum of a group's two best) and between the k-th and next expert of the kept
    groups. scores f64[n, E] (sigmoid + bias) -> f64[n]. (The plain top-k gap over all experts misses both: a
    wide64 verify token with a 3.6e-4 gap inside its groups passed a 7.6e-2 global gap and flipped an expert.)"""
    n, E = scores.shape
    grouped = scores.reshape(n, n_group, E // n_group)
    gap = np.full(n, np.inf)
    if n_group > 1:
        group = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)                             # [n, n_group]
        ranked = np.sort(group, axis=1)
        gap = ranked[:, -topk_group] - ranked[:, -topk_group - 1]
        kept = np.argsort(-group, axis=1, kind="stable")[:, :topk_group]
        masked = np.full_like(grouped, -np.inf)
        rows = np.arange(n)[:, None]
        masked[rows, kept] = grouped[rows, kept]
        scores = masked.reshape(n, E)
    s = np.sort(scores, axis=1)
    return np.minimum(gap, s[:, -top_k] - s[:, -top_k - 1])


@contextlib.contextmanager
def routing_margins(ops):
    """While open, the reference op table's router appends each call's smallest selection margin
    (selection_margins) to the yielded list."""
    from numbaengine.weights.dtypes import bf16_to_f32
    margins, router = [], ops.router

    def recording(x, w_gate, bias, top_k, n_group, topk_group, *rest):
        s = 1 / (1 + np.exp(-(x.astype(np.float64) @ bf16_to_f32(w_gate).astype(np.float64).T))) + bias
        margins.append(float(selection_margins(s, top_k, n_group, topk_group).min()))
        return router(x, w_gate, bias, top_k, n_group, topk_group, *rest)
    ops.router = recording
    try:
        yield margins
    finally:
        ops.router = router


def untied(ref, draw):
    """draw(seed) (running the reference engine `ref`) with fresh input seeds until the reference routing has no
    near-tie (ROUTE_TIE) -> (seed, draw's result)."""
    for _ in range(DRAWS):
        seed = int(np.random.SeedSequence().entropy % 2**31)
        with routing_margins(ref.target.ops) as margins:
            out = draw(seed)
        if min(margins, default=np.inf) >= ROUTE_TIE:
            return seed, out
    raise AssertionError(f"{DRAWS} input draws all had a routing near-tie (< {ROUTE_TIE}): lower ROUTE_TIE?")


def check_prefill(backend, dims="tiny", n=5):
    """Engine.forward_logits of fresh random tokens (one prefill in each backend's prefill_form)."""
    ref, dev = engines(backend, dims)

    def draw(seed):
        tokens = np.random.default_rng(seed).integers(0, ref.cfg.vocab_size, n)
        return tokens, ref.forward_logits(tokens)
    seed, (tokens, want) = untied(ref, draw)
    got = dev.forward_logits(tokens)
    assert isinstance(got, np.ndarray)
    return assert_close("prefill logits", got, want, seeds(dims, seed))


def check_prefill_draw(backend, checkpoint_seed, input_seed, dims="tiny", n=5):
    """check_prefill on one fixed draw (a regression case next to the random ones)."""
    from numbaengine import Engine
    with tempfile.TemporaryDirectory() as d:
        target, draft = write_pair(d, dims, checkpoint_seed)
        ref, dev = Engine.load(target, draft, backend="numpy"), Engine.load(target, draft, backend=backend)
        tokens = np.random.default_rng(input_seed).integers(0, ref.cfg.vocab_size, n)
        return assert_close("prefill logits", dev.forward_logits(tokens), ref.forward_logits(tokens),
                            f"(checkpoint seed {checkpoint_seed}, input seed {input_seed})")


def check_decode(backend, dims="tiny", prompt_lens=(2,), new=3, mode="ar", budget=0, temperature=0.0,
                 max_context=4096):
    """Engine.generate_batch on both backends from fresh random prompts (one per length, decoded together: the
    kernel backends run them as one batched device round). Greedy: every kernel token is a near-argmax of the
    reference given the kernel's own prefix, and the outputs are equal unless a near-tie flipped. Sampled: equal
    outputs are not guaranteed across backends (a near-tie of perturbed logits), so only validity is checked.
    A failed check is redrawn (fresh prompts, at most DRAWS) only when the reference routing of that draw had a
    near-tie (ROUTE_TIE: a decode makes many routing decisions, so redrawing every near-tie would redraw most runs);
    a failure without one fails the test."""
    ref, dev = engines(backend, dims)
    for _ in range(DRAWS):
        seed = int(np.random.SeedSequence().entropy % 2**31)
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, ref.cfg.vocab_size, n).tolist() for n in prompt_lens]
        kw = dict(mode=mode, budget=budget, temperature=temperature, seed=seed, stop=[])
        ref.max_context = dev.max_context = max_context
        try:
            with routing_margins(ref.target.ops) as margins:
                got_r, want_r = dev.generate_batch(prompts, new, **kw), ref.generate_batch(prompts, new, **kw)
                checks = [ref.forward_logits(p + g.tokens[:-1])[len(p) - 1:] if not temperature else None
                          for p, g in zip(prompts, got_r)]                      # reference given the kernel's prefix
        finally:
            ref.max_context = dev.max_context = 4096
        try:
            return _decode_agrees(got_r, want_r, checks, f"{mode} {seeds(dims, seed)}")
        except AssertionError:
            if min(margins, default=np.inf) >= ROUTE_TIE:
                raise
    raise AssertionError(f"{mode}: {DRAWS} draws failed, each with a routing near-tie (< {ROUTE_TIE})")


def _decode_agrees(got_r, want_r, checks, where):
    """check_decode's assertions -> (kernel tokens, reference tokens) per prompt."""
    gots, wants = [r.tokens for r in got_r], [r.tokens for r in want_r]
    for got, want, g, w, logits in zip(gots, wants, got_r, want_r, checks):
        assert len(got) == len(want) and g.stats["stop_reason"] == w.stats["stop_reason"], \
            f"{where}: {len(got)} tokens ({g.stats['stop_reason']}), reference {len(want)} ({w.stats['stop_reason']})"
        if logits is None:                   # sampled: validity only
            continue
        scale = np.abs(logits).max()
        for i, t in enumerate(got):
            gap = logits[i].max() - logits[i, t]
            assert gap <= TOL * scale, f"{where} step {i}: token {t} is {gap:.3g} below the reference argmax"
        if got != want:
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            top2 = np.sort(logits[i])[-2:]
            assert top2[1] - top2[0] <= TOL * scale, f"{where}: tokens {got} != reference {want} at step {i}"
    return gots, wants


def check_greedy(backend, dims="tiny", prompt_len=2, new=3):
    """Engine.generate(mode='ar', temperature 0) on both backends from a fresh random prompt."""
    return check_decode(backend, dims, (prompt_len,), new)


def check_verify(backend, dims="tiny", prompt_len=2):
    """A tree of 4 nodes (root, two siblings, a grandchild) over a committed prompt: absorbed MLA with a packed
    mask, logits and two hidden layers."""
    ref, dev = engines(backend, dims)
    V = ref.cfg.vocab_size
    vis = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    pos = prompt_len + np.array([0, 1, 1, 2], np.int32)

    def verify(e, prompt, tokens):
        cache = e.target.new_cache(prompt_len + 4)
        e.target.forward(prompt, np.arange(prompt_len, dtype=np.int32), cache, form="naive")
        cache.commit(np.arange(prompt_len))
        logits, hidden = e.target.forward(tokens, pos, cache, tree_mask=vis, hidden_layers=(0, 1))
        return e.target.ops.to_host(logits), e.target.ops.to_host(hidden)

    def draw(seed):
        rng = np.random.default_rng(seed)
        prompt, tokens = rng.integers(0, V, prompt_len), rng.integers(0, V, 4)
        return prompt, tokens, verify(ref, prompt, tokens)
    seed, (prompt, tokens, want) = untied(ref, draw)
    out = [want, verify(dev, prompt, tokens)]
    return (assert_close("verify logits", out[1][0], out[0][0], seeds(dims, seed)),
            assert_close("verify hidden", out[1][1], out[0][1], seeds(dims, seed)))


def check_ranks_one_device(backend, dims="tiny"):
    """Engine.load(devices=[0]): the multi-device path (a rank thread, the communicator's all-reduces inside the
    round, replicated tree work with the agreement check) gives exactly the single-device tokens."""
    from numbaengine import Engine
    _, dev = engines(backend, dims)
    ranked = Engine.load(*pair_dirs(dims), backend=backend, devices=[0])
    assert ranked.ranks is not None and ranked.ranks.size == 1
    prompts = [np.random.default_rng().integers(0, dev.cfg.vocab_size, 2).tolist()]
    kw = dict(mode="ar", stop=[])            # prefill, then rounds with the all-reduces (the cheapest round)
    assert [r.tokens for r in ranked.generate_batch(prompts, 2, **kw)] == \
        [r.tokens for r in dev.generate_batch(prompts, 2, **kw)]


SIM_PARTS = 3
SIM_COST = {"batch_ddtree": 143, "sampled_ddtree": 74, "dflash": 71, "ranks_one_device": 54, "greedy_ar": 31,
            "tree_verify": 30, "prefill_logits": 13, "prefill_logits_h200_draw": 14}
# CPU seconds of each case on one core (both cores busy; kernels.device.sleeping_block_manager halves them)
SIM_CASES = {
    "prefill_logits": lambda env: check_prefill("sim", n=3),
    # a draw that fails with bf16 activations in the small-weight GEMMs: 1.12e-2 of the logits' max on the H200 and
    # on the simulator; 2.2e-3 with hi + lo parts (kernels/gemm.py SMALL_XS)
    "prefill_logits_h200_draw": lambda env: check_prefill_draw("sim", 1611669243, 1771006521),
    "greedy_ar": lambda env: check_greedy("sim", prompt_len=1),
    # the 3-token prompt ends at the context (6 rows) after 4 tokens while the other decodes on (retired slot,
    # last tree cut to the cache): both as the reference
    "batch_ddtree": lambda env: check_decode("sim", prompt_lens=(1, 3), new=5, mode="ddtree", budget=3,
                                             max_context=6),
    "dflash": lambda env: check_decode("sim", prompt_lens=(2,), new=3, mode="dflash"),
    "sampled_ddtree": lambda env: check_decode("sim", prompt_lens=(2,), new=3, mode="ddtree", budget=2,
                                               temperature=1.0),
    "tree_verify": lambda env: check_verify("sim"),
    "ranks_one_device": lambda env: check_ranks_one_device("sim"),
}


test_simulator = simulator_test(__name__)


def test_sim_needs_the_simulator():
    """In this process numba was imported without NUMBA_ENABLE_CUDASIM: a one-line error, not a crash later."""
    from numbaengine.backends import get_ops
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("this checks the error without the simulator: run pytest without NUMBA_ENABLE_CUDASIM=1")
    with pytest.raises(ValueError, match="NUMBA_ENABLE_CUDASIM=1") as e:
        get_ops("sim")
    assert "\n" not in str(e.value)


def test_auto_picks_cuda_only_with_a_gpu():
    from numbaengine.backends import get_ops, gpu_ready
    assert get_ops("auto").name == ("cuda" if gpu_ready() else "numpy")


def test_cuda_without_gpu_is_a_clear_error():
    from numba import cuda

    from numbaengine.backends import get_ops
    if cuda.is_available():
        pytest.skip("this checks the error on a machine without a GPU (CI runs it); with a GPU, the gpu tests "
                    "cover the cuda backend")
    with pytest.raises((ImportError, ValueError), match="backend 'cuda'") as e:
        get_ops("cuda")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,sig", [
    ("_bf16_rows_k", "void(uint16[:, ::1], int32[::1], boolean, float32[:, ::1], int32)"),
    ("_write_rows_k", "void(float32[:, ::1], uint16[:, :, ::1], int32[::1], int32[::1], boolean, boolean, int32)"),
    ("_write_rows_k", "void(float32[:, ::1], float32[:, :, ::1], int32[::1], int32[::1], boolean, boolean, int32)"),
    ("_block_inputs_k", "void(int32[::1], int32[::1], int32, int32[:, ::1], int32[::1], int32[::1])"),
])
def test_ptx_glue_kernels(name, sig):
    import numbaengine.ops_cuda as O
    ptx = ptx_or_skip(getattr(O, name).py_func, sig)
    assert not f64_lines(ptx), f64_lines(ptx)[:5]


# --- GPU: the cuda backend (CuPy arrays, launches on CuPy's current stream) ----------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dims", ["tiny", "wide", "wide64"])
def test_gpu_cuda_backend(dims):
    cupy = pytest.importorskip("cupy", reason="the cuda extra: pip install -e '.[cuda]'")
    print(dims, "prefill error", check_prefill("cuda", dims, n=9))
    print(dims, "greedy", check_greedy("cuda", dims, prompt_len=5, new=8))
    print(dims, "verify error", check_verify("cuda", dims))
    target = engines("cuda", dims)[1].target                    # eager decode step: launch-bound, for the record
    cache = target.new_cache(16)
    target.forward(np.arange(8), np.arange(8, dtype=np.int32), cache, form="naive")
    cache.commit(np.arange(8))
    target.forward(np.array([3]), np.array([8], np.int32), cache)            # compiles the causal MLA kernel
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        target.forward(np.array([3]), np.array([8], np.int32), cache)
    cupy.cuda.get_current_stream().synchronize()
    print(dims, f"eager decode step {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")
