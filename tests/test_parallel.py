"""The multi-device layout on CPU: a simulated n-device target equals the unsharded one; the plan covers every
tensor."""
import functools

import numpy as np
import pytest

from numbaengine import Engine
from numbaengine.config import load_config
from numbaengine.parallel import local_slice, split_rule
from numbaengine.weights import SHIPPED_PAIR
from numbaengine.weights.layout import target_tensors
from numbaengine.weights.synth import synth_config, write_target

WIDE = dict(num_attention_heads=8, n_routed_experts=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    write_target(d, synth_config("tiny", layers=3, quant="int4", **WIDE), seed=seed)
    return d


def greedy(target, prompt, steps):
    """Plain autoregressive greedy decoding on the target (absorbed MLA after a naive prefill)."""
    cache = target.new_cache(len(prompt) + steps)
    logits, _ = target.forward(prompt, np.arange(len(prompt), dtype=np.int32), cache, form="naive")
    cache.length = len(prompt)
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits, _ = target.forward(np.array(out[-1:], np.int32), np.array([cache.length], np.int32), cache)
        cache.length += 1
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sharded_equals_unsharded(model_dir, n):
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, size=11).astype(np.int32)
    # float32 latent cache for the logits: with a bf16 cache, float32 reordering in the all-reduce can flip a
    # latent's bf16 rounding and amplify 1e-6 differences to ~1e-4
    one = Engine.load(model_dir, backend="numpy", cache_dtype="float32")
    many = Engine.load(model_dir, backend="numpy", devices=list(range(n)), cache_dtype="float32")
    assert len(many.target.shards) == n
    ref, got = one.forward_logits(prompt), many.forward_logits(prompt)
    assert np.abs(ref - got).max() / np.abs(ref).max() < 1e-4      # float32 sums in another order
    one, many = Engine.load(model_dir, backend="numpy"), Engine.load(model_dir, backend="numpy", devices=list(range(n)))
    assert greedy(one.target, prompt, 6) == greedy(many.target, prompt, 6)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_plan_covers_every_tensor_exactly_once(model_dir, n):
    cfg = load_config(model_dir)
    for name, (shape, _) in target_tensors(cfg).items():
        count = np.zeros(shape, np.int32)
        for rank in range(n):
            index = local_slice(name, shape, cfg, rank, n)
            if index is not None:
                count[index] += 1
        want = n if split_rule(name) is None else 1      # replicated tensors live on every device
        assert (count == want).all(), name


@pytest.mark.parametrize("n,field", [(3, "num_attention_heads"), (32, "num_attention_heads")])
def test_indivisible_layout_is_a_clear_error(model_dir, n, field):
    with pytest.raises(ValueError, match=field):
        Engine.load(model_dir, backend="numpy", devices=list(range(n)))


# --- ranks: one thread, op table and communicator per device (numbaengine/devices.py) ---------------------------
def test_thread_comm_collectives():
    """The CPU stand-in for NCCL: every rank gets the same rank-order sum; gathered columns land side by side."""
    from numbaengine.devices import Ranks, ThreadComm, all_gather_cols
    n, rng = 3, np.random.default_rng()
    xs = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(n)]
    comms = ThreadComm.make(n)
    ranks = Ranks(range(n), comms, use_device=False)
    sums = ranks.run(lambda r: comms[r].all_reduce(xs[r].copy()))
    want = (xs[0] + xs[1]) + xs[2]
    assert all(np.array_equal(s, want) for s in sums)
    outs = ranks.run(lambda r: all_gather_cols(comms[r], xs[r], np.full((4, 15), np.nan, np.float32),
                                               np.empty((n, 4, 5), np.float32)))
    assert all(np.array_equal(o, np.concatenate(xs, axis=1)) for o in outs)
    with pytest.raises(ValueError, match="C-contiguous"):            # a strided out would silently get nothing
        all_gather_cols(ThreadComm.make(1)[0], xs[0], np.empty((4, 10), np.float32)[:, :5], np.empty((1, 4, 5)))


