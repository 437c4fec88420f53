"""Read a target checkpoint into per-layer weight records, validating every tensor against weights.layout.

Storage stays as in the file (bf16 as uint16 bits, INT4 packed words); FP8 weights are dequantized to bf16 here
(the reference path). Gate and up projections are stacked into one [2I, H] matrix per MLP / expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbaengine.parallel import check_divisible, expert_range, local_slice
from numbaengine.reference import Experts
from numbaengine.weights.dtypes import f32_to_bf16
from numbaengine.weights.fp8 import dequant_fp8_block
from numbaengine.weights.layout import target_tensors
from numbaengine.weights.shards import Checkpoint


@dataclass
class Attn:
    q_kv_a: np.ndarray       # u16[q_lora + kv_lora + rope, H]: q_a_proj stacked over kv_a_proj_with_mqa (same x)
    q_a_norm: np.ndarray     # u16[q_lora]
    q_b: np.ndarray          # u16[h*(nope+rope), q_lora]
    kv_a_norm: np.ndarray    # u16[kv_lora]
    kv_b: np.ndarray         # u16[h*(nope+v), kv_lora]
    w_uk: np.ndarray         # u16[h, kv_lora, nope]  view of kv_b, transposed per head (out, in like a linear)
    w_uv: np.ndarray         # u16[h, v, kv_lora]     view of kv_b
    o: np.ndarray            # u16[H, h*v]


@dataclass
class Mlp:
    gate_up: np.ndarray      # u16[2I, H]
    down: np.ndarray         # u16[H, I]


@dataclass
class Moe:
    gate: np.ndarray         # u16[E, H] router
    bias: np.ndarray         # f32[E] e_score_correction_bias
    experts: Experts
    shared: Mlp | None


@dataclass
class Layer:
    ln1: np.ndarray          # u16[H] input_layernorm
    ln2: np.ndarray          # u16[H] post_attention_layernorm
    attn: Attn
    mlp: Mlp | None          # dense layers
    moe: Moe | None          # MoE layers


@dataclass
class TargetWeights:
    embed: np.ndarray        # u16[V, H]
    norm: np.ndarray         # u16[H]
    lm_head: np.ndarray      # u16[V, H]
    layers: list[Layer]


class Reader:
    """Fetch device `rank`'s part (of n) of a tensor by its unprefixed name, checked against the layout table.
    Slices of memory-mapped files stay lazy; FP8 comes back dequantized to bf16."""

    def __init__(self, cfg, ckpt: Checkpoint, rank=0, n=1):
        self.cfg, self.ckpt, self.specs, self.rank, self.n = cfg, ckpt, target_tensors(cfg), rank, n

    def __call__(self, name):
        shape, dtype = self.specs[name]
        if name.endswith("weight_shape"):
            dtype = ("I32", "I64")                       # compressed-tensors itself writes int64
        w = self.ckpt.get_checked(self.cfg.prefix + name, shape, dtype)
        if dtype == "F8_E4M3":
            scale_name = name[: -len("weight")] + "weight_scale_inv"
            scale = self.ckpt.get_checked(self.cfg.prefix + scale_name, *self.specs[scale_name])
            w = f32_to_bf16(dequant_fp8_block(w, scale))
        return w[local_slice(name, shape, self.cfg, self.rank, self.n)]

    def linear(self, name):
        """A bf16 linear weight u16[out, in] (name without the `.weight` suffix)."""
        return self(name + ".weight")

    def stacked(self, prefix):
        """gate and up stacked as u16[2I, H], and down u16[H, I], of a dense MLP at prefix."""
        gate_up = np.concatenate([self.linear(prefix + ".gate_proj"), self.linear(prefix + ".up_proj")])
        return Mlp(gate_up, self.linear(prefix + ".down_proj"))


def load_target_weights(cfg, ckpt: Checkpoint, rank=0, n=1) -> TargetWeights:
    """Device `rank`'s shard of the target (the whole model when n = 1); see numbaengine/parallel.py."""
    check_divisible(cfg, n)
    read = Reader(cfg, ckpt, rank, n)
    layers = [_layer(cfg, read, i) for i in range(cfg.num_hidden_layers)]
    lm_head = read("model.embed_tokens.weight") if cfg.tie_word_embeddings else read("lm_head.weight")
    return TargetWeights(read("model.embed_tokens.weight"), read("model.norm.weight"), lm_head, layers)


def _layer(cfg, read: Reader, i: int) -> Layer:
    p = f"model.layers.{i}."
    attn = _attn(cfg, read, p + "self_attn.")
    ln1, ln2 = read(p + "input_layernorm.weight"), read(p + "post_attention_layernorm.weight")
    if not cfg.is_moe(i):
        return Layer(ln1, ln2, attn, read.stacked(p + "mlp"), None)
    shared = read.stacked(p + "mlp.shared_experts") if cfg.n_shared_experts else None
    moe = Moe(read(p + "mlp.gate.weight"), np.asarray(read(p + "mlp.gate.e_score_correction_bias"), np.float32),
              _experts(cfg, read, p + "mlp.experts."), shared)
    return Layer(ln1, ln2, attn, None, moe)


def _attn(cfg, read: Reader, p: str) -> Attn:
    h, nope, v, r = cfg.num_attention_heads // read.n, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv_b = read.linear(p + "kv_b_proj")
    per_head = kv_b.reshape(h, nope + v, r)
    q_kv_a = np.concatenate([read.linear(p + "q_a_proj"), read.linear(p + "kv_a_proj_with_mqa")])
    return Attn(q_kv_a, read(p + "q_a_layernorm.weight"), read.linear(p + "q_b_proj"),
                read(p + "kv_a_layernorm.weight"), kv_b, per_head[:, :nope].transpose(0, 2, 1), per_head[:, nope:],
                read.linear(p + "o_proj"))


def _experts(cfg, read: Reader, p: str) -> Experts:
    """Stack the routed experts this device holds: INT4 as packed words + scales, otherwise bf16."""
    E = expert_range(cfg, read.rank, read.n)
    if cfg.quant.method != "int4":
        mats = [read.stacked(f"{p}{e}") for e in E]
        return Experts(np.stack([m.gate_up for m in mats]), np.stack([m.down for m in mats]), offset=E.start)

    def part(e, proj, field):
        return read(f"{p}{e}.{proj}.{field}")

    gate_up = np.stack([np.concatenate([part(e, "gate_proj", "weight_packed"), part(e, "up_proj", "weight_packed")])
                        for e in E])
    gate_up_scale = np.stack([np.concatenate([part(e, "gate_proj", "weight_scale"),
                                              part(e, "up_proj", "weight_scale")]) for e in E])
    down = np.stack([part(e, "down_proj", "weight_packed") for e in E])
    down_scale = np.stack([part(e, "down_proj", "weight_scale") for e in E])
    for e in E:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _check_weight_shape(part(e, proj, "weight_shape"), read.specs[f"{p}{e}.{proj}.weight_packed"][0], p, e,
                                proj)
    return Experts(gate_up, down, gate_up_scale, down_scale, cfg.quant.group_size, offset=E.start)


def _check_weight_shape(stored, packed_shape, p, e, proj):
    want = (packed_shape[0], packed_shape[1] * 8)
    if tuple(int(x) for x in np.asarray(stored)) != want:
        raise ValueError(f"{p}{e}.{proj}.weight_shape: {list(np.asarray(stored))} does not match the packed "
                         f"weight (expected {list(want)})")
