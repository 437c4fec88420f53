"""Format-exact random checkpoints: a K2-style target (tiny or full K2.6 dims) and a DFlash drafter for it.

  python -m weights.synth --preset tiny|k2 [--layers N] --out DIR [--quant int4|none|fp8] [--wrapper k25]
                          [--seed S] [--shard-mb M] [--scheme stream|counter]
  python -m weights.synth --draft --target DIR --out DIR2 [--layers N] [--block-size B] [--seed S] [--scheme ...]

Names and shapes come from weights.layout (one source of truth). Every tensor is drawn from its own generator
seeded by (seed, name without prefix), so sharding or the k25 wrapper never changes values. Values are stored
directly in their storage format and streamed in row chunks (bounded memory even at K2 size):
  linear W [out, in]  uniform, std 1/sqrt(in) (embedding: std 1), so activations stay O(1)
  int4 experts        uniform nibbles (all 16 codes), per-group bf16 scale ~ U[0.5, 1.5) / (sqrt(in) * rms(q))
  fp8 linears         random e4m3 codes with |v| <= 1, per-block scale_inv ~ U[0.5, 1.5) / (sqrt(in) * rms(v))
  norms               U[0.9, 1.1];  router bias U[-0.05, 0.05] f32
The `counter` scheme (--scheme counter; int4 or bf16) draws the same distributions from a hash of (seed, name,
element index) instead of a generator stream, so any slice of any tensor is made without the rest, with NumPy or
CuPy alike (bit-equal): numbaengine/rank_shard.py builds one rank's shard of a model this way in device memory.
"""
from __future__ import annotations

import argparse
import json
import math
import zlib
from pathlib import Path

import numpy as np

from .dtypes import E4M3_TABLE, f32_to_bf16
from .layout import draft_tensors, target_tensors
from .shards import write_checkpoint_lazy

CHUNK = 1 << 24                                  # values generated per chunk
INT4_RMS = float(np.sqrt(np.mean(np.arange(-8, 8) ** 2.0)))
FP8_CODES = 0x39                                 # e4m3 codes 0x00..0x38: 0 <= v <= 1
FP8_RMS = float(np.sqrt(np.mean(E4M3_TABLE[:FP8_CODES].astype(np.float64) ** 2)))


def _yarn(factor: float, original: int) -> dict:
    return dict(type="yarn", factor=factor, original_max_position_embeddings=original, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


COMMON = dict(architectures=["DeepseekV3ForCausalLM"], hidden_act="silu", topk_method="noaux_tc",
              scoring_func="sigmoid", moe_layer_freq=1, n_shared_experts=1, n_group=1, topk_group=1,
              first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True, rope_theta=50000.0,
              attention_bias=False, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=False,
              use_cache=True, torch_dtype="bfloat16")
PRESETS = {
    "tiny": dict(model_type="deepseek_v3", vocab_size=512, hidden_size=256, intermediate_size=128,
                 moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                 kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                 num_experts_per_tok=2, rope_scaling=_yarn(32.0, 256), max_position_embeddings=256 * 32,
                 rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, num_hidden_layers=3),
    "k2": dict(model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
               moe_intermediate_size=2048, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
               num_experts_per_tok=8, rope_scaling=_yarn(64.0, 4096), max_position_embeddings=262144,
               rms_norm_eps=1e-5, bos_token_id=163584, eos_token_id=163585, num_hidden_layers=2),
}
INT4_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def quant_config(quant: str, group_size: int = 32, ignore: list[str] | None = None) -> dict | None:
    """The `quantization_config` block of config.json (None for bf16)."""
    if quant == "none":
        return None
    if quant == "fp8":
        return dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128])
    if quant != "int4":
        raise ValueError(f"quant: {quant!r} is not one of int4, none, fp8")
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                   dynamic=False, actorder=None, observer="minmax", observer_kwargs={}, block_structure=None)
    return dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
                config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=None,
                                               output_activations=None)},
                ignore=ignore or INT4_IGNORE, kv_cache_scheme=None)