def test_rank_error_reaches_the_caller():
    """An exception on one rank aborts the others' pending collectives instead of hanging them."""
    from numbaengine.devices import Ranks, ThreadComm
    comms = ThreadComm.make(2)
    ranks = Ranks(range(2), comms, use_device=False)

    def work(r):
        if r == 1:
            raise KeyError("rank 1 failed")
        return comms[r].all_reduce(np.zeros(3, np.float32))
    with pytest.raises(KeyError, match="rank 1 failed"):
        ranks.run(work)


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_equal_unsharded(model_dir, n):
    """A rank per simulated device (own thread, own shard, all-reduce and vocabulary all-gather through the
    communicator): every rank holds the same logits, which equal the unsharded model's; greedy tokens agree."""
    from numbaengine.devices import load_ranks
    cfg = load_config(model_dir)
    prompt = np.random.default_rng().integers(0, 512, size=9).astype(np.int32)
    one = Engine.load(model_dir, backend="numpy", cache_dtype="float32")
    ranks = load_ranks(cfg, model_dir, None, "numpy", list(range(n)), "float32")
    assert [len(t.w.lm_head) for t in ranks.targets] == [cfg.vocab_size // n] * n

    def prefill(r):
        target = ranks.targets[r]
        logits, _ = target.forward(prompt, np.arange(len(prompt), dtype=np.int32), target.new_cache(len(prompt)),
                                   form="naive")
        return logits
    got = ranks.run(prefill)
    assert all(np.array_equal(g, got[0]) for g in got), "ranks disagree"
    ref = one.forward_logits(prompt)
    assert np.abs(ref - got[0]).max() / np.abs(ref).max() < 1e-4
    bf16 = load_ranks(cfg, model_dir, None, "numpy", list(range(n)))
    tokens = bf16.run(lambda r: greedy(bf16.targets[r], prompt, 5))
    assert tokens == [greedy(Engine.load(model_dir, backend="numpy").target, prompt, 5)] * n


@pytest.mark.parametrize("devices,backend,match", [([], "numpy", "at least one"), ([0, 0], "numpy", "twice"),
                                                   ([0, 1], "sim", "one rank")])
def test_bad_device_list_is_a_clear_error(devices, backend, match):
    from numbaengine.devices import check_devices
    with pytest.raises(ValueError, match=match) as e:
        check_devices(devices, backend)
    assert "\n" not in str(e.value)


# --- the same on the GPU through NCCL (devices=[0] is what one lent H200 can check) -----------------------------
DEFAULT = SHIPPED_PAIR


@pytest.mark.gpu
def test_gpu_nccl_collectives_eager_and_captured():
    """NcclComm on device 0 (a one-rank communicator): all-reduce in place and the vocabulary all-gather, eager
    and inside a captured graph."""
    import cupy as cp

    from numbaengine.devices import all_gather_cols, nccl_comms
    comm = nccl_comms([0])[0]
    x = cp.random.standard_normal((5, 7), dtype=cp.float32)
    want = cp.asnumpy(x)
    out, buf = cp.full((5, 7), cp.nan, cp.float32), cp.empty((1, 5, 7), cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        comm.all_reduce(x)
        all_gather_cols(comm, x, out, buf)
        s.synchronize()
        assert np.array_equal(cp.asnumpy(x), want) and np.array_equal(cp.asnumpy(out), want)
        out.fill(cp.nan)
        s.begin_capture()
        comm.all_reduce(x)
        all_gather_cols(comm, x, out, buf)
        graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
    assert np.array_equal(cp.asnumpy(out), want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget", [("ddtree", 16), ("ar", 0)])
def test_gpu_devices_0_equals_single_gpu(mode, budget):
    """Engine.load(devices=[0]) runs the multi-GPU path (a rank thread, NCCL all-reduces captured in the round
    graph, replicated tree work with the agreement check) and gives the single-GPU path's tokens and tau."""
    prompts = ["def fibonacci(n):", "import os\n", "class Node:\n    def"]
    outs = []
    for devices in (None, [0]):
        engine = Engine.load(DEFAULT / "target", DEFAULT / "draft", backend="cuda", devices=devices,
                             max_context=512)
        res = engine.generate_batch(prompts, 40, mode=mode, budget=budget, stop=[])
        outs.append([(r.tokens, r.stats["tau_mean"]) for r in res])
        if devices:      # (a one-rank in-place all-reduce is a no-op for NCCL: the graph need not show it)
            assert next(iter(engine.rounds_cache.values())).graph is not None
    assert outs[0] == outs[1]


@functools.lru_cache(maxsize=1)
def _two_device_pair():
    """The numpy reference and the pair on devices [0, 1], loaded once for both modes (NCCL setup and the
    weight upload are the slow part; the reference is numpy alone, no single-GPU engine beside it)."""
    return (Engine.load(DEFAULT / "target", DEFAULT / "draft", backend="numpy"),
            Engine.load(DEFAULT / "target", DEFAULT / "draft", backend="cuda", devices=[0, 1], max_context=512))


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget", [("ddtree", 16), ("ar", 0)])
def test_gpu_two_devices_match_the_reference(mode, budget):
    """devices=[0, 1]: heads, experts and vocabulary split over two GPUs, NCCL all-reduces and the vocabulary
    all-gather inside each GPU's round graph. Tokens equal the numpy reference's up to a near-tie (the split sums
    round differently), every token a near-argmax."""
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (device kind nvidia-h200-x2); one GPU runs test_gpu_devices_0_equals_single_gpu")
    from test_device_round import assert_reference_tokens
    ref, engine = _two_device_pair()
    prompts = ["def fibonacci(n):", "import os\n", "class Node:\n    def"]
    got = engine.generate_batch(prompts, 32, mode=mode, budget=budget, stop=[])
    want = ref.generate_batch(prompts, 32, mode=mode, budget=budget, stop=[])
    for p, g, w in zip(prompts, got, want):
        assert_reference_tokens(ref, p, g.tokens, w.tokens, f"{mode} budget {budget} on devices [0, 1]")
    if mode == "ddtree":
        assert min(r.stats["tau_mean"] for r in got) > 1.5, [r.stats["tau_mean"] for r in got]


@pytest.mark.gpu
def test_gpu_more_devices_than_present_is_a_clear_error():
    import cupy as cp
    n = cp.cuda.runtime.getDeviceCount()
    with pytest.raises(ValueError, match=f"GPU {n}") as e:
        Engine.load(DEFAULT / "target", backend="cuda", devices=list(range(n + 1)))
    assert "\n" not in str(e.value)


def test_weights_that_cannot_fit_name_the_gpu(tmp_path):
    """check_weights_fit asks every listed GPU for its free memory (a stand-in for CuPy's runtime here)."""
    import contextlib
    from types import SimpleNamespace

    from numbaengine.engine import check_weights_fit
    (tmp_path / "model.safetensors").write_bytes(bytes(4096))             # 2048 bytes per GPU over two
    free, current = {0: 10**6, 1: 10**6}, [0]

    @contextlib.contextmanager
    def device(d):
        saved, current[0] = current[0], d
        yield
        current[0] = saved
    cuda = SimpleNamespace(Device=device, runtime=SimpleNamespace(memGetInfo=lambda: (free[current[0]], 2 * 10**6)))
    ops = SimpleNamespace(xp=SimpleNamespace(cuda=cuda))
    check_weights_fit(ops, [tmp_path], [0, 1])
    free[1] = 1000
    with pytest.raises(MemoryError, match="on GPU 1") as e:
        check_weights_fit(ops, [tmp_path], [0, 1])
    assert "\n" not in str(e.value)
    check_weights_fit(ops, [tmp_path], None)                                 # the current GPU (0) alone
