"""weights/: bit-exact dtypes, INT4 and FP8 formats against torch / compressed-tensors, safetensors I/O and errors."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from numbaengine.weights.dtypes import (
    bf16_to_f32,
    e4m3_to_f32,
    f32_to_bf16,
    f32_to_e4m3,
)
from numbaengine.weights.fp8 import dequant_fp8_block, quantize_fp8_block, scale_shape
from numbaengine.weights.int4 import dequant_int4, pack_int4, quantize_int4, unpack_int4
from numbaengine.weights.layout import draft_tensors, target_tensors
from numbaengine.weights.shards import (
    INDEX,
    Checkpoint,
    CheckpointError,
    write_checkpoint,
    write_checkpoint_lazy,
)

rng = np.random.default_rng()   # fresh data every run; failures print the offending values


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


# ---------------------------------------------------------------- dtypes

def test_bf16_matches_torch_including_ties_and_specials():
    x = rng.integers(0, 2**32, 100_000, dtype=np.uint32).view(np.float32)           # every exponent
    x = x[~np.isnan(x)]
    ties = (rng.integers(0, 2**15, 1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)   # exact halfway
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45], np.float32)
    x = np.concatenate([x, ties[~np.isnan(ties)], specials])
    assert np.array_equal(f32_to_bf16(x), torch_bf16_bits(x))
    back = bf16_to_f32(f32_to_bf16(x))
    assert np.array_equal(bf16_to_f32(f32_to_bf16(back)), back)      # bf16 values survive a round trip


def test_bf16_nan_stays_nan():
    x = np.array([np.nan, -np.nan], np.float32)
    x = np.concatenate([x, (np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32)).view(np.float32)])
    assert np.isnan(bf16_to_f32(f32_to_bf16(x))).all()


def test_e4m3_decode_matches_torch():
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(e4m3_to_f32(codes), want, equal_nan=True)


def test_e4m3_encode_matches_torch():
    vals = e4m3_to_f32(np.arange(256, dtype=np.uint8))
    finite = np.sort(vals[np.isfinite(vals)])
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2                     # every tie
    x = np.concatenate([rng.standard_normal(50_000) * 2.0 ** rng.integers(-12, 10, 50_000), mids, finite,
                        [449.0, 465.0, 1e6, -1e6, np.inf, -np.inf, 2.0 ** -10, -(2.0 ** -10)]]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(f32_to_e4m3(x), want)
    assert f32_to_e4m3(np.array([np.nan], np.float32))[0] & 0x7F == 0x7F


# ---------------------------------------------------------------- int4

def _ct():
    ct = pytest.importorskip("compressed_tensors", reason="a dev extra: pip install -e '.[dev]'")
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    return SimpleNamespace(ct=ct, pack=pack_to_int32, unpack=unpack_from_int32, qparams=calculate_qparams,
                           Args=QuantizationArgs, Scheme=QuantizationScheme, Compressor=PackedQuantizationCompressor)


@pytest.mark.parametrize("n,k", [(1, 8), (3, 64), (16, 256), (64, 1024)])
def test_int4_pack_round_trip_and_matches_compressed_tensors(n, k):
    ct = _ct()
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (n, k // 8)
    assert np.array_equal(unpack_int4(packed, k), q)
    assert np.array_equal(packed, ct.pack(torch.from_numpy(q), 4).numpy())
    theirs = ct.unpack(torch.from_numpy(packed), 4, torch.Size([n, k])).numpy()
    assert np.array_equal(unpack_int4(packed, k), theirs)


def test_int4_nibble_order():
    q = np.arange(-8, 8, dtype=np.int8).reshape(2, 8)          # row 0: -8..-1 -> nibbles 0..7
    assert pack_int4(q)[0, 0] == 0x76543210
    assert pack_int4(q)[1, 0] == np.int32(np.uint32(0xFEDCBA98).view(np.int32))


@pytest.mark.parametrize("n,k,group", [(8, 64, 32), (32, 256, 32), (5, 128, 64)])
def test_int4_quantize_matches_compressed_tensors(n, k, group):
    ct = _ct()
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3.0, (n, 1))).astype(np.float32)
    w[0, :group] = 0                                             # an all-zero group
    packed, scale = quantize_int4(w, group)
    args = ct.Args(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    g = torch.from_numpy(w).reshape(n, k // group, group)
    their_scale, _ = ct.qparams(g.amin(-1), g.amax(-1), args)
    their_bits = torch_bf16_bits(their_scale.numpy())
    assert np.array_equal(scale.ravel()[1:], their_bits.ravel()[1:])
    # a zero scale becomes the eps of the scale dtype: bf16 (2**-7) when the weights are bf16, as in real files
    zero = torch.zeros(1, dtype=torch.bfloat16)
    assert scale[0, 0] == torch_bf16_bits(ct.qparams(zero, zero, args)[0].float().numpy())[0] == 0x3C00
    scheme = ct.Scheme(targets=["Linear"], weights=args)
    state = {"weight": torch.from_numpy(w), "weight_scale": torch.from_numpy(bf16_to_f32(scale))}
    compressed = ct.Compressor.compress(state, scheme)
    assert np.array_equal(compressed["weight_packed"].numpy(), packed)
    their_w = ct.Compressor.decompress(compressed, scheme)["weight"].numpy()
    assert np.array_equal(dequant_int4(packed, scale, group), their_w)


def test_int4_dequant_error_is_half_a_step():
    w = rng.standard_normal((16, 128)).astype(np.float32)
    packed, scale = quantize_int4(w, 32)
    err = np.abs(dequant_int4(packed, scale, 32) - w).reshape(16, 4, 32)
    # half a step, plus what the bf16-rounded scale (rel. error <= 2**-8) loses at the clamped end (7.5 * 2**-8)
    assert (err <= (0.5 + 7.5 * 2**-8) * bf16_to_f32(scale)[:, :, None]).all()
    assert (unpack_int4(packed, 128) == -8).any()                # the full range [-8, 7] is used


def test_int4_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(np.zeros((2, 12), np.int8))
    with pytest.raises(ValueError, match="group"):
        quantize_int4(np.zeros((2, 48), np.float32), 32)
    with pytest.raises(ValueError, match="scale shape"):
        dequant_int4(np.zeros((2, 8), np.int32), np.zeros((2, 3), np.uint16), 32)


# ---------------------------------------------------------------- fp8

@pytest.mark.parametrize("n,k", [(128, 128), (200, 300), (1, 129), (257, 64)])
def test_fp8_block_dequant_matches_torch(n, k):
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10                        # no NaNs
    scale = rng.uniform(0.001, 2.0, scale_shape(n, k)).astype(np.float32)
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(scale).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    assert np.array_equal(dequant_fp8_block(codes, scale), (w * s).numpy())


def test_fp8_quantize_round_trip():
    w = rng.standard_normal((300, 200)).astype(np.float32)
    codes, scale_inv = quantize_fp8_block(w)
    assert scale_inv.shape == (3, 2) and codes.dtype == np.uint8
    back = dequant_fp8_block(codes, scale_inv)
    assert np.abs(back - w).max() <= 2.0 ** -4 * np.abs(w).max()    # 3 mantissa bits: half-ulp <= 1/16
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequant_fp8_block(codes, scale_inv[:2])


# ---------------------------------------------------------------- safetensors

def sample_tensors():
    return {
        "a.bf16": (f32_to_bf16(rng.standard_normal((3, 5)).astype(np.float32)), "BF16"),
        "b.f32": (rng.standard_normal((7,)).astype(np.float32), "F32"),
        "c.i32": (rng.integers(-2**31, 2**31, (2, 3), dtype=np.int32), "I32"),
        "d.i64": (np.array([11, 64], np.int64), "I64"),
        "e.fp8": (rng.integers(0, 0x7E, (4, 4), dtype=np.uint8), "F8_E4M3"),
        "f.f16": (rng.standard_normal((3,)).astype(np.float16), "F16"),
        "g.u8": (rng.integers(0, 256, (5,), dtype=np.uint8), "U8"),
        "h.scalar": (np.array(2.5, np.float32), "F32"),
        "i.empty": (np.zeros((0, 4), np.float32), "F32"),
    }


def assert_same(ck: Checkpoint, tensors):
    assert set(ck.names()) == set(tensors)
    for name, (a, dt) in tensors.items():
        assert ck.dtype(name) == dt and ck.shape(name) == a.shape
        assert np.array_equal(ck.get(name), a)


def test_write_read_round_trip_is_lazy_and_read_only(tmp_path):
    tensors = sample_tensors()
    files = write_checkpoint(tmp_path, tensors)
    assert [f.name for f in files] == ["model.safetensors"]
    ck = Checkpoint(tmp_path)
    assert_same(ck, tensors)
    got = ck.get("c.i32")
    assert not got.flags.writeable and not got.flags.owndata
    assert got.base is not None                                   # a view of the memory map, not a copy
    assert_same(Checkpoint(files[0]), tensors)


def test_our_files_load_in_safetensors(tmp_path):
    """torch for BF16/F8 (safetensors.numpy has no bf16), safetensors.numpy for the rest."""
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch
    tensors = sample_tensors()
    write_checkpoint(tmp_path, tensors)
    theirs = load_torch(tmp_path / "model.safetensors")
    assert set(theirs) == set(tensors)
    for name, (a, dt) in tensors.items():
        t = theirs[name]
        if dt == "BF16":
            t = t.view(torch.int16)
        elif dt == "F8_E4M3":
            t = t.view(torch.uint8)
        assert np.array_equal(t.numpy().view(a.dtype), a), name
    plain = {n: v for n, v in tensors.items() if v[1] not in ("BF16", "F8_E4M3")}
    write_checkpoint(tmp_path / "np", plain)
    for name, arr in load_file(tmp_path / "np" / "model.safetensors").items():
        assert np.array_equal(arr, plain[name][0]) and arr.dtype == plain[name][0].dtype


def test_safetensors_files_load_in_ours(tmp_path):
    from safetensors.torch import save_file
    w = torch.randn(33, 17)
    theirs = {"w.bf16": w.to(torch.bfloat16), "w.f32": w, "w.i64": torch.arange(6).reshape(2, 3),
              "w.fp8": w.to(torch.float8_e4m3fn), "w.i32": torch.tensor([7, -1], dtype=torch.int32)}
    save_file(theirs, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ck = Checkpoint(tmp_path)
    assert ck.dtype("w.bf16") == "BF16" and ck.dtype("w.fp8") == "F8_E4M3"
    assert np.array_equal(ck.get("w.bf16"), theirs["w.bf16"].view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(ck.get("w.fp8"), theirs["w.fp8"].view(torch.uint8).numpy())
    assert np.array_equal(e4m3_to_f32(ck.get("w.fp8")), theirs["w.fp8"].float().numpy())
    for name in ("w.f32", "w.i64", "w.i32"):
        assert np.array_equal(ck.get(name), theirs[name].numpy())


def test_sharded_index(tmp_path):
    from safetensors.numpy import load_file
    tensors = {f"layer.{i}.w": (rng.standard_normal((16, 16)).astype(np.float32), "F32") for i in range(7)}
    files = write_checkpoint(tmp_path, tensors, shard_bytes=3 * 16 * 16 * 4)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 7 * 16 * 16 * 4
    assert index["weight_map"]["layer.6.w"] == files[2].name
    assert_same(Checkpoint(tmp_path), tensors)
    assert_same(Checkpoint(tmp_path / INDEX), tensors)
    merged = {}
    for f in files:
        merged.update(load_file(f))
    assert all(np.array_equal(merged[n], a) for n, (a, _) in tensors.items())
    write_checkpoint(tmp_path, tensors)               # rewriting single-file removes the stale shards and index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_folder_of_unindexed_files(tmp_path):
    a, b = dict(list(sample_tensors().items())[:4]), dict(list(sample_tensors().items())[4:])
    write_checkpoint(tmp_path / "x", a)
    write_checkpoint(tmp_path / "y", b)
    (tmp_path / "x" / "model.safetensors").rename(tmp_path / "part-a.safetensors")
    (tmp_path / "y" / "model.safetensors").rename(tmp_path / "part-b.safetensors")
    assert set(Checkpoint(tmp_path).names()) == set(a) | set(b)
    (tmp_path / "part-c.safetensors").write_bytes((tmp_path / "part-a.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="is in both"):
        Checkpoint(tmp_path)


def test_streaming_writer_takes_row_chunks(tmp_path):
    full = rng.standard_normal((10, 3)).astype(np.float32)
    specs = {"w": ((10, 3), "F32"), "v": ((4,), "I32")}
    make = {"w": lambda: (full[i:i + 4] for i in range(0, 10, 4)), "v": lambda: np.arange(4, dtype=np.int32)}
    write_checkpoint_lazy(tmp_path, specs, lambda n: make[n]())
    assert np.array_equal(Checkpoint(tmp_path).get("w"), full)
    with pytest.raises(CheckpointError, match="tensor w: wrote 96 bytes"):
        write_checkpoint_lazy(tmp_path, specs, lambda n: iter([full[:8]]) if n == "w" else make[n]())


def test_writer_rejects_wrong_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="tensor x: array dtype float32 does not store BF16"):
        write_checkpoint(tmp_path, {"x": (np.zeros(3, np.float32), "BF16")})
    with pytest.raises(CheckpointError, match="tensor x: unsupported dtype F4"):
        write_checkpoint(tmp_path, {"x": (np.zeros(3, np.uint8), "F4")})


# ---------------------------------------------------------------- errors: one line, naming the tensor/file

def raises_one_line(fn, *needles):
    with pytest.raises(CheckpointError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_error_missing_shard(tmp_path):
    tensors = {f"t{i}": (np.zeros(64, np.float32), "F32") for i in range(4)}
    files = write_checkpoint(tmp_path, tensors, shard_bytes=256)
    files[2].unlink()
    raises_one_line(lambda: Checkpoint(tmp_path), files[2].name, "missing", "t2")


def test_error_truncated_file(tmp_path):
    write_checkpoint(tmp_path, {"a": (np.zeros(64, np.float32), "F32"), "b": (np.ones(64, np.float32), "F32")})
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    raises_one_line(lambda: Checkpoint(tmp_path), "model.safetensors", "truncated", "tensor b")
    f.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    raises_one_line(lambda: Checkpoint(tmp_path), "model.safetensors", "header length 1000000")
    f.write_bytes(b"\x01\x02")
    raises_one_line(lambda: Checkpoint(tmp_path), "model.safetensors", "truncated")


def test_error_bad_header_and_dtype(tmp_path):
    f = tmp_path / "model.safetensors"
    bad = b'{"a": {"dtype": "F32", '
    f.write_bytes(len(bad).to_bytes(8, "little") + bad)
    raises_one_line(lambda: Checkpoint(f), "model.safetensors", "not valid JSON")
    header = json.dumps({"x.w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}}).encode()
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    raises_one_line(lambda: Checkpoint(f), "x.w", "unsupported dtype F8_E5M2")
    header = json.dumps({"x.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    raises_one_line(lambda: Checkpoint(f), "x.w", "needs 8")


def test_error_missing_wrong_shape_wrong_dtype(tmp_path):
    write_checkpoint(tmp_path, {"model.norm.weight": (np.zeros(8, np.uint16), "BF16")})
    ck = Checkpoint(tmp_path)
    raises_one_line(lambda: ck.get("model.norm.weights"), "model.norm.weights", "not found",
                    "did you mean model.norm.weight")
    raises_one_line(lambda: ck.get_checked("model.norm.weight", (16,), "BF16"), "model.norm.weight",
                    "expected BF16 [16]", "found BF16 [8]")
    raises_one_line(lambda: ck.get_checked("model.norm.weight", (8,), "F32"), "model.norm.weight",
                    "expected F32 [8]", "found BF16 [8]")
    assert ck.get_checked("model.norm.weight", (8,), ("F32", "BF16")).shape == (8,)
    raises_one_line(lambda: ck.check_all({"lm_head.weight": ((4, 8), "BF16")}), "lm_head.weight")
    raises_one_line(lambda: Checkpoint(tmp_path / "nope"), "nope")


# ---------------------------------------------------------------- layout

def tiny_cfg(**kw):
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48,
                moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4, first_k_dense_replace=1,
                q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                tie_word_embeddings=False, quant=SimpleNamespace(method="int4", group_size=8))
    return SimpleNamespace(**{**base, **kw})


def test_layout_int4_target():
    t = target_tensors(tiny_cfg())
    assert t["model.embed_tokens.weight"] == ((64, 32), "BF16") and t["lm_head.weight"] == ((64, 32), "BF16")
    assert t["model.layers.0.mlp.down_proj.weight"] == ((32, 48), "BF16")
    assert t["model.layers.0.self_attn.q_b_proj.weight"] == ((2 * 12, 24), "BF16")
    assert t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == ((20, 32), "BF16")
    assert t["model.layers.0.self_attn.kv_b_proj.weight"] == ((2 * 16, 16), "BF16")
    assert t["model.layers.0.self_attn.o_proj.weight"] == ((32, 16), "BF16")
    p = "model.layers.2.mlp."
    assert t[p + "gate.weight"] == ((4, 32), "BF16") and t[p + "gate.e_score_correction_bias"] == ((4,), "F32")
    assert t[p + "shared_experts.up_proj.weight"] == ((16, 32), "BF16")
    assert t[p + "experts.3.down_proj.weight_packed"] == ((32, 2), "I32")
    assert t[p + "experts.3.down_proj.weight_scale"] == ((32, 2), "BF16")
    assert t[p + "experts.3.gate_proj.weight_shape"] == ((2,), "I32")
    assert "model.layers.0.mlp.gate.weight" not in t
    per_moe_layer = 2 + 7 + 2 + 3 + 4 * 3 * 3          # norms, attention, router, shared, experts
    assert len(t) == 1 + (2 + 7 + 3) + 2 * per_moe_layer + 1 + 1


def test_layout_fp8_tied_no_shared():
    t = target_tensors(tiny_cfg(quant=SimpleNamespace(method="fp8", group_size=32), tie_word_embeddings=True,
                                n_shared_experts=0, hidden_size=200, num_hidden_layers=2))
    assert "lm_head.weight" not in t and not any("shared_experts" in n for n in t)
    assert t["model.layers.1.self_attn.q_a_proj.weight"] == ((24, 200), "F8_E4M3")
    assert t["model.layers.1.self_attn.q_a_proj.weight_scale_inv"] == ((1, 2), "F32")
    assert t["model.layers.0.mlp.gate_proj.weight_scale_inv"] == ((1, 2), "F32")
    assert t["model.layers.1.mlp.experts.0.down_proj.weight"] == ((200, 16), "F8_E4M3")
    assert t["model.layers.1.mlp.gate.weight"] == ((4, 200), "BF16")
    assert t["model.embed_tokens.weight"] == ((64, 200), "BF16")
    assert t["model.layers.1.self_attn.q_a_layernorm.weight"] == ((24,), "BF16")


def test_layout_draft():
    t = draft_tensors(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, n_target_layers=3)
    assert t["fc.weight"] == ((32, 96), "BF16") and t["hidden_norm.weight"] == ((32,), "BF16")
    assert t["layers.1.self_attn.q_proj.weight"] == ((64, 32), "BF16")
    assert t["layers.1.self_attn.k_proj.weight"] == ((32, 32), "BF16")
    assert t["layers.0.self_attn.o_proj.weight"] == ((32, 64), "BF16")
    assert t["layers.0.self_attn.k_norm.weight"] == ((16,), "BF16")
    assert t["layers.0.mlp.down_proj.weight"] == ((32, 64), "BF16")
    assert len(t) == 3 + 2 * 11 and all(dt == "BF16" for _, dt in t.values())
