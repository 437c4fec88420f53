"""The K2 target model (DeepSeek-V3 architecture), written once as a sequence of named ops.

One forward serves prefill, decode and tree verify: a row of new tokens with explicit positions sees the committed
latent cache plus the new tokens its tree mask allows (causal when no mask is given). MLA runs in the naive form
(keys/values expanded per head; prefill) or the absorbed form (attention in the latent space; decode, verify).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.rope import rope_inv_freq
from numbaengine.checkpoint import Attn, Layer, Mlp, TargetWeights
from weights.dtypes import bf16_to_f32, f32_to_bf16

LATENT_NORM_EPS = 1e-6   # q_a / kv_a RMSNorm eps: DeepSeek's reference code and HF use the default, not the config's
CACHE_DTYPES = ("bf16", "float32")


@dataclass
class LatentCache:
    """Per-layer latent rows [c_kv | roped k_pe] of one sequence. Rows [0, length) are committed; a forward writes
    its new tokens at length.. and the caller commits the ones it keeps."""
    rows: list[np.ndarray]   # per layer: u16[max_len, latent] (bf16) or f32[max_len, latent]
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.rows[0].shape[0]

    def write(self, layer, start, latent):
        """Store latent f32[T, latent] at slots start..start+T-1 (rounded to bf16 in a bf16 cache)."""
        rows = self.rows[layer]
        rows[start:start + len(latent)] = f32_to_bf16(latent) if rows.dtype == np.uint16 else latent

    def read(self, layer, end) -> np.ndarray:
        """Rows [0, end) as f32[end, latent]."""
        rows = self.rows[layer][:end]
        return bf16_to_f32(rows) if rows.dtype == np.uint16 else rows.astype(np.float32)

    def commit(self, slots):
        """Move rows at absolute `slots` (path order) to length.., then advance length (DDTREE.md commit)."""
        slots = np.asarray(slots, np.int64)
        for rows in self.rows:
            rows[self.length:self.length + len(slots)] = rows[slots]
        self.length += len(slots)


class Target:
    """The target over one or more device shards (numbaengine/parallel.py). The partial results of the shards are
    summed by `all_reduce` (a plain sum here; NCCL on several GPUs) and lm_head parts are concatenated."""

    def __init__(self, cfg, shards: list[TargetWeights], ops, cache_dtype="bf16"):
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype: {cache_dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
        self.cfg, self.shards, self.ops, self.cache_dtype = cfg, shards, ops, cache_dtype
        self.w = shards[0]                       # replicated tensors (embedding, norms, router) are read from here
        self.inv_freq, self.rope_factor = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn)

    @staticmethod
    def all_reduce(parts):
        """Sum of the shards' partial outputs (reference all-reduce)."""
        return parts[0] if len(parts) == 1 else np.sum(parts, axis=0, dtype=np.float32)

    def new_cache(self, max_len: int) -> LatentCache:
        dtype = np.uint16 if self.cache_dtype == "bf16" else np.float32
        return LatentCache([np.zeros((max_len, self.cfg.latent_dim), dtype) for _ in range(self.cfg.num_hidden_layers)])

    # -- public pieces the drafter borrows ------------------------------------------------------------------
    def embed(self, tokens, out):
        """tokens i32[n] -> out f32[n, H]."""
        out[:] = bf16_to_f32(self.w.embed[np.asarray(tokens)])
        return out

    def lm_head(self, h, out):
        """h f32[n, H] (already normalized) -> out f32[n, V]; each shard computes its slice of the vocabulary."""
        v0 = 0
        for shard in self.shards:
            v1 = v0 + len(shard.lm_head)
            self.ops.gemm(h, shard.lm_head, out[:, v0:v1])
            v0 = v1
        return out

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, tokens, positions, cache: LatentCache, tree_mask=None, hidden_layers=(), form="absorbed"):
        """tokens i32[T], positions i32[T] -> (logits f32[T, V], hidden f32[len(hidden_layers), T, H])."""
        cfg, ops, T = self.cfg, self.ops, len(tokens)
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"context full: {start} committed + {T} new tokens > cache size {cache.max_len}")
        visible = _visibility(start, T, tree_mask)                          # [T, start+T]
        positions = np.asarray(positions, np.int32)
        hidden = np.empty((len(hidden_layers), T, cfg.hidden_size), np.float32)
        residual = self.embed(tokens, np.empty((T, cfg.hidden_size), np.float32))
        h = np.empty_like(residual)
        ops.rmsnorm(residual, self.w.layers[0].ln1, cfg.rms_norm_eps, h)
        for i, layer in enumerate(self.w.layers):
            a = self.all_reduce([self._attention(i, s.layers[i].attn, h, positions, cache, start, visible, form)
                                 for s in self.shards])
            ops.add_rmsnorm(a, residual, layer.ln2, cfg.rms_norm_eps, h)
            m = self.all_reduce([self._mlp(s.layers[i], h) for s in self.shards])
            nxt = self.w.layers[i + 1].ln1 if i + 1 < len(self.w.layers) else self.w.norm
            ops.add_rmsnorm(m, residual, nxt, cfg.rms_norm_eps, h)         # residual is now layer i's output
            if i in hidden_layers:
                hidden[list(hidden_layers).index(i)] = residual
        logits = self.lm_head(h, np.empty((T, cfg.vocab_size), np.float32))
        return logits, hidden

    def _attention(self, layer, w: Attn, x, pos, cache, start, visible, form):
        cfg, ops, T = self.cfg, self.ops, len(x)
        nh, nope, rope, v, r = (len(w.w_uk), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,   # nh: heads held here
                                cfg.v_head_dim, cfg.kv_lora_rank)
        cq = ops.gemm(x, w.q_a, np.empty((T, cfg.q_lora_rank), np.float32))
        ops.rmsnorm(cq, w.q_a_norm, LATENT_NORM_EPS, cq)
        q = ops.gemm(cq, w.q_b, np.empty((T, nh * (nope + rope)), np.float32)).reshape(T, nh, nope + rope)
        kv = ops.gemm(x, w.kv_a, np.empty((T, r + rope), np.float32))          # becomes the latent row
        ops.rmsnorm(kv[:, :r], w.kv_a_norm, LATENT_NORM_EPS, kv[:, :r])
        ops.rope(q[:, :, nope:], pos, self.inv_freq, q[:, :, nope:], True, self.rope_factor)
        ops.rope(kv[:, None, r:], pos, self.inv_freq, kv[:, None, r:], True, self.rope_factor)
        cache.write(layer, start, kv)                                          # same values from every shard
        latent = cache.read(layer, start + T)                                  # [S, r + rope]
        o = np.empty((T, nh, v), np.float32)
        if form == "naive":
            kvb = ops.gemm(latent[:, :r], w.kv_b, np.empty((len(latent), nh * (nope + v)), np.float32))
            kvb = kvb.reshape(-1, nh, nope + v)
            k = np.concatenate([kvb[:, :, :nope], np.broadcast_to(latent[:, None, r:], (len(latent), nh, rope))], -1)
            ops.attention(q, k, np.ascontiguousarray(kvb[:, :, nope:]), visible, cfg.softmax_scale, o)
        elif form == "absorbed":
            q_abs = np.empty((T, nh, r + rope), np.float32)                    # [q_lat | q_pe] per head
            ops.head_gemm(np.ascontiguousarray(q[:, :, :nope]), w.w_uk, q_abs[:, :, :r], False)
            q_abs[:, :, r:] = q[:, :, nope:]
            o_lat = np.empty((T, nh, r), np.float32)
            ops.attention(q_abs, latent[:, None, :], latent[:, None, :r], visible, cfg.softmax_scale, o_lat)
            ops.head_gemm(o_lat, w.w_uv, o, True)
        else:
            raise ValueError(f"form: {form!r} is not 'naive' or 'absorbed'")
        return ops.gemm(o.reshape(T, nh * v), w.o, np.empty((T, cfg.hidden_size), np.float32))

    def _mlp(self, layer: Layer, x):
        if layer.mlp is not None:
            return self._dense(layer.mlp, x)
        cfg, ops, moe, T = self.cfg, self.ops, layer.moe, len(x)
        idx = np.empty((T, cfg.num_experts_per_tok), np.int32)
        wts = np.empty((T, cfg.num_experts_per_tok), np.float32)
        ops.router(x, moe.gate, moe.bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                   cfg.routed_scaling_factor, idx, wts)
        out = ops.moe(x, idx, wts, moe.experts, np.empty_like(x))
        if moe.shared is not None:
            out += self._dense(moe.shared, x)
        return out

    def _dense(self, mlp: Mlp, x):
        ops, T, inter = self.ops, len(x), mlp.down.shape[1]
        gate_up = ops.gemm(x, mlp.gate_up, np.empty((T, 2 * inter), np.float32))
        act = ops.silu_mul(gate_up, np.empty((T, inter), np.float32))
        return ops.gemm(act, mlp.down, np.empty((T, x.shape[1]), np.float32))


def _visibility(start, T, tree_mask):
    """bool[T, start+T]: every committed row, then the new rows the mask allows (causal when mask is None)."""
    vis = np.ones((T, start + T), bool)
    vis[:, start:] = np.tril(np.ones((T, T), bool)) if tree_mask is None else np.asarray(tree_mask, bool)
    return vis
