"""Target-model config: read the config.json of DeepSeek-V3, Kimi K2 (`kimi_k2`) and Kimi K2.5/K2.6 (`kimi_k25`).

Every field is validated once here; a bad file fails with one line naming the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that the engine cannot run; the message names the field."""


MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")

# Optional fields and their DeepSeek-V3 defaults (HF DeepseekV3Config).
DEFAULTS = dict(
    intermediate_size=18432, moe_intermediate_size=2048, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
POSITIVE = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
INTEGER = REQUIRED + ("intermediate_size", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
                      "num_experts_per_tok", "first_k_dense_replace", "n_group", "topk_group", "q_lora_rank",
                      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling (DeepSeek-V3 flavour)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class Quant:
    """How the checkpoint stores weights: `none` (bf16), `int4` (routed experts, compressed-tensors
    pack-quantized, symmetric, per-group scales) or `fp8` (e4m3 with 128x128 block scales)."""
    method: str = "none"
    group_size: int = 32
    block: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_routed_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list | None
    yarn: Yarn | None = None
    quant: Quant = field(default_factory=Quant)
    prefix: str = ""              # tensor-name prefix: "language_model." for the kimi_k25 wrapper

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent cache: [c_kv | roped k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = 0.1 * self.yarn.mscale_all_dim * math.log(self.yarn.factor) + 1.0 if self.yarn.factor > 1 else 1.0
            scale *= m * m
        return scale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else tuple(e) if isinstance(e, list) else (e,)


def load_config(path) -> ModelConfig:
    """Parse `path` (a checkpoint folder, a config.json path, or an already-loaded dict)."""
    return parse_config(read_config_json(path))


def read_config_json(path, what="config.json") -> dict:
    """The JSON object of a config: `path` is a folder holding config.json, the file itself, or a dict."""
    if isinstance(path, dict):
        return path
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise ConfigError(f"{p}: no {what} found")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    return raw


def parse_config(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type: {model_type!r} is not supported (expected one of {', '.join(MODEL_TYPES)})")
    prefix = ""
    quant_raw = raw.get("quantization_config")
    if model_type == "kimi_k25":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError("text_config: missing in a kimi_k25 config (the text model lives there)")
        text = raw["text_config"]
        quant_raw = quant_raw or text.get("quantization_config")
        prefix = "language_model."
    else:
        text = raw
    vals = {k: text.get(k, DEFAULTS.get(k)) for k in list(REQUIRED) + list(DEFAULTS)}
    for k in REQUIRED:
        if vals[k] is None:
            raise ConfigError(f"{k}: required field missing")
    if vals["q_lora_rank"] is None:
        raise ConfigError("q_lora_rank: null (direct q_proj, DeepSeek-V2-Lite style) is not supported")
    _check_ints(vals)
    if vals["scoring_func"] != "sigmoid":
        raise ConfigError(f"scoring_func: {vals['scoring_func']!r} is not supported (only 'sigmoid')")
    if vals["topk_method"] not in ("noaux_tc",):
        raise ConfigError(f"topk_method: {vals['topk_method']!r} is not supported (only 'noaux_tc')")
    rope, yarn = _parse_rope(text)
    vals["rope_theta"] = float(rope.get("rope_theta", vals["rope_theta"]))
    del vals["scoring_func"], vals["topk_method"]
    cfg = ModelConfig(model_type=model_type, yarn=yarn, quant=_parse_quant(quant_raw), prefix=prefix, **vals)
    _check_shapes(cfg)
    return cfg


def _check_ints(vals: dict) -> None:
    for k in POSITIVE:
        if not isinstance(vals[k], (int, float)) or vals[k] <= 0:
            raise ConfigError(f"{k}: must be a positive number, got {vals[k]!r}")
    for k in INTEGER:
        v = vals[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if k in REQUIRED else 0):
            raise ConfigError(f"{k}: must be a {'positive' if k in REQUIRED else 'non-negative'} integer, got {v!r}")


def _check_shapes(c: ModelConfig) -> None:
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even, got {c.qk_rope_head_dim}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError("num_experts_per_tok: larger than n_routed_experts")
    if c.n_group < 1 or c.n_routed_experts % c.n_group:
        raise ConfigError(f"n_group: {c.n_group} does not divide n_routed_experts {c.n_routed_experts}")
    if not 1 <= c.topk_group <= c.n_group:
        raise ConfigError(f"topk_group: must be in 1..n_group, got {c.topk_group}")
    if c.n_group > 1 and c.topk_group * (c.n_routed_experts // c.n_group) < c.num_experts_per_tok:
        raise ConfigError("topk_group: the kept groups hold fewer experts than num_experts_per_tok")
    if c.quant.method == "int4" and c.first_k_dense_replace < c.num_hidden_layers:
        for name, width in (("hidden_size", c.hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)):
            if width % c.quant.group_size or width % 8:
                raise ConfigError(f"{name}: {width} is not a multiple of the INT4 group size {c.quant.group_size}")


def _parse_rope(text: dict) -> tuple[dict, Yarn | None]:
    """Accept both `rope_scaling` (older files) and `rope_parameters` (transformers 5.x, rope_theta inside)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_scaling: must be an object, got {type(rope).__name__}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return rope, None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type: {kind!r} is not supported (only 'yarn' or none)")
    for k in ("factor", "original_max_position_embeddings"):
        if not isinstance(rope.get(k), (int, float)) or rope[k] <= 0:
            raise ConfigError(f"rope_scaling.{k}: required positive number for yarn, got {rope.get(k)!r}")
    yarn = Yarn(factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=float(rope.get("mscale") if rope.get("mscale") is not None else 1.0),
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    return rope, yarn


def _parse_quant(q: dict | None) -> Quant:
    if not q:
        return Quant("none")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size", [128, 128])
        if list(block) != [128, 128]:
            raise ConfigError(f"quantization_config.weight_block_size: {block} is not supported (only [128, 128])")
        return Quant("fp8", block=(128, 128))
    if method != "compressed-tensors":
        raise ConfigError(f"quantization_config.quant_method: {method!r} is not supported "
                          "(expected 'compressed-tensors' or 'fp8')")
    if q.get("format") != "pack-quantized":
        raise ConfigError(f"quantization_config.format: {q.get('format')!r} is not supported (only 'pack-quantized')")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"quantization_config.config_groups: expected exactly one group, got {len(groups)}")
    w = next(iter(groups.values())).get("weights") or {}
    want = dict(num_bits=4, type="int", symmetric=True, strategy="group")
    for k, v in want.items():
        if w.get(k) != v:
            raise ConfigError(f"quantization_config.config_groups.weights.{k}: {w.get(k)!r} is not supported "
                              f"(only {v!r})")
    gs = w.get("group_size")
    if not isinstance(gs, int) or gs <= 0 or gs % 8:
        raise ConfigError(f"quantization_config.config_groups.weights.group_size: {gs!r} must be a multiple of 8")
    return Quant("int4", group_size=gs)
