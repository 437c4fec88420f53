"""PyTorch twins of the engine's target (DeepSeek-V3 / K2: MLA + sigmoid-routed MoE) and DFlash drafter, for training.

Math follows spec/MODEL.md and spec/DDTREE.md exactly (checked against HF DeepseekV3ForCausalLM by
tools/train/verify_hf.py). Module names follow the checkpoint names, so state_dict() is nearly the export.
Routed experts are computed densely (all experts, zero gate for the unpicked): three large matmuls, which is
the fast way at this size and identical in exact arithmetic to the sparse sum.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TargetDims:
    vocab_size: int = 4096
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    q_lora_rank: int = 192
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    intermediate_size: int = 1024
    moe_intermediate_size: int = 256
    n_routed_experts: int = 16
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn_factor: float = 4.0
    original_max_position_embeddings: int = 512
    max_position_embeddings: int = 2048


@dataclass
class DraftDims:
    hidden_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 16
    mask_token_id: int = 1
    target_layer_ids: list = field(default_factory=lambda: [1, 3, 5])


def dims_dict(d) -> dict:
    return asdict(d)


# ---------------------------------------------------------------- shared pieces

class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalized in fp32."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y.to(x.dtype)).to(x.dtype)


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def yarn_inv_freq(dim, theta, factor, orig_max, beta_fast=32.0, beta_slow=1.0) -> torch.Tensor:
    """YaRN inv_freq f32[dim/2] as HF computes it (truncated correction range); plain rope when factor <= 1."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra = 1.0 / base
    if factor <= 1:
        return extra.float()

    def corr(rot):
        return dim * math.log(orig_max / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return (extra / factor * ramp + extra * (1 - ramp)).float()


def cos_sin(pos, inv_freq):
    """pos i64[B, T] -> cos, sin f32[B, T, 1, d/2]."""
    ang = pos.float()[..., None] * inv_freq.to(pos.device)
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


def rope_pairs(x, cos, sin):
    """Adjacent-pair rope (DeepSeek checkpoints): pair (2i, 2i+1) rotates by angle i. x [B, T, h, d]."""
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2).to(x.dtype)


def rope_half(x, cos, sin):
    """Rotate-half rope (Qwen3): (i, i + d/2) rotate by angle i. x [B, T, h, d]."""
    a, b = x.float().chunk(2, -1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1).to(x.dtype)


def fake_int4(w, group=32):
    """Straight-through INT4 fake quant along the last dim, exactly weights.int4.quantize_int4's rounding."""
    shp = w.shape
    g = w.float().reshape(*shp[:-1], shp[-1] // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7.5).to(torch.bfloat16).float()
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0 ** -7), scale)
    wq = (torch.clamp(torch.round(g / scale), -8, 7) * scale).reshape(shp).to(w.dtype)
    return w + (wq - w).detach()


# ---------------------------------------------------------------- target

