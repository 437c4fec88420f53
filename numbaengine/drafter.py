"""The DFlash block-diffusion drafter (spec/DDTREE.md section 1), written in the engine's named ops.

A few Qwen3-style layers predict the Lb-1 tokens after the bonus token in one non-causal pass over the block
[bonus, MASK...]. Context = the target's hidden states of the committed tokens, projected by `fc` and normalized,
entering every layer only as extra keys/values (cached per layer after k_norm and RoPE). The drafter has no
embedding and no LM head: it borrows the target's.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from numbaengine.config import ConfigError, read_config_json
from numbaengine.reference import rope_inv_freq
from numbaengine.weights.layout import draft_tensors
from numbaengine.weights.shards import Checkpoint


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int             # Lb: the bonus token plus Lb-1 drafted tokens
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple     # target hidden ids whose features are concatenated, in this order


def default_layer_ids(n_target, n_draft):
    """D evenly spaced ids from 1 to N-3 (Python round), or [N//2] for one draft layer."""
    if n_draft == 1:
        return (n_target // 2,)
    return tuple(int(round(1 + i * (n_target - 4) / (n_draft - 1))) for i in range(n_draft))


def load_draft_config(path) -> DraftConfig:
    """Parse a DFlash drafter config.json (a folder, a file, or a dict); errors name the field."""
    return parse_draft_config(read_config_json(path, "drafter config.json"))


def _int(raw, key, where=""):
    v = raw.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}{key}: must be a positive integer, got {v!r}")
    return v


def parse_draft_config(raw: dict) -> DraftConfig:
    if "DFlashDraftModel" not in (raw.get("architectures") or []):
        raise ConfigError(f"architectures: {raw.get('architectures')!r} does not name DFlashDraftModel")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ConfigError("dflash_config: missing (needs mask_token_id and target_layer_ids)")
    ints = {k: _int(raw, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "intermediate_size", "num_target_layers")}
    ints["num_key_value_heads"] = _int(raw, "num_key_value_heads") if "num_key_value_heads" in raw \
        else ints["num_attention_heads"]
    ints["head_dim"] = _int(raw, "head_dim") if "head_dim" in raw \
        else ints["hidden_size"] // ints["num_attention_heads"]
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ConfigError("num_key_value_heads: must divide num_attention_heads")
    if ints["head_dim"] % 2:
        raise ConfigError(f"head_dim: must be even for RoPE, got {ints['head_dim']}")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise ConfigError("layer_types: only full_attention drafter layers are supported")
    return DraftConfig(**ints, rms_norm_eps=_positive(raw, "rms_norm_eps", 1e-6),
                       rope_theta=_positive(raw.get("rope_parameters") or raw, "rope_theta", 10000.0),
                       block_size=_block_size(raw, dflash), mask_token_id=_mask_id(dflash),
                       target_layer_ids=_layer_ids(dflash, ints["num_target_layers"], ints["num_hidden_layers"]))


def _positive(raw, key, default):
    v = raw.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{key}: must be a positive number, got {v!r}")
    return float(v)


def _block_size(raw, dflash):
    top, inner = raw.get("block_size"), dflash.get("block_size")
    if top is None and inner is None:
        raise ConfigError("block_size: missing (top level or dflash_config.block_size)")
    if top is not None and inner is not None and top != inner:
        raise ConfigError(f"block_size: top level {top} differs from dflash_config.block_size {inner}")
    size = top if top is not None else inner
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise ConfigError(f"block_size: must be an integer >= 2, got {size!r}")
    return size


def _mask_id(dflash):
    v = dflash.get("mask_token_id")
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"dflash_config.mask_token_id: must be a non-negative integer, got {v!r}")
    return v


def _layer_ids(dflash, n_target, n_draft):
    ids = dflash.get("target_layer_ids")
    if ids is None:
        ids = list(default_layer_ids(n_target, n_draft))
        if not all(0 <= i < n_target for i in ids):
            raise ConfigError(f"dflash_config.target_layer_ids: missing, and the default rule gives {ids} for "
                              f"num_target_layers {n_target}; write the ids explicitly")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < n_target for i in ids):
        raise ConfigError(f"dflash_config.target_layer_ids: {ids!r} must be a non-empty list of layer ids "
                          f"in 0..{n_target - 1}")
    return tuple(ids)


@dataclass
class DraftLayer:
    ln1: np.ndarray          # u16[H] input_layernorm
    ln2: np.ndarray          # u16[H] post_attention_layernorm
    qkv: np.ndarray          # u16[(nh + 2 nkv)*d, H] q_proj, k_proj, v_proj stacked: one GEMM for the block
    o: np.ndarray            # u16[H, nh*d]
    q_norm: np.ndarray       # u16[d]
    k_norm: np.ndarray       # u16[d]
    gate_up: np.ndarray      # u16[2I, H] gate stacked over up
    down: np.ndarray         # u16[H, I]
    kv: np.ndarray = None    # u16[2 nkv*d, H] a view of qkv's k|v rows (context rows need no queries)


