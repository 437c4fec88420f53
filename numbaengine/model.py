"""The K2 target model (DeepSeek-V3 architecture), written once as a sequence of named ops.

One forward serves prefill, decode and tree verify: a row of new tokens with explicit positions sees the committed
latent cache plus the new tokens its tree mask allows (causal when no mask is given). MLA runs in the naive form
(keys/values expanded per head; prefill) or the absorbed form (attention in the latent space; decode, verify).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from numbaengine.checkpoint import Attn, Layer, Mlp, TargetWeights
from numbaengine.reference import rope_inv_freq

LATENT_NORM_EPS = 1e-6   # q_a / kv_a RMSNorm eps: DeepSeek's reference code and HF use the default, not the config's
CACHE_DTYPES = ("bf16", "float32")
FORMS = ("naive", "absorbed")


@dataclass
class LatentCache:
    """Per-layer latent rows [c_kv | roped k_pe] of one sequence, in the backend's arrays. Rows [0, length) are
    committed; a forward writes its new tokens at length.. and the caller commits the ones it keeps."""
    rows: list               # per layer: u16[max_len, latent] (bf16) or f32[max_len, latent]
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.rows[0].shape[0]

    def commit(self, slots):
        """Move rows at absolute `slots` (path order) to length.., then advance length (DDTREE.md commit)."""
        slots = np.asarray(slots, np.int64)
        for rows in self.rows:
            index = slots if isinstance(rows, np.ndarray) else slots.tolist()   # device arrays take a list
            rows[self.length:self.length + len(slots)] = rows[index]
        self.length += len(slots)


class Target:
    """The target over one or more device shards (numbaengine/parallel.py) on an op table (numbaengine/backends.py).
    The partial results of the shards are summed by `ops.all_reduce` and lm_head parts are concatenated.
    Intermediates come from `ops.scratch` (roles named below); the returned logits and hidden are fresh arrays."""

    def __init__(self, cfg, shards: list[TargetWeights], ops, cache_dtype="bf16"):
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype: {cache_dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
        if cache_dtype not in ops.cache_dtypes:
            raise ValueError(f"cache_dtype: backend {ops.name!r} keeps a {' or '.join(ops.cache_dtypes)} latent "
                             f"cache, not {cache_dtype!r}")
        if len(shards) > ops.max_shards:
            raise ValueError(f"devices: an op table of backend {ops.name!r} drives one shard, not {len(shards)} "
                             "(several devices: Engine.load(devices=[...]) makes a rank per device)")
        self.cfg, self.ops, self.cache_dtype = cfg, ops, cache_dtype
        self.shards = [ops.upload(s) for s in shards]
        self.w = self.shards[0]                  # replicated tensors (embedding, norms, router) are read from here
        inv_freq, self.rope_factor = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn)
        self.inv_freq = ops.asarray(inv_freq)

    def with_ops(self, ops) -> "Target":
        """The same weights driven through another table of the same backend (its own scratch)."""
        other = copy.copy(self)
        other.ops = ops
        return other

    def new_cache(self, max_len: int) -> LatentCache:
        dtype = np.uint16 if self.cache_dtype == "bf16" else np.float32
        return LatentCache([self.ops.zeros((max_len, self.cfg.latent_dim), dtype)
                            for _ in range(self.cfg.num_hidden_layers)])

    # -- public pieces the drafter borrows ------------------------------------------------------------------
    def embed(self, tokens, out):
        """tokens i32[n] -> out f32[n, H]."""
        return self.ops.embed(self.w.embed, self.ops.asarray(tokens, np.int32), out)

    def lm_head(self, h, out):
        """h f32[n, H] (already normalized) -> out f32[n, V]; each shard computes its slice of the vocabulary (a
        rank of several devices: its slice, then every rank's slices all-gathered)."""
        ops = self.ops
        if getattr(ops, "comm", None) is not None and len(self.w.lm_head) < out.shape[1]:
            part = ops.gemm(h, self.w.lm_head, ops.scratch("lm_head.part", (len(h), len(self.w.lm_head))))
            return ops.all_gather(part, out)
        v0 = 0
        for shard in self.shards:
            v1 = v0 + len(shard.lm_head)
            self.ops.gemm(h, shard.lm_head, out[:, v0:v1])
            v0 = v1
        return out

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, tokens, positions, cache: LatentCache, tree_mask=None, hidden_layers=(), form="absorbed"):
        """tokens i32[T], positions i32[T] -> (logits f32[T, V], hidden f32[len(hidden_layers), T, H]), both
        arrays of the backend. The new tokens' latent rows are written at cache.length.. (not committed)."""
        ops, T = self.ops, len(tokens)
        if form not in FORMS:
            raise ValueError(f"form: {form!r} is not 'naive' or 'absorbed'")
        if cache.length + T > cache.max_len:
            raise ValueError(f"context full: {cache.length} committed + {T} new tokens > cache size {cache.max_len}")
        visible = ops.visibility(cache.length, T, tree_mask, form)
        logits = ops.empty((T, self.cfg.vocab_size), np.float32)
        hidden = ops.empty((len(hidden_layers), T, self.cfg.hidden_size), np.float32)
        self.forward_into(tokens, positions, cache.rows, visible, logits, hidden, hidden_layers, form)
        return logits, hidden

    def forward_into(self, tokens, positions, rows, visible, logits, hidden, hidden_layers=(), form="absorbed"):
        """The forward into caller buffers (what a captured round calls). rows: per layer the cache rows of one
        sequence [cap, D] or of a batch [B, cap, D]; visible: the op table's visibility answer, which says where
        the new rows go and what each sees (for a batch: kernels' LatentVis with device lengths, ntok and tree
        bitmasks; the T rows are then B blocks of T/B). logits f32[T, V], hidden f32[len(hidden_layers), T, H]."""
        cfg, ops, T, H = self.cfg, self.ops, len(tokens), self.cfg.hidden_size
        positions = ops.asarray(positions, np.int32)
        residual = self.embed(tokens, ops.scratch("residual", (T, H)))
        h = ops.scratch("h", (T, H))
        ops.rmsnorm(residual, self.w.layers[0].ln1, cfg.rms_norm_eps, h)
        for i, layer in enumerate(self.w.layers):
            a = ops.all_reduce([self._attention(s.layers[i].attn, h, positions, rows[i], visible, form)
                                for s in self.shards])
            ops.add_rmsnorm(a, residual, layer.ln2, cfg.rms_norm_eps, h)
            m = ops.all_reduce([self._mlp(s.layers[i], h) for s in self.shards])
            nxt = self.w.layers[i + 1].ln1 if i + 1 < len(self.w.layers) else self.w.norm
            keep = hidden[list(hidden_layers).index(i)] if i in hidden_layers else None   # a drafter feature
            ops.add_rmsnorm(m, residual, nxt, cfg.rms_norm_eps, h, keep)   # residual is now layer i's output
        self.lm_head(h, logits)
        return logits, hidden

    def _attention(self, w: Attn, x, pos, rows, visible, form):
        cfg, ops, T = self.cfg, self.ops, len(x)
        nh, nope, rope, r = len(w.w_uk), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank  # nh: held here
        ql = cfg.q_lora_rank
        qkv = ops.gemm(x, w.q_kv_a, ops.scratch("q_kv_a", (T, ql + r + rope)))  # q_a and kv_a read x once
        kv = qkv[:, ql:]                                                       # kv becomes the latent row
        with ops.branch() as latent_done:                                      # beside the query path
            ops.rmsnorm(kv[:, :r], w.kv_a_norm, LATENT_NORM_EPS, kv[:, :r])
            ops.rope(kv[:, None, r:], pos, self.inv_freq, kv[:, None, r:], interleaved=True,
                     attn_factor=self.rope_factor)
            ops.cache_write(rows, visible, kv)                                 # same values from every shard
        cq = ops.rmsnorm(qkv[:, :ql], w.q_a_norm, LATENT_NORM_EPS, ops.scratch("q_a", (T, ql)))  # contiguous:
        # the q_b GEMM reads it in place (a strided x above one row costs the GEMM a packing launch)
        q = ops.gemm(cq, w.q_b, ops.scratch("q", (T, nh * (nope + rope)))).reshape(T, nh, nope + rope)
        mla = self._mla_naive if form == "naive" else self._mla_absorbed
        o = mla(w, q, pos, rows, visible, latent_done)                         # [T, nh, v]
        return ops.gemm(o.reshape(T, -1), w.o, ops.scratch("attn.out", (T, cfg.hidden_size)))

    def _mla_naive(self, w: Attn, q, pos, rows, visible, latent_done):
        """Keys and values expanded per head from the latent rows [0, S) (prefill; visible bool[T, S]), read
        once the branch writing the new rows (latent_done) has joined."""
        cfg, ops, (T, nh, _), S = self.cfg, self.ops, q.shape, visible.shape[1]
        nope, rope, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        ops.rope(q[:, :, nope:], pos, self.inv_freq, q[:, :, nope:], interleaved=True, attn_factor=self.rope_factor)
        latent_done.join()
        latent = ops.cache_read(rows, S, ops.scratch("latent", (S, r + rope)))
        kvb = ops.gemm(latent[:, :r], w.kv_b, ops.scratch("kvb", (S, nh * (nope + v)))).reshape(S, nh, nope + v)
        k = ops.scratch("k", (S, nh, nope + rope))
        ops.copy(kvb[:, :, :nope], k[:, :, :nope])
        ops.copy(latent[:, None, r:], k[:, :, nope:])                          # k_pe shared by every head
        vals = ops.copy(kvb[:, :, nope:], ops.scratch("v", (S, nh, v)))
        return ops.attention(q, k, vals, visible, cfg.softmax_scale, ops.scratch("o", (T, nh, v)))

    def _mla_absorbed(self, w: Attn, q, pos, rows, visible, latent_done):
        """Attention in the latent space: q_abs = [q_nope W_UK | rope(q_pe)] per head against the cached rows
        (decode, verify; read once latent_done, the branch writing the new rows, has joined), then
        o = o_lat W_UV^T."""
        cfg, ops, (T, nh, _) = self.cfg, self.ops, q.shape
        nope, v, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_abs = ops.scratch("q_abs", (T, nh, cfg.latent_dim))
        ops.head_gemm(q[:, :, :nope], w.w_uk, q_abs[:, :, :r])
        ops.rope(q[:, :, nope:], pos, self.inv_freq, q_abs[:, :, r:], interleaved=True, attn_factor=self.rope_factor)
        latent_done.join()
        o_lat = ops.latent_attention(q_abs, rows, visible, cfg.softmax_scale, ops.scratch("o_lat", (T, nh, r)))
        return ops.head_gemm(o_lat, w.w_uv, ops.scratch("o", (T, nh, v)))

    def _mlp(self, layer: Layer, x):
        if layer.mlp is not None:
            return self._dense(layer.mlp, x, "mlp")
        cfg, ops, moe, T = self.cfg, self.ops, layer.moe, len(x)
        idx = ops.scratch("router.idx", (T, cfg.num_experts_per_tok), np.int32)
        wts = ops.scratch("router.wts", (T, cfg.num_experts_per_tok))
        with ops.branch() as shared_done:                  # the shared expert beside the router and routed experts
            shared = self._dense(moe.shared, x, "shared") if moe.shared is not None else None
        ops.router(x, moe.gate, moe.bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                   cfg.routed_scaling_factor, idx, wts)
        return ops.moe(x, idx, wts, moe.experts, ops.scratch("moe.out", x.shape), shared, after=shared_done)

    def _dense(self, mlp: Mlp, x, role):
        ops, T, inter = self.ops, len(x), mlp.down.shape[1]
        gate_up = ops.gemm(x, mlp.gate_up, ops.scratch(role + ".gate_up", (T, 2 * inter)))
        act = ops.silu_mul(gate_up, ops.scratch(role + ".act", (T, inter)))
        return ops.gemm(act, mlp.down, ops.scratch(role + ".out", x.shape))