class KVCache:
    """Expanded per-head K/V for batched greedy generation (training-side only; the engine caches latents)."""

    def __init__(self, n_layers, batch, heads, max_len, dk, device, dtype):
        self.k = [torch.zeros(batch, heads, max_len, dk, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(batch, heads, max_len, dk, device=device, dtype=dtype) for _ in range(n_layers)]
        self.length = 0

    def append(self, layer, k, v):
        t = k.shape[2]
        self.k[layer][:, :, self.length:self.length + t] = k
        self.v[layer][:, :, self.length:self.length + t] = v
        return self.k[layer][:, :, :self.length + t], self.v[layer][:, :, :self.length + t]


class MLA(nn.Module):
    """Multi-head latent attention, naive (expanded) form."""

    def __init__(self, d: TargetDims, layer: int):
        super().__init__()
        self.d, self.layer = d, layer
        h, nh = d.hidden_size, d.num_attention_heads
        self.q_a_proj = nn.Linear(h, d.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(d.q_lora_rank, nh * (d.qk_nope_head_dim + d.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, d.kv_lora_rank + d.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, nh * (d.qk_nope_head_dim + d.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * d.v_head_dim, h, bias=False)
        qk = d.qk_nope_head_dim + d.qk_rope_head_dim
        m = 0.1 * math.log(d.yarn_factor) + 1.0 if d.yarn_factor > 1 else 1.0
        self.scale = qk ** -0.5 * m * m

    def forward(self, x, cos, sin, cache=None):
        d, (b, t, _) = self.d, x.shape
        nh, nope, rope, vd = d.num_attention_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, nh, nope + rope)
        q_nope, q_pe = q.split([nope, rope], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, rope], -1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(b, t, nh, nope + vd).split([nope, vd], -1)
        q_pe, k_pe = rope_pairs(q_pe, cos, sin), rope_pairs(k_pe[:, :, None, :], cos, sin)
        q = torch.cat((q_nope, q_pe), -1).transpose(1, 2)                          # [B, nh, T, qk]
        k = torch.cat((k_nope, k_pe.expand(b, t, nh, rope)), -1).transpose(1, 2)
        v = F.pad(v, (0, nope + rope - vd)).transpose(1, 2)                         # pad v to qk width
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.scale)
        return self.o_proj(o[..., :vd].transpose(1, 2).reshape(b, t, nh * vd))


class MoE(nn.Module):
    """Sigmoid router with correction bias (selection only), top-k, normalized, scaled; SiLU experts + shared."""

    def __init__(self, d: TargetDims):
        super().__init__()
        e, h, i = d.n_routed_experts, d.hidden_size, d.moe_intermediate_size
        self.d = d
        self.gate = nn.Linear(h, e, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.experts_gate = nn.Parameter(torch.empty(e, i, h))      # [E, I, H]
        self.experts_up = nn.Parameter(torch.empty(e, i, h))        # [E, I, H]
        self.experts_down = nn.Parameter(torch.empty(e, h, i))      # [E, H, I]
        self.shared_experts = MLP(h, i * d.n_shared_experts)
        self.fake_quant = False
        self.load = None                                             # per-expert token counts of the last call
        self.frozen = None                                           # eval-mode stacked weights, see freeze()

    def route(self, x):
        """x [N, H] -> gates f32[N, E] (zero outside the top-k)."""
        d = self.d
        with torch.autocast(x.device.type, enabled=False):
            s = torch.sigmoid(x.float() @ self.gate.weight.float().t())                 # [N, E]
        idx = torch.topk(s.detach() + self.gate.e_score_correction_bias, d.num_experts_per_tok, -1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * d.routed_scaling_factor
        if self.training:
            self.load = torch.bincount(idx.flatten(), minlength=d.n_routed_experts).detach()
        return torch.zeros_like(s).scatter(1, idx, w)

    def stacked(self):
        """(W_gate_up [E*2I, H], W_down [H, E*I]) as used by forward; cached while frozen."""
        if self.frozen is not None:
            return self.frozen
        ws = (self.experts_gate, self.experts_up, self.experts_down)
        wg, wu, wd = tuple(fake_int4(w) for w in ws) if self.fake_quant else ws
        e, h, i = wd.shape
        return torch.cat((wg, wu), 1).reshape(e * 2 * i, h), wd.permute(1, 0, 2).reshape(h, e * i)

    def freeze(self, dtype):
        """Cache the stacked expert weights in `dtype` (frozen target: generation, drafter training)."""
        self.frozen = None
        with torch.no_grad():
            self.frozen = tuple(w.to(dtype) for w in self.stacked())

    def forward(self, x):
        shp, (e, h, i) = x.shape, self.experts_down.shape
        xf = x.reshape(-1, h)
        gates = self.route(xf)                                                           # [N, E]
        w13, w2 = self.stacked()
        gu = F.linear(xf, w13).view(-1, e, 2 * i)
        a = F.silu(gu[..., :i]) * gu[..., i:] * gates[:, :, None].to(gu.dtype)           # [N, E, I]
        y = F.linear(a.reshape(-1, e * i), w2)                                           # [N, H]
        return (y + self.shared_experts(xf)).view(shp)


class Layer(nn.Module):
    def __init__(self, d: TargetDims, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = MLA(d, layer)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = MoE(d) if layer >= d.first_k_dense_replace else MLP(d.hidden_size, d.intermediate_size)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Target(nn.Module):
    """The K2-architecture target. forward -> (logits, [hidden after layer L for L in hidden_ids])."""

    def __init__(self, d: TargetDims):
        super().__init__()
        self.d = d
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size)
        self.layers = nn.ModuleList(Layer(d, i) for i in range(d.num_hidden_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
        self.register_buffer("inv_freq", yarn_inv_freq(d.qk_rope_head_dim, d.rope_theta, d.yarn_factor,
                                                       d.original_max_position_embeddings), persistent=False)

    def moe_layers(self):
        return [l.mlp for l in self.layers if isinstance(l.mlp, MoE)]

    def forward(self, ids, pos=None, hidden_ids=(), cache=None, logits=True):
        b, t = ids.shape
        if pos is None:
            start = cache.length if cache is not None else 0
            pos = torch.arange(start, start + t, device=ids.device).expand(b, t)
        cos, sin = cos_sin(pos, self.inv_freq)
        x, hidden = self.embed_tokens(ids), []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache)
            if i in hidden_ids:
                hidden.append(x)
        if cache is not None:
            cache.length += t
        out = self.lm_head(self.norm(x)) if logits else None
        return out, [hidden[sorted(hidden_ids).index(i)] for i in hidden_ids]

    def new_cache(self, batch, max_len, dtype):
        d = self.d
        return KVCache(d.num_hidden_layers, batch, d.num_attention_heads, max_len,
                       d.qk_nope_head_dim + d.qk_rope_head_dim, self.inv_freq.device, dtype)


def init_target(model: Target, seed: int, std=0.02):
    """Normal(0, std) weights, output projections scaled by 1/sqrt(2 * layers), norms 1, biases 0."""
    g = torch.Generator().manual_seed(seed)
    out_scale = 1 / math.sqrt(2 * model.d.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = std * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight", "experts_down")) else 1)
                p.copy_(torch.randn(p.shape, generator=g) * s)


# ---------------------------------------------------------------- drafter

class DraftAttention(nn.Module):
    """Qwen3 attention: per-head q/k RMSNorm, rotate-half rope, GQA; keys/values = [context ; block], no mask."""

    def __init__(self, d: DraftDims):
        super().__init__()
        self.d = d
        h, nh, kv, hd = d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, kv * hd, bias=False)
        self.v_proj = nn.Linear(h, kv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, d.rms_norm_eps)
        self.k_norm = RMSNorm(hd, d.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B, S, H] -> roped k, v [B, kv, S, hd]."""
        b, s, _ = x.shape
        k = rope_half(self.k_norm(self.k_proj(x).view(b, s, -1, self.d.head_dim)), cos, sin)
        return k.transpose(1, 2), self.v_proj(x).view(b, s, -1, self.d.head_dim).transpose(1, 2)

    def forward(self, x, ctx, cq, sq, cc, sc, mask):
        d, (b, q_len, _) = self.d, x.shape
        q = rope_half(self.q_norm(self.q_proj(x).view(b, q_len, -1, d.head_dim)), cq, sq).transpose(1, 2)
        kc, vc = self.kv(ctx, cc, sc)
        kb, vb = self.kv(x, cq, sq)
        rep = d.num_attention_heads // d.num_key_value_heads
        k = torch.cat((kc, kb), 2).repeat_interleave(rep, 1)
        v = torch.cat((vc, vb), 2).repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d.head_dim ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))


class DraftLayer(nn.Module):
    def __init__(self, d: DraftDims):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = DraftAttention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = MLP(d.hidden_size, d.intermediate_size)

    def forward(self, x, ctx, rope, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, *rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """DFlash drafter: block embeddings [B, Q, H] + target features [B, C, F*H] -> normed hidden [B, Q, H]."""

    def __init__(self, d: DraftDims):
        super().__init__()
        self.d = d
        self.fc = nn.Linear(len(d.target_layer_ids) * d.hidden_size, d.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(d) for _ in range(d.num_hidden_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        inv = 1.0 / d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float64) / d.head_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, block_emb, block_pos, feats, ctx_pos, mask=None):
        """mask bool [B, 1, Q, C+Q] (True = visible) or None (everything visible)."""
        ctx = self.hidden_norm(self.fc(feats))
        rope = cos_sin(block_pos, self.inv_freq) + cos_sin(ctx_pos, self.inv_freq)
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, rope, mask)
        return self.norm(x)


def init_drafter(model: Drafter, seed: int, std=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * std)