@dataclass
class DraftContext:
    """Per-layer context K/V of the committed tokens, after k_norm and RoPE; rows [0, length) are valid."""
    k: list                  # per layer f32[max_len, nkv, d]
    v: list                  # per layer f32[max_len, nkv, d]
    length: int = 0


class Drafter:
    """DFlash drafter on an op table. `target` lends embed(tokens, out) and lm_head(h, out)."""

    def __init__(self, cfg: DraftConfig, checkpoint: Checkpoint, ops, target):
        tcfg = target.cfg
        if cfg.hidden_size != tcfg.hidden_size:
            raise ConfigError(f"hidden_size: drafter {cfg.hidden_size} != target {tcfg.hidden_size}")
        if cfg.mask_token_id >= tcfg.vocab_size:
            raise ConfigError(f"dflash_config.mask_token_id: {cfg.mask_token_id} is outside the target "
                              f"vocabulary ({tcfg.vocab_size})")
        if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
            raise ConfigError(f"dflash_config.target_layer_ids: {list(cfg.target_layer_ids)} names a layer the "
                              f"target lacks ({tcfg.num_hidden_layers} layers)")
        self.cfg, self.ops, self.target = cfg, ops, target
        self.split = False           # heads and MLP columns split over the ranks (rank_shard): layer outputs summed
        self.vocab = tcfg.vocab_size
        self.inv_freq = ops.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta)[0])
        self._load(checkpoint)

    def with_ops(self, ops, target) -> "Drafter":
        """The same weights on another table of the same backend, bound to `target` (see Target.with_ops)."""
        other = copy.copy(self)
        other.ops, other.target = ops, target
        return other

    @property
    def block_size(self):
        return self.cfg.block_size

    @property
    def layer_ids(self):
        return self.cfg.target_layer_ids

    @property
    def mask_id(self):
        return self.cfg.mask_token_id

    def _load(self, ckpt):
        c, ops = self.cfg, self.ops
        specs = draft_tensors(c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                              c.head_dim, c.intermediate_size, len(c.target_layer_ids))

        def get(name):
            return ckpt.get_checked(name, *specs[name])

        self.fc, self.hidden_norm, self.norm = ops.upload([get("fc.weight"), get("hidden_norm.weight"),
                                                           get("norm.weight")])
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layer = ops.upload(DraftLayer(
                get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight"),
                np.concatenate([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]),
                get(a + "o_proj.weight"), get(a + "q_norm.weight"), get(a + "k_norm.weight"),
                np.concatenate([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
                get(m + "down_proj.weight")))
            layer.kv = layer.qkv[c.num_attention_heads * c.head_dim:]
            self.layers.append(layer)

    # --- context ---------------------------------------------------------------------------------------------------

    def new_context(self, max_len) -> DraftContext:
        c = self.cfg
        shape = (max_len, c.num_key_value_heads, c.head_dim)
        return DraftContext([np.zeros(shape, np.float32) for _ in self.layers],
                            [np.zeros(shape, np.float32) for _ in self.layers])

    def append(self, ctx: DraftContext, hidden, positions):
        """Add committed tokens (one sequence, host arrays): hidden f32[F, n, H] (target features in
        target_layer_ids order) at absolute positions i32[n]."""
        F, n, H = hidden.shape
        if ctx.length + n > len(ctx.k[0]):
            raise ValueError(f"drafter context: {ctx.length + n} tokens exceed its {len(ctx.k[0])} rows")
        feats = np.ascontiguousarray(hidden.transpose(1, 0, 2)).reshape(n, F * H)      # [n, F*H]
        rows = slice(ctx.length, ctx.length + n)
        nkv = self.cfg.num_key_value_heads

        def write(i, kv):
            ctx.k[i][rows], ctx.v[i][rows] = kv[:, :nkv], kv[:, nkv:]
        self.context_kv(feats, positions, write)
        ctx.length += n

    def context_kv(self, feats, positions, write):
        """The context keys and values of committed tokens: feats f32[n, F*H] (concatenated target features) at
        positions i32[n]; per layer i, write(i, kv f32[n, 2 nkv, d]) gets heads [0, nkv) k_norm(k_proj(f)) roped,
        then v_proj(f), with f = hidden_norm(fc(feats)), as a view of scratch to use before it returns. The layers
        are independent: odd ones run on a parallel branch (ops.branch()) beside the even ones."""
        ops, n, L = self.ops, len(feats), len(self.layers)
        f = ops.gemm(feats, self.fc, ops.scratch("d.f", (n, self.cfg.hidden_size)))
        ops.rmsnorm(f, self.hidden_norm, self.cfg.rms_norm_eps, f)                     # [n, H]
        with ops.branch() as odd:
            for i in range(1, L, 2):
                write(i, self._qkv(f, self.layers[i], self.layers[i].kv, positions, "d.kv1")[1])
        for i in range(0, L, 2):
            write(i, self._qkv(f, self.layers[i], self.layers[i].kv, positions, "d.kv0")[1])
        odd.join()

    # --- the block forward -----------------------------------------------------------------------------------------

    def draft(self, ctx: DraftContext, bonus, start):
        """Logits f32[Lb-1, V] for absolute positions start+1 .. start+Lb-1 (block slots 1..Lb-1); one sequence,
        host arrays (the reference round)."""
        c, ops, Lb = self.cfg, self.ops, self.cfg.block_size
        tokens = np.full(Lb, c.mask_token_id, np.int32)
        tokens[0] = bonus
        positions = np.arange(start, start + Lb, dtype=np.int32)

        def attend(i, q, kv):            # the block sees the committed context and itself, no mask
            nkv = c.num_key_value_heads
            keys = np.concatenate([ctx.k[i][:ctx.length], kv[:, :nkv]])                # [S+Lb, nkv, d]
            vals = np.concatenate([ctx.v[i][:ctx.length], kv[:, nkv:]])
            return ops.attention(q, keys, vals, None, self.scale, np.empty_like(q))   # [Lb, nh, d]

        x = self.block(self.target.embed(tokens, ops.scratch("d.h", (Lb, c.hidden_size))), positions, attend)
        return self.target.lm_head(x[1:], np.empty((Lb - 1, self.vocab), np.float32))         # slots 1.. draft

    @property
    def scale(self):
        return self.cfg.head_dim ** -0.5

    def block(self, h, positions, attend):
        """The drafter layers over block rows h f32[n, H] (the residual stream, updated in place) at positions
        i32[n], then the final norm -> f32[n, H] (scratch), the lm_head's input. attend(i, q f32[n, nh, d],
        kv f32[n, 2 nkv, d]) -> f32[n, nh, d] is layer i's attention of the block over its context plus the block's
        own keys (kv heads [0, nkv)) and values (the rest)."""
        c, ops, n = self.cfg, self.ops, len(h)
        x = ops.scratch("d.x", h.shape)
        ops.rmsnorm(h, self.layers[0].ln1, c.rms_norm_eps, x)
        for i, layer in enumerate(self.layers):
            o = attend(i, *self._qkv(x, layer, layer.qkv, positions))
            a = ops.gemm(o.reshape(n, -1), layer.o, ops.scratch("d.attn", h.shape))
            a = ops.all_reduce([a]) if self.split else a
            ops.add_rmsnorm(a, h, layer.ln2, c.rms_norm_eps, x)                        # h += a; x = norm(h)
            m = self._mlp(x, layer)
            m = ops.all_reduce([m]) if self.split else m
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm
            ops.add_rmsnorm(m, h, nxt, c.rms_norm_eps, x)              # h += m; next layer's x or the final norm
        return x

    def _qkv(self, x, layer, w, positions, role="d.qkv"):
        """x f32[n, H] through the stacked projection w (layer.qkv, or layer.kv for keys and values alone), head
        norms and RoPE at positions (keys in place) -> q f32[n, nh, d] (None for kv), kv f32[n, 2 nkv, d] (keys,
        then values: one row write puts both into a context), in scratch `role`."""
        c, ops, n, d = self.cfg, self.ops, len(x), self.cfg.head_dim
        heads = ops.gemm(x, w, ops.scratch(role, (n, len(w)))).reshape(n, -1, d)      # [n, (nh +) 2 nkv, d]
        nq, nkv = heads.shape[1] - 2 * c.num_key_value_heads, c.num_key_value_heads
        q = ops.scratch("d.q", (n, nq, d)) if nq else None
        ops.qk_norm_rope(heads[:, :nq + nkv], nq, layer.q_norm, layer.k_norm, c.rms_norm_eps, positions, self.inv_freq,
                         q, heads[:, nq:nq + nkv], interleaved=False)
        return q, heads[:, nq:]

    def _mlp(self, x, layer):
        ops, n, I2 = self.ops, len(x), len(layer.gate_up)
        gate_up = ops.gemm(x, layer.gate_up, ops.scratch("d.gate_up", (n, I2)))
        act = ops.silu_mul(gate_up, ops.scratch("d.act", (n, I2 // 2)))
        return ops.gemm(act, layer.down, ops.scratch("d.mlp", (n, self.cfg.hidden_size)))


def load_drafter(draft_dir, target, ops) -> Drafter:
    """Config + checkpoint of a DFlash drafter folder, bound to `target`'s embedding and lm_head."""
    return Drafter(load_draft_config(draft_dir), Checkpoint(draft_dir), ops, target)
