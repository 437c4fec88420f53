"""One rank's shard made in memory (numbaengine/rank_shard.py) under the counter scheme (weights.synth): it equals
local_slice of the whole synthetic model written to disk; all ranks together decode like the whole model; one rank
alone decodes through its stand-in collectives; bad layouts are one-line errors."""
import dataclasses

import numpy as np
import pytest
from test_parallel import greedy

from numbaengine.backends import NUMPY
from numbaengine.checkpoint import load_target_weights
from numbaengine.config import load_config
from numbaengine.devices import Ranks, ThreadComm, rank_ops
from numbaengine.drafter import load_draft_config, load_drafter
from numbaengine.engine import Engine
from numbaengine.parallel import draft_local_slice, local_slice
from numbaengine.rank_shard import (
    StandInComm,
    SynthSource,
    check_fits,
    draft_bytes,
    local_draft_config,
    memory_plan,
    rank_drafter,
    rank_engine,
    rank_target,
    rank_target_weights,
    set_drafter,
    shard_bytes,
)
from numbaengine.weights import synth
from numbaengine.weights.dtypes import f32_to_bf16
from numbaengine.weights.layout import target_tensors
from numbaengine.weights.shards import Checkpoint
from numbaengine.weights.synth import (
    bf16_bits,
    counter_slice,
    draft_config,
    k25_dflash_config,
    synth_config,
    write_draft,
    write_target,
)

DIMS = dict(num_attention_heads=8, n_routed_experts=16,        # tiny preset, divisible by 1, 2, 4, 8;
            qk_rope_head_dim=32)                             # latent rows of 96: the cuda MLA kernels need D % 32 == 0
DRAFT = dict(layers=2, block_size=4, heads=8, kv_heads=4, head_dim=32, intermediate=128)
SEED = int(np.random.SeedSequence().entropy % 2**31)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The whole counter-scheme model (3 layers) and drafter on disk, from SEED and SEED + 1."""
    d = tmp_path_factory.mktemp("counter")
    write_target(d / "target", synth_config("tiny", layers=3, quant="int4", **DIMS), seed=SEED, scheme="counter")
    write_draft(d / "draft", d / "target", seed=SEED + 1, scheme="counter", **DRAFT)
    return d / "target", d / "draft"


def assert_same(a, b, path="", why=""):
    """Two weight records hold equal arrays (same shape, dtype, values) everywhere."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), f"{path} differs ({why})"
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: lengths ({why})"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", why)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}", why)
    else:
        assert a == b, f"{path}: {a} != {b} ({why})"


# --- the counter scheme ---------------------------------------------------------------------------------------------
def test_bf16_bits_equal_f32_to_bf16():
    x = np.random.default_rng(SEED).standard_normal(4096).astype(np.float32) * 1e3
    assert np.array_equal(bf16_bits(x), f32_to_bf16(x)), f"seed {SEED}"


@pytest.mark.parametrize("chunk", [synth.CHUNK, 100])
def test_counter_slices_equal_the_whole(monkeypatch, chunk):
    """Any slice (made in row blocks of `chunk` values or at once) equals that slice of the whole tensor."""
    monkeypatch.setattr(synth, "CHUNK", chunk)
    rng = np.random.default_rng(SEED)
    specs = {"a.weight": ((37, 48), "BF16"), "b.weight_packed": ((16, 4), "I32"), "c.norm.weight": ((48,), "BF16")}
    for name, (shape, _) in specs.items():
        whole = counter_slice(specs, name, (), SEED)
        lo = [int(rng.integers(0, n)) for n in shape]
        index = tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, shape))
        assert np.array_equal(counter_slice(specs, name, index, SEED), whole[index]), f"{name} {index} seed {SEED}"


def test_counter_values_have_the_stream_schemes_spread(pair):
    ck = Checkpoint(pair[0])
    from numbaengine.weights.dtypes import bf16_to_f32
    w = bf16_to_f32(ck.get("model.layers.1.self_attn.q_a_proj.weight"))
    assert abs(w.std() * np.sqrt(w.shape[1]) - 1) < 0.05, f"seed {SEED}"
    norm = bf16_to_f32(ck.get("model.layers.1.input_layernorm.weight"))
    assert 0.89 < norm.min() and norm.max() < 1.11
    words = ck.get("model.layers.1.mlp.experts.3.up_proj.weight_packed").view(np.uint32)
    assert len(np.unique(words & 15)) == 16
    with pytest.raises(ValueError, match="not fp8"):
        write_target(pair[0].parent / "fp8", synth_config("tiny", quant="fp8"), scheme="counter")