def synth_config(preset: str = "tiny", layers: int | None = None, quant: str = "int4", wrapper: str | None = None,
                 **overrides) -> dict:
    """A config.json dict; `overrides` replace text-config fields (e.g. n_group=2, rope_scaling={...})."""
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {', '.join(PRESETS)}")
    text = {**COMMON, **PRESETS[preset], **overrides}
    if layers is not None:
        text["num_hidden_layers"] = layers
    q = quant_config(quant)
    if wrapper is None:
        return {**text, "quantization_config": q} if q else text
    if wrapper != "k25":
        raise ValueError(f"wrapper: {wrapper!r} is not supported (only 'k25')")
    top = dict(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", text_config=text,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    if q:
        ignore = ["language_model.lm_head", *INT4_IGNORE[1:], "re:.*vision_tower.*", "re:.*mm_projector.*"]
        top["quantization_config"] = quant_config(quant, ignore=ignore) if quant == "int4" else q
    return top


# ---------------------------------------------------------------- value generators (storage dtype, row chunks)

def _uniform(rng, shape, std: float) -> np.ndarray:
    x = rng.random(shape, dtype=np.float32)            # U[0, 1)
    x -= np.float32(0.5)
    x *= np.float32(2 * math.sqrt(3) * std)           # U[-a, a) with std `std`
    return x


def _chunks(shape, rows_fn):
    """Yield rows_fn(r) for consecutive row counts r covering shape[0], about CHUNK values each."""
    step = max(1, CHUNK // max(1, math.prod(shape[1:])))
    for r in range(0, shape[0], step):
        yield rows_fn(min(step, shape[0] - r))


def _norm(g, name, rng, shape, dtype):
    return f32_to_bf16(1 + _uniform(rng, shape, 0.1 / math.sqrt(3)))


def _bias(g, name, rng, shape, dtype):
    return _uniform(rng, shape, 0.05 / math.sqrt(3))


def _embedding(g, name, rng, shape, dtype):
    return _chunks(shape, lambda r: f32_to_bf16(_uniform(rng, (r, shape[1]), 1.0)))


def _linear(g, name, rng, shape, dtype):
    if dtype == "F8_E4M3":
        return _chunks(shape, lambda r: _fp8_codes(rng, (r, shape[1])))
    return _chunks(shape, lambda r: f32_to_bf16(_uniform(rng, (r, shape[1]), 1 / math.sqrt(shape[1]))))


def _fp8_codes(rng, shape) -> np.ndarray:
    b = rng.integers(0, 2 * FP8_CODES, shape, dtype=np.uint8)
    return (b % FP8_CODES) | ((b >= FP8_CODES).astype(np.uint8) << 7)


def _fp8_scale(g, name, rng, shape, dtype):
    fan_in = g.specs[name.removesuffix("_scale_inv")][0][1]
    return (0.5 + rng.random(shape, dtype=np.float32)) / np.float32(math.sqrt(fan_in) * FP8_RMS)


def _int4_codes(g, name, rng, shape, dtype):
    return _chunks(shape, lambda r: rng.integers(0, 1 << 32, (r, shape[1]), dtype=np.uint32).view(np.int32))


def _int4_scale(g, name, rng, shape, dtype):
    fan_in = shape[1] * g.group
    return f32_to_bf16((0.5 + rng.random(shape, dtype=np.float32)) / np.float32(math.sqrt(fan_in) * INT4_RMS))


def _int4_shape(g, name, rng, shape, dtype):
    out, words = g.specs[name.removesuffix("_shape") + "_packed"][0]
    return np.array([out, words * 8], dtype=np.int32)


GENERATORS = [  # (name suffix, generator), first match wins
    ("e_score_correction_bias", _bias), ("norm.weight", _norm), ("embed_tokens.weight", _embedding),
    (".weight_packed", _int4_codes), (".weight_scale", _int4_scale), (".weight_shape", _int4_shape),
    (".weight_scale_inv", _fp8_scale), (".weight", _linear),
]


class _Values:
    """make(name) for write_checkpoint_lazy: values of `specs` from per-tensor seeded generators."""

    def __init__(self, specs: dict, seed: int, prefix: str = "", group: int = 32):
        self.specs, self.seed, self.prefix, self.group = specs, seed, prefix, group

    def __call__(self, name: str):
        shape, dtype = self.specs[name]
        bare = name.removeprefix(self.prefix)
        rng = np.random.default_rng([self.seed, zlib.crc32(bare.encode())])
        gen = next(fn for suffix, fn in GENERATORS if bare.endswith(suffix))
        return gen(self, name, rng, shape, dtype)


# ---------------------------------------------------------------- counter scheme: any slice, without the rest

GOLDEN = 0x9E3779B9


def _mix32(x):
    """lowbias32, a bijective 32-bit finaliser, in place on a u32 array (NumPy or CuPy: the same bits)."""
    x ^= x >> 16
    x *= np.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= np.uint32(0x846CA68B)
    x ^= x >> 16
    return x


def tensor_key(seed: int, bare: str) -> int:
    """The 32-bit key of tensor `bare` (name without prefix) under `seed`."""
    folded = np.array([(seed ^ (seed >> 32) ^ GOLDEN) & 0xFFFFFFFF], np.uint32)
    return int(_mix32(_mix32(folded) ^ np.uint32(zlib.crc32(bare.encode())))[0])


def _flat_index(shape, index, xp):
    """u32 C-order indices into a tensor of `shape` of the elements that `index` (slices, step 1) selects,
    shaped like the slice."""
    flat = None
    for k, (s, n) in enumerate(zip(index, shape)):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"counter scheme: slices need step 1, got {s}")
        axis = xp.arange(start, stop, dtype=xp.uint32) * np.uint32(math.prod(shape[k + 1:]))
        axis = axis.reshape((-1,) + (1,) * (len(shape) - k - 1))
        flat = axis if flat is None else flat + axis
    return flat


def _bits(key: int, flat):
    """u32 random bits of the elements at `flat` (two hash rounds keyed by the tensor)."""
    h = _mix32(flat ^ np.uint32(key))
    h += np.uint32(key)
    return _mix32(h)


def _sym(h, xp, std: float):
    """f32 U[-a, a) with std `std` from the top 24 bits (as _uniform: U[0, 1) - 0.5, times 2 sqrt(3) std)."""
    u = (h >> 8).astype(xp.float32)
    u *= np.float32(2.0 ** -24)
    u -= np.float32(0.5)
    u *= np.float32(2 * math.sqrt(3) * std)
    return u


def bf16_bits(x):
    """f32 (finite) -> bf16 bit patterns u16, round to nearest even: f32_to_bf16 for NumPy or CuPy arrays."""
    u = x.view(np.uint32)
    r = u >> 16
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= 16
    return r.astype(np.uint16)


def _c_norm(h, xp, shape, group):
    v = _sym(h, xp, 0.1 / math.sqrt(3))
    v += np.float32(1)
    return bf16_bits(v)


def _c_bias(h, xp, shape, group):
    return _sym(h, xp, 0.05 / math.sqrt(3))


def _c_embedding(h, xp, shape, group):
    return bf16_bits(_sym(h, xp, 1.0))


def _c_linear(h, xp, shape, group):
    return bf16_bits(_sym(h, xp, 1 / math.sqrt(shape[1])))


def _c_int4_codes(h, xp, shape, group):
    return h.view(np.int32)


def _c_int4_scale(h, xp, shape, group):
    u = (h >> 8).astype(xp.float32)
    u *= np.float32(2.0 ** -24)
    u += np.float32(0.5)
    u *= np.float32(1 / (math.sqrt(shape[1] * group) * INT4_RMS))
    return bf16_bits(u)


COUNTER_GENERATORS = [  # (name suffix, generator of the counter scheme), first match wins; as GENERATORS
    ("e_score_correction_bias", _c_bias), ("norm.weight", _c_norm), ("embed_tokens.weight", _c_embedding),
    (".weight_packed", _c_int4_codes), (".weight_scale", _c_int4_scale), (".weight_shape", None),
    (".weight_scale_inv", "fp8"), (".weight", _c_linear),
]


def counter_slice(specs: dict, name: str, index, seed: int, group: int = 32, prefix: str = "", xp=np):
    """Tensor `name` of `specs` ({name: (shape, dtype)}) at `index` (a tuple of slices, step 1) under the counter
    scheme, as an xp array (numpy or cupy; weight_shape: always a NumPy i32[2]). Values depend on (seed, name
    without prefix, element index) only, so every slice equals that slice of the whole tensor. Made in row blocks
    of about CHUNK values (bounded scratch)."""
    shape, _ = specs[name]
    bare = name.removeprefix(prefix)
    gen = next(fn for suffix, fn in COUNTER_GENERATORS if bare.endswith(suffix))
    if gen is None:
        out, words = specs[name.removesuffix("_shape") + "_packed"][0]
        return np.array([out, words * 8], dtype=np.int32)
    if gen == "fp8":
        raise ValueError(f"{name}: the counter scheme makes int4 or bf16 checkpoints, not fp8")
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    rows = range(*index[0].indices(shape[0]))
    per_row = math.prod(len(range(*s.indices(n))) for s, n in zip(index[1:], shape[1:]))
    step, key, out = max(1, CHUNK // max(1, per_row)), tensor_key(seed, bare), None
    for r0 in range(rows.start, max(rows.stop, rows.start + 1), step):
        r1 = min(r0 + step, rows.stop)
        part = gen(_bits(key, _flat_index(shape, (slice(r0, r1),) + index[1:], xp)), xp, shape, group)
        if r1 - r0 == len(rows):
            return part
        if out is None:
            out = xp.empty((len(rows),) + part.shape[1:], part.dtype)
        out[r0 - rows.start:r1 - rows.start] = part
    return out


class _CounterValues:
    """make(name) for write_checkpoint_lazy under the counter scheme: row chunks of the whole tensor."""

    def __init__(self, specs: dict, seed: int, prefix: str = "", group: int = 32):
        if max(math.prod(s) for s, _ in specs.values()) >= 1 << 32:
            raise ValueError("counter scheme: a tensor has 2**32 elements or more (u32 element indices)")
        self.specs, self.seed, self.prefix, self.group = specs, seed, prefix, group

    def __call__(self, name: str):
        shape, _ = self.specs[name]
        if len(shape) < 2:
            return counter_slice(self.specs, name, (), self.seed, self.group, self.prefix)
        step = max(1, CHUNK // math.prod(shape[1:]))
        return (counter_slice(self.specs, name, (slice(r, min(r + step, shape[0])),), self.seed, self.group,
                              self.prefix) for r in range(0, shape[0], step))


SCHEMES = {"stream": _Values, "counter": _CounterValues}


# ---------------------------------------------------------------- writers

def write_target(out_dir, config: dict, seed: int = 0, shard_mb: float | None = None, scheme: str = "stream") -> Path:
    """Write config.json and random safetensors for a target config dict; returns the folder. scheme: stream
    (per-tensor generator streams) or counter (hashed element indices; see counter_slice)."""
    from numbaengine.config import load_config
    cfg = load_config(config)
    specs = {cfg.prefix + n: s for n, s in target_tensors(cfg).items()}
    return _write(out_dir, config, specs, _values(scheme, specs, seed, cfg.prefix, cfg.quant.group_size), shard_mb)


def _values(scheme, specs, seed, prefix="", group=32):
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: {scheme!r} is not one of {', '.join(SCHEMES)}")
    return SCHEMES[scheme](specs, seed, prefix, group)


def _write(out_dir, config: dict, specs: dict, values, shard_mb) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_checkpoint_lazy(out, specs, values, int(shard_mb * 2**20) if shard_mb else None)
    return out


def default_target_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """DDTREE.md: n_draft ids spread evenly over 1..n_target-3 ([n_target // 2] for one)."""
    if n_draft == 1:
        return [n_target // 2]
    return [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)]


def draft_config(target, layers: int = 1, block_size: int = 8, target_layer_ids=None, heads=None, kv_heads=None,
                 head_dim=None, intermediate=None, rope_theta: float = 1e6, mask_token_id=None) -> dict:
    """DFlash drafter config.json for a target (folder or config dict). Defaults: head_dim min(128, H/4),
    heads H/head_dim, kv_heads heads/2, intermediate 2H, target_layer_ids as default_target_layer_ids."""
    from numbaengine.config import load_config
    cfg = load_config(target)
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = head_dim or min(128, h // 4)
    heads = heads or h // head_dim
    ids = list(target_layer_ids or default_target_layer_ids(n, layers))
    if not all(0 <= i < n for i in ids):
        raise ValueError(f"target_layer_ids: {ids} must lie in 0..{n - 1}")
    mask = cfg.vocab_size - 1 if mask_token_id is None else mask_token_id
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=h, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2), head_dim=head_dim,
                intermediate_size=intermediate or 2 * h, rms_norm_eps=cfg.rms_norm_eps, rope_theta=rope_theta,
                rope_scaling=None, vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
                hidden_act="silu", attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16",
                block_size=block_size, num_target_layers=n,
                dflash_config=dict(mask_token_id=mask, target_layer_ids=ids, block_size=block_size))


def write_draft(out_dir, target, layers: int = 1, block_size: int = 8, seed: int = 0, scheme: str = "stream",
                **kw) -> Path:
    """Write a random DFlash drafter for `target` (folder or config dict); kw as draft_config; scheme as
    write_target."""
    c = draft_config(target, layers, block_size, **kw)
    return _write(out_dir, c, draft_specs(c), _values(scheme, draft_specs(c), seed), None)


def draft_specs(c: dict) -> dict:
    """The tensors of a drafter config dict (draft_config's answer), as weights.layout.draft_tensors."""
    return draft_tensors(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                         c["num_key_value_heads"], c["head_dim"], c["intermediate_size"],
                         len(c["dflash_config"]["target_layer_ids"]))


# The published Kimi-K2.5-DFlash drafter: 6 Qwen3-style layers at hidden 7168, 64 query / 8 key-value heads of 128,
# MLP 18432, block 8, fed by target layers 1, 12, 24, 35, 47, 58 (its rope is YaRN at theta 50000; the engine's
# drafter ropes without YaRN, which costs the same).
K25_DFLASH = dict(layers=6, block_size=8, target_layer_ids=[1, 12, 24, 35, 47, 58], heads=64, kv_heads=8,
                  head_dim=128, intermediate=18432, rope_theta=50000.0)


def k25_dflash_config(target) -> dict:
    """draft_config at the K25_DFLASH shape for `target`; a target of fewer than 59 layers keeps the published
    layer ids it has (at least [layers // 2])."""
    from numbaengine.config import load_config
    n = load_config(target).num_hidden_layers
    kw = dict(K25_DFLASH)
    kw["target_layer_ids"] = [i for i in K25_DFLASH["target_layer_ids"] if i < n] or [n // 2]
    return draft_config(target, **kw)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m weights.synth", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--layers", type=int, help="target layers (preset default) or, with --draft, drafter layers (1)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", choices=["int4", "none", "fp8"], default="int4")
    ap.add_argument("--wrapper", choices=["k25"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mb", type=float)
    ap.add_argument("--draft", action="store_true", help="write a DFlash drafter for --target")
    ap.add_argument("--target", help="target checkpoint folder (with --draft)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--scheme", choices=sorted(SCHEMES), default="stream",
                    help="stream: a generator per tensor; counter: hashed element indices (any slice alone)")
    a = ap.parse_args(argv)
    if a.draft:
        if not a.target:
            ap.error("--draft needs --target DIR")
        out = write_draft(a.out, a.target, layers=a.layers or 1, block_size=a.block_size, seed=a.seed,
                          scheme=a.scheme)
    else:
        out = write_target(a.out, synth_config(a.preset, a.layers, a.quant, a.wrapper), a.seed, a.shard_mb,
                           a.scheme)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB of safetensors)")


if __name__ == "__main__":
    main()
