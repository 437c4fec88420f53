"""Every tensor a checkpoint holds, as data: {name: (shape, safetensors dtype)}, the one source of truth for names.

Target (MODEL.md section 2; names without the `language_model.` prefix). Linear weights are [out, in] and stored:
  bf16:  <m>.weight BF16
  int4 (routed experts only): <m>.weight_packed I32 [out, in/8], <m>.weight_scale BF16 [out, in/group],
         <m>.weight_shape I32 [2] = [out, in]   (real files may use I64 for weight_shape)
  fp8 (every linear except the router gate, embeddings and lm_head): <m>.weight F8_E4M3 [out, in] and
         <m>.weight_scale_inv F32 [ceil(out/128), ceil(in/128)]
Norms are BF16 [d]; the router bias `e_score_correction_bias` is F32 [E].
Drafter (DDTREE.md section 1): unprefixed Qwen3-style layers plus fc / hidden_norm / norm, all BF16.
"""
from __future__ import annotations

from .fp8 import scale_shape

BF16, F32, I32, F8 = "BF16", "F32", "I32", "F8_E4M3"
Tensors = dict[str, tuple[tuple[int, ...], str]]


def target_tensors(cfg) -> Tensors:
    """All tensors of a target ModelConfig (duck-typed), in layer order."""
    v, h = cfg.vocab_size, cfg.hidden_size
    t: Tensors = {"model.embed_tokens.weight": ((v, h), BF16)}
    for layer in range(cfg.num_hidden_layers):
        t.update(layer_tensors(cfg, layer))
    t["model.norm.weight"] = ((h,), BF16)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = ((v, h), BF16)
    return t


def layer_tensors(cfg, layer: int) -> Tensors:
    p, h = f"model.layers.{layer}.", cfg.hidden_size
    t: Tensors = {p + "input_layernorm.weight": ((h,), BF16)}
    for module, out, inp in attention_linears(cfg):
        t.update(linear(p + module, out, inp, cfg))
    t[p + "self_attn.q_a_layernorm.weight"] = ((cfg.q_lora_rank,), BF16)
    t[p + "self_attn.kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), BF16)
    t[p + "post_attention_layernorm.weight"] = ((h,), BF16)
    if layer < cfg.first_k_dense_replace:
        for module, out, inp in mlp_linears("mlp.", cfg.intermediate_size, h):
            t.update(linear(p + module, out, inp, cfg))
        return t
    e = cfg.n_routed_experts
    t[p + "mlp.gate.weight"] = ((e, h), BF16)
    t[p + "mlp.gate.e_score_correction_bias"] = ((e,), F32)
    if cfg.n_shared_experts:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        for module, out, inp in mlp_linears("mlp.shared_experts.", shared, h):
            t.update(linear(p + module, out, inp, cfg))
    for x in range(e):
        for module, out, inp in mlp_linears(f"mlp.experts.{x}.", cfg.moe_intermediate_size, h):
            t.update(linear(p + module, out, inp, cfg, routed=True))
    return t


def attention_linears(cfg) -> list[tuple[str, int, int]]:
    """(module, out, in) of the MLA projections."""
    nh, h = cfg.num_attention_heads, cfg.hidden_size
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return [("self_attn.q_a_proj", cfg.q_lora_rank, h),
            ("self_attn.q_b_proj", nh * (nope + rope), cfg.q_lora_rank),
            ("self_attn.kv_a_proj_with_mqa", cfg.kv_lora_rank + rope, h),
            ("self_attn.kv_b_proj", nh * (nope + v), cfg.kv_lora_rank),
            ("self_attn.o_proj", h, nh * v)]


def mlp_linears(prefix: str, inter: int, hidden: int) -> list[tuple[str, int, int]]:
    """(module, out, in) of a SwiGLU MLP."""
    return [(prefix + "gate_proj", inter, hidden), (prefix + "up_proj", inter, hidden),
            (prefix + "down_proj", hidden, inter)]


def linear(module: str, out: int, inp: int, cfg, routed: bool = False) -> Tensors:
    """The stored tensors of one linear weight [out, in] under cfg.quant."""
    method = cfg.quant.method
    if method == "fp8":
        return {module + ".weight": ((out, inp), F8), module + ".weight_scale_inv": (scale_shape(out, inp), F32)}
    if method == "int4" and routed:
        return {module + ".weight_packed": ((out, inp // 8), I32),
                module + ".weight_scale": ((out, inp // cfg.quant.group_size), BF16),
                module + ".weight_shape": ((2,), I32)}
    return {module + ".weight": ((out, inp), BF16)}


def draft_tensors(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                  n_target_layers: int) -> Tensors:
    """DFlash drafter tensors; n_target_layers = number of target feature layers (len(target_layer_ids))."""
    h, hd = hidden, head_dim
    t: Tensors = {"fc.weight": ((h, n_target_layers * h), BF16), "hidden_norm.weight": ((h,), BF16)}
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = ((h,), BF16)
        t[p + "self_attn.q_proj.weight"] = ((heads * hd, h), BF16)
        t[p + "self_attn.k_proj.weight"] = ((kv_heads * hd, h), BF16)
        t[p + "self_attn.v_proj.weight"] = ((kv_heads * hd, h), BF16)
        t[p + "self_attn.o_proj.weight"] = ((h, heads * hd), BF16)
        t[p + "self_attn.q_norm.weight"] = ((hd,), BF16)
        t[p + "self_attn.k_norm.weight"] = ((hd,), BF16)
        t[p + "post_attention_layernorm.weight"] = ((h,), BF16)
        for module, out, inp in mlp_linears("mlp.", intermediate, h):
            t[p + module + ".weight"] = ((out, inp), BF16)
    t["norm.weight"] = ((h,), BF16)
    return t