# --- (a) a rank's shard is local_slice of the whole model -----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
def test_shard_equals_local_slice_of_the_whole(pair, n):
    rank = int(np.random.default_rng(SEED + n).integers(0, n))
    why = f"rank {rank} of {n}, seed {SEED}"
    cfg, ck = load_config(pair[0]), Checkpoint(pair[0])
    specs = target_tensors(cfg)
    source = SynthSource(specs, SEED, cfg.quant.group_size)
    for name, (shape, dtype) in specs.items():
        index = local_slice(name, shape, cfg, rank, n)
        if index is not None:
            got = source.get_checked(name, shape, dtype)[index]
            assert np.array_equal(got, ck.get(name)[index]), f"{name}: {why}"
    assert_same(rank_target_weights(cfg, SEED, rank, n), load_target_weights(cfg, ck, rank, n), "weights", why)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_drafter_equals_local_slice_of_the_whole(pair, n):
    rank = int(np.random.default_rng(SEED + 10 + n).integers(0, n))
    why = f"rank {rank} of {n}, seed {SEED}"
    target = Engine.load(pair[0], backend="numpy").target
    whole = load_drafter(pair[1], target, NUMPY)
    raw = draft_config(pair[0], **DRAFT)
    part = rank_drafter(raw, SEED + 1, rank, n, NUMPY, target)
    assert part.cfg == local_draft_config(load_draft_config(pair[1]), n)
    ck = Checkpoint(pair[1])
    for name in ck.names():
        want = ck.get(name)[draft_local_slice(name, ck.get(name).shape, rank, n)]
        got = part.fc if name == "fc.weight" else None
        if name.startswith("layers.0.self_attn.q_proj"):
            got = part.layers[0].qkv[:len(want)]
        if name.startswith("layers.1.mlp.down_proj"):
            got = part.layers[1].down
        if got is not None:
            assert np.array_equal(got, want), f"{name}: {why}"
    if n == 1:
        assert_same(part.layers, whole.layers, "drafter layers", why)


# --- (b) every rank together == the whole model -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_ranks_together_decode_like_the_whole_model(pair, n):
    """n in-memory shards, a rank per thread with ThreadComm all-reduces and vocabulary gathers, give the greedy
    tokens of the whole model loaded from disk (and of the in-memory whole, rank 0 of 1)."""
    cfg = load_config(pair[0])
    prompt = np.random.default_rng(SEED).integers(0, cfg.vocab_size, 9).astype(np.int32)
    comms = ThreadComm.make(n)
    targets = [rank_target(cfg, SEED, r, n, rank_ops("numpy", comms[r])) for r in range(n)]
    got = Ranks(range(n), comms, use_device=False).run(lambda r: greedy(targets[r], prompt, 6))
    want = greedy(Engine.load(pair[0], backend="numpy").target, prompt, 6)
    assert got == [want] * n, f"seed {SEED}"
    assert greedy(rank_target(cfg, SEED, 0, 1, NUMPY), prompt, 6) == want, f"seed {SEED}"


# --- one rank alone -------------------------------------------------------------------------------------------------
def test_stand_in_comm():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for mode in ("none", "copy"):
        comm = StandInComm(1, 4, mode)
        assert np.array_equal(comm.all_reduce(x), np.arange(6).reshape(2, 3))        # the local partial stays
        assert len(comm._bufs) == (mode == "copy")
        buf = np.full((4, 2, 3), np.nan, np.float32)
        assert np.array_equal(comm.all_gather(x, buf), np.broadcast_to(x, (4, 2, 3)))
        assert "rank 1 of 4" in comm.describe()


@pytest.mark.parametrize("split", [False, True])
def test_one_rank_alone_decodes(pair, split):
    """Rank 2 of 4 alone on the numpy backend (stand-in collectives), drafter replicated or split: DDTree's greedy
    tokens equal AR's (its target is a deterministic function, whatever the drafter), all in this rank's slice of
    the vocabulary (its gathers copy its own slice)."""
    cfg = load_config(pair[0])
    shard = rank_engine(cfg, SEED, 2, 4, "numpy", 64)
    drafter = set_drafter(shard, draft_config(pair[0], **DRAFT), split)
    assert drafter.cfg.num_attention_heads == DRAFT["heads"] // (4 if split else 1)
    prompt = [5, 9, 11, 3, 7]
    ar = shard.engine.generate(prompt, 8, mode="ar", stop=[]).tokens
    tree = shard.engine.generate(prompt, 8, mode="ddtree", budget=4, stop=[]).tokens
    assert ar == tree, f"seed {SEED}"
    assert all(0 <= t < cfg.vocab_size // 4 for t in ar)


# --- (c) bad arguments, memory plan ------------------------------------------------------------------------------
@pytest.mark.parametrize("rank,n,match", [(4, 4, "rank: 4 is not a device"), (-1, 2, "rank: -1"),
                                          (0, 3, "num_attention_heads"), (0, 16, "num_attention_heads"),
                                          (0, 0, "at least one device")])
def test_bad_layout_is_a_one_line_error(pair, rank, n, match):
    cfg = load_config(pair[0])
    with pytest.raises(ValueError, match=match) as e:
        rank_target_weights(cfg, SEED, rank, n)
    assert "\n" not in str(e.value)


def test_bad_drafter_split_and_stand_in_are_one_line_errors(pair):
    for call, match in [(lambda: local_draft_config(load_draft_config(pair[1]), 8), "drafter num_key_value_heads"),
                        (lambda: StandInComm(0, 2, "nccl"), "all-reduce stand-in"),
                        (lambda: StandInComm(2, 2), "rank: 2")]:
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv,match", [
    (["--synth-k2", "61", "--rank-of", "8", "--rank", "8"], "rank: 8 is not a device"),
    (["--synth-k2", "61", "--rank-of", "5"], "num_attention_heads: 64 is not divisible by the 5"),
    (["--rank-of", "8"], "needs --synth-k2"),
    (["--synth-k2", "61", "--rank-of", "8", "--drafter-layout", "sharded"], "--drafter-layout"),
    (["--synth-k2", "61", "--rank-of", "16", "--drafter-layout", "split"], "drafter num_key_value_heads")])
@pytest.mark.parametrize("tool", ["bench", "profile_round"])
def test_bench_refuses_bad_rank_arguments_in_one_line(tool, argv, match, capsys):
    """tools.bench and tools.profile_round --rank-of: arguments that do not fit, one line before any GPU work."""
    import importlib
    main = importlib.import_module(f"tools.{tool}").main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and err.count("\n") == 1, err


def test_shard_bytes_count_what_the_shard_holds(pair):
    """shard_bytes equals the bytes of the records (w_uk / w_uv as views of kv_b, as the numpy loader has them)."""
    from tools.bench import nbytes
    cfg = load_config(pair[0])
    for rank, n in [(0, 1), (1, 2), (3, 4)]:
        want = nbytes(rank_target_weights(cfg, SEED, rank, n))
        assert sum(shard_bytes(cfg, rank, n, kv_b_copies=False).values()) == want, f"rank {rank} of {n}"


def test_k2_rank_plan_and_one_line_memory_error():
    """Rank 0 of 8 of the 61-layer K2.6 shard: ~71 GB of INT4 experts, ~78 GB in all; the K2.5-DFlash drafter ~7 GB
    replicated, ~1.4 GB split; a plan over the free memory is a one-line MemoryError."""
    raw = synth_config("k2", layers=61, quant="int4")
    cfg, dcfg = load_config(raw), k25_dflash_config(raw)
    assert dcfg["dflash_config"]["target_layer_ids"] == [1, 12, 24, 35, 47, 58] and dcfg["num_hidden_layers"] == 6
    parts = shard_bytes(cfg, 0, 8)
    assert 71e9 < parts["routed experts"] < 72e9 and 77e9 < sum(parts.values()) < 80e9
    assert 6.5e9 < draft_bytes(dcfg, 1) < 7.5e9 and 1.2e9 < draft_bytes(dcfg, 8) < 1.6e9
    cases = [("ar", 32, 0), ("ddtree", 32, 32)]
    plan = memory_plan(cfg, dcfg, 0, 8, [False, True], cases, 8192 + 576)
    assert 100 * 2**30 < sum(plan.values()) < 135 * 2**30            # fits one H200 (~139 GiB)
    check_fits(plan, 139 * 2**30, "rank 0 of 8")
    with pytest.raises(MemoryError, match="rank 0 of 8 needs") as e:
        check_fits(plan, 80 * 2**30, "rank 0 of 8")
    assert "\n" not in str(e.value)


# --- on the GPU: the same shard made by CuPy -------------------------------------------------------------------------
def _host(record):
    """A weight record with every CuPy array copied to the host (for assert_same)."""
    import cupy as cp
    if isinstance(record, cp.ndarray):
        return cp.asnumpy(record)
    if isinstance(record, list):
        return [_host(r) for r in record]
    if dataclasses.is_dataclass(record):
        fields = dataclasses.fields(record)
        return dataclasses.replace(record, **{f.name: _host(getattr(record, f.name)) for f in fields})
    return record


@pytest.mark.gpu
@pytest.mark.parametrize("rank,n", [(0, 1), (1, 2), (3, 4)])
def test_gpu_shard_made_on_the_device_equals_the_uploaded_checkpoint(pair, rank, n):
    """CuPy makes the bits NumPy makes: rank r's device records equal the cuda table's upload of local_slice of the
    checkpoint on disk (INT4 experts in the kernels' layouts included)."""
    import cupy as cp

    from numbaengine.model import Target
    from numbaengine.ops_cuda import cuda_ops
    cfg = load_config(pair[0])
    specs = target_tensors(cfg)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    index = local_slice(name, specs[name][0], cfg, rank, n)
    assert np.array_equal(cp.asnumpy(counter_slice(specs, name, index, SEED, xp=cp)),
                          counter_slice(specs, name, index, SEED))
    ops = cuda_ops(StandInComm(rank, n))
    made = rank_target(cfg, SEED, rank, n, ops)
    loaded = Target(cfg, [load_target_weights(cfg, Checkpoint(pair[0]), rank, n)], ops)
    assert_same(_host(made.w), _host(loaded.w), "weights", f"rank {rank} of {n}, seed {SEED}")


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_gpu_one_rank_alone_graph_equals_eager(pair, split):
    """Rank 1 of 2 alone on the GPU: captured rounds commit the eager rounds' tokens (tools.bench.check_eager), and
    DDTree's greedy tokens equal AR's."""
    from tools.bench import check_eager
    shard = rank_engine(load_config(pair[0]), SEED, 1, 2, "cuda", 128)
    set_drafter(shard, draft_config(pair[0], **DRAFT), split)
    checks = check_eager(shard.engine, [("ar", 1, 0), ("ddtree", 1, 4), ("ddtree", 2, 8)])
    assert all(c["same"] for c in checks), checks
    prompt = [5, 9, 11, 3, 7]
    ar = shard.engine.generate(prompt, 12, mode="ar", stop=[]).tokens
    assert shard.engine.generate(prompt, 12, mode="ddtree", budget=8, stop=[]).tokens == ar, f"seed {SEED}"


@pytest.mark.gpu
def test_gpu_bench_rank_of_8_runs(tmp_path):
    """tools.bench --synth-k2 2 --rank-of 8: the shard made on the GPU, both drafter layouts, a context case, the
    eager check and the estimate land in the JSON."""
    import json

    from tools.bench import main
    out = tmp_path / "rank.json"
    main(["--synth-k2", "2", "--rank-of", "8", "--rank", "3", "--modes", "ar,ddtree", "--budgets", "4",
          "--batches", "1", "--contexts", "512", "--context-rounds", "4", "--check-eager", "--allreduce-us", "20",
          "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["rank_shard"]["rank"] == 3 and "stood in" in res["rank_shard"]["note"]
    assert {r.get("drafter_layout") for r in res["rows"]} == {None, "replicated", "split"}
    assert all(r["context"] == 512 and r["graph_kernels"] > 0 for r in res["rows"])
    assert all(c["same"] for c in res["eager_checks"]) and len(res["estimate_n_gpus"]) == len(res["rows"])


@pytest.mark.parametrize("n", [2, 4])
def test_split_drafter_on_ranks_equals_the_whole_drafter(pair, n):
    """The drafter split n ways (heads, key/value heads and MLP columns per rank, each layer's attention and MLP
    output all-reduced) gives the whole drafter's block output on every rank (ThreadComm all-reduces; attention of
    the block over its own keys, per head)."""
    from numbaengine.reference import attention_ref
    cfg, dcfg = load_config(pair[0]), draft_config(pair[0], **DRAFT)
    rng = np.random.default_rng(SEED)
    rows = 5
    h0 = rng.standard_normal((rows, cfg.hidden_size)).astype(np.float32)
    positions = np.arange(7, 7 + rows, dtype=np.int32)

    def block(drafter):
        def attend(i, q, kv):
            nkv = kv.shape[1] // 2
            out = np.empty(q.shape[:2] + (kv.shape[2],), np.float32)
            return attention_ref(q, kv[:, :nkv], kv[:, nkv:], np.ones((rows, rows), bool), drafter.scale, out)
        return drafter.block(h0.copy(), positions, attend).copy()

    whole_target = rank_target(cfg, SEED, 0, 1, NUMPY)
    whole_drafter = rank_drafter(dcfg, SEED + 1, 0, 1, NUMPY, whole_target)
    whole = block(whole_drafter)
    comms = ThreadComm.make(n)
    ops = [rank_ops("numpy", comms[r]) for r in range(n)]
    drafters = [rank_drafter(dcfg, SEED + 1, r, n, ops[r], rank_target(cfg, SEED, r, n, ops[r])) for r in range(n)]
    assert all(d.split for d in drafters) and not whole_drafter.split
    got = Ranks(range(n), comms, use_device=False).run(lambda r: block(drafters[r]))
    for r, g in enumerate(got):
        err = np.abs(g - whole).max() / np.abs(whole).max()
        assert err < 1e-5, f"rank {r} of {n}: block output {err:.1e} from the whole drafter's (seed {SEED})"
