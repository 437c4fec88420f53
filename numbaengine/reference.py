"""The NumPy reference ops (`*_ref`): the numpy backend's math and the oracle every kernel is tested against.

Every op writes into caller-provided outputs, does float32 math on checkpoint storage (bf16 as uint16 bits) and
imports no numba: the kernels in numbaengine/kernels/ import from here, never the reverse.
"""
import math
import weakref
from dataclasses import dataclass

import numpy as np

from numbaengine.weights.dtypes import bf16_to_f32, f32_to_bf16
from numbaengine.weights.int4 import dequant_int4

# --- weight decode memo: bf16 and INT4 decodes are exact in float32, so decoding once changes no result -------------
_F32 = {}


def memo_f32(owner, decode, *key):
    """decode() computed once per (owner object, key) while owner lives."""
    k = (id(owner),) + key
    if k not in _F32:
        _F32[k] = decode()
        weakref.finalize(owner, _F32.pop, k, None)
    return _F32[k]


# --- SwiGLU: out = silu(gate) * up with gate_up = [gate | up] along the last axis ------------------------------------

def silu(x):
    return x / (np.float32(1) + np.exp(-x))


def silu_mul_ref(gate_up, out):
    """gate_up f32[n, 2I] -> out f32[n, I]."""
    i = gate_up.shape[-1] // 2
    np.multiply(silu(gate_up[:, :i]), gate_up[:, i:], out=out)
    return out


# --- RMSNorm: out = x / sqrt(mean(x^2) + eps) * w, w stored as bf16 bits --------------------------------------------

def rmsnorm_ref(x, w, eps, out):
    """x f32[n, d], w u16[d] (bf16 bits) -> out f32[n, d]."""
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    np.multiply(x / np.sqrt(var + np.float32(eps)), bf16_to_f32(w), out=out)
    return out


def add_rmsnorm_ref(x, residual, w, eps, out, res_out=None):
    """residual += x (in place), then out = rmsnorm(residual): the pre-norm block boundary. res_out: also a copy
    of the updated residual there (a layer's output kept as a drafter feature)."""
    residual += x
    if res_out is not None:
        res_out[...] = residual
    return rmsnorm_ref(residual, w, eps, out)


# --- RoPE with YaRN frequencies: `interleaved` rotates pairs (2i, 2i+1) (DeepSeek / K2), else (i, i + d/2) (Qwen3) ----

def yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(dim, theta, yarn=None):
    """inv_freq f32[dim/2] and the cos/sin multiplier (attention factor; 1 unless YaRN says otherwise)."""
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extra = 1.0 / base
    if yarn is None:
        return extra.astype(np.float32), 1.0
    inter = 1.0 / (yarn.factor * base)

    def corr_dim(rot):  # dimension whose wavelength makes `rot` turns over the original context
        return dim * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    inv = inter * ramp + extra * (1 - ramp)
    if yarn.mscale and yarn.mscale_all_dim:
        factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        factor = yarn_mscale(yarn.factor)
    return inv.astype(np.float32), factor


def rope_ref(x, pos, inv_freq, out, *, interleaved, attn_factor=1.0):
    """x f32[n, h, d], pos i32[n] -> out f32[n, h, d] (out may alias x)."""
    ang = pos.astype(np.float32)[:, None] * inv_freq[None, :]          # [n, d/2]
    cos = (np.cos(ang) * np.float32(attn_factor))[:, None, :]
    sin = (np.sin(ang) * np.float32(attn_factor))[:, None, :]
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    return out


def qk_norm_rope_ref(qk, nq, q_w, k_w, eps, pos, inv_freq, q_out, k_out, *, interleaved):
    """Per-head RMSNorm then RoPE of the query and key heads of one stacked projection (Qwen3 q_norm/k_norm, the
    DFlash drafter): qk f32[n, nq + nk, d] (any strides), heads < nq normalized with q_w u16[d], the others with
    k_w, all roped at pos i32[n] -> q_out f32[n, nq, d], k_out f32[n, nk, d]."""
    d = qk.shape[-1]
    for heads, w, out in ((qk[:, :nq], q_w, q_out), (qk[:, nq:], k_w, k_out)):
        if heads.shape[1]:
            normed = rmsnorm_ref(heads.reshape(-1, d), w, eps, np.empty((heads.size // d, d), np.float32))
            rope_ref(normed.reshape(heads.shape), pos, inv_freq, out, interleaved=interleaved)
    return q_out, k_out


# --- dense GEMM on bf16 weights stored [n, k] (the checkpoint layout), and MLA per-head products ------------------

def gemm_ref(x, w, out):
    """x f32[m, k], w u16[n, k] -> out f32[m, n]."""
    np.matmul(x, memo_f32(w, lambda: bf16_to_f32(w)).T, out=out)
    return out


def head_gemm_ref(x, w, out, *, transpose_w):
    """Per-head GEMM. x f32[n, h, a]; w u16[h, a, b] (transpose_w=False) or u16[h, b, a] (True) -> out f32[n, h, b]."""
    np.einsum("nha,hba->nhb" if transpose_w else "nha,hab->nhb", x, memo_f32(w, lambda: bf16_to_f32(w)), out=out)
    return out


# --- softmax attention with an explicit visibility mask; GQA/MQA when k has fewer heads than q ----------------------

def attention_ref(q, k, v, visible, scale, out):
    """q f32[n, h, d], k f32[S, hk, d], v f32[S, hk, dv], visible bool[n, S] or None -> out f32[n, h, dv]."""
    h, hk = q.shape[1], k.shape[1]
    g = h // hk
    for j in range(hk):
        qj = q[:, j * g:(j + 1) * g]                                   # [n, g, d]
        s = np.einsum("ngd,sd->gns", qj, k[:, j]) * np.float32(scale)  # [g, n, S]
        if visible is not None:
            s = np.where(visible[None], s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[:, j * g:(j + 1) * g] = np.einsum("gns,se->nge", p, v[:, j])
    return out


def kv_attention_ref(q, k, v, kv_len, scale, out):
    """Batched attention without a mask (the DFlash drafter's block over its context plus itself): q f32[B, n, h, d],
    k f32[B, S, hk, d], v f32[B, S, hk, dv], kv_len i32[B]: the queries of sequence b see keys [0, kv_len[b])
    -> out f32[B, n, h, dv]."""
    for b in range(q.shape[0]):
        S = int(kv_len[b])
        attention_ref(q[b], k[b, :S], v[b, :S], None, scale, out[b])
    return out


# --- absorbed-form attention over the latent cache (decode, tree verify, prefill) ------------------------------------

def mask_bits(mask, n):
    """Packed visibility u32[T, W] (bit j of word w: sees new token 32w+j) -> bool[n, n] for the first n rows."""
    words = np.ascontiguousarray(mask[:n]).astype("<u4").view(np.uint8).reshape(n, -1)
    return np.unpackbits(words, axis=1, bitorder="little")[:, :n].astype(bool)


def mla_attention_ref(q, cache, lengths, ntok, mask, scale, out, work=None):
    """Batched MQA over the bf16 latent cache. q f32[B, T, h, D] ([q_lat | q_pe] per head); cache u16[B, cap, D]
    (rows [0, lengths[b]) committed, the ntok[b] new tokens' rows right after); mask u32[B, T, W] packed
    visibility among new tokens (mask_bits) or None = causal; out f32[B, T, h, r] = softmax @ c_kv (r = kv_lora).
    Query rows t >= ntok[b] get 0. `work` is the GPU launcher's scratch (unused here)."""
    r = out.shape[-1]
    out[:] = 0
    for b in range(q.shape[0]):
        L, n = int(lengths[b]), int(ntok[b])
        if n == 0:
            continue
        lat = bf16_to_f32(cache[b, :L + n])                                   # [L+n, D]
        vis = np.ones((n, L + n), bool)
        vis[:, L:] = np.tril(np.ones((n, n), bool)) if mask is None else mask_bits(mask[b], n)
        attention_ref(q[b, :n], lat[:, None, :], lat[:, None, :r], vis, scale, out[b, :n])
    return out


# --- MoE: sigmoid router with grouped top-k (MODEL.md section 4), routed experts (INT4 W4A16 or bf16) ----------------

@dataclass
class Experts:
    """Routed experts of one layer, stacked by expert id. INT4: packed int32 words + bf16 group scales;
    bf16: plain weights (scales None)."""
    gate_up: np.ndarray              # int4: i32[E, 2I, H/8] | bf16: u16[E, 2I, H]
    down: np.ndarray                 # int4: i32[E, H, I/8]  | bf16: u16[E, H, I]
    gate_up_scale: np.ndarray = None  # u16[E, 2I, H/group]
    down_scale: np.ndarray = None     # u16[E, H, I/group]
    group: int = 32
    offset: int = 0                   # global id of local expert 0 (expert parallelism: a device holds a range)

    @property
    def int4(self) -> bool:
        return self.gate_up_scale is not None

    def weight(self, e, which):
        """Expert e's gate_up or down matrix as f32[out, in] (decoded once, see memo_f32)."""
        return memo_f32(self, lambda: self._decode(e, which), e, which)

    def _decode(self, e, which):
        w = getattr(self, which)[e]
        if not self.int4:
            return bf16_to_f32(w)
        return dequant_int4(w, getattr(self, which + "_scale")[e], self.group)


def _stable_topk(v, k):
    """Indices of the k largest values of v, larger first, lower index first among equals."""
    return np.argsort(-v, kind="stable")[:k]


def router_ref(x, w_gate, bias, top_k, n_group, topk_group, norm_topk, scaling, idx_out, w_out):
    """x f32[n, H], w_gate u16[E, H], bias f32[E] -> idx_out i32[n, k], w_out f32[n, k]."""
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float32) @ memo_f32(w_gate, lambda: bf16_to_f32(w_gate)).T)))  # [n, E]
    choice = s + bias
    per_group = choice.shape[1] // n_group
    for t in range(x.shape[0]):
        c = choice[t].copy()
        if n_group > 1:
            grouped = c.reshape(n_group, per_group)
            group_score = np.sort(grouped, axis=1)[:, -2:].sum(axis=1)
            dropped = np.ones(n_group, bool)
            dropped[_stable_topk(group_score, topk_group)] = False
            grouped[dropped] = -np.inf
        idx = _stable_topk(c, top_k)
        w = s[t, idx]
        if norm_topk:
            w = w / (w.sum() + np.float32(1e-20))
        idx_out[t], w_out[t] = idx, w * np.float32(scaling)
    return idx_out, w_out


def moe_ref(x, idx, wts, experts, out):
    """x f32[n, H], idx i32[n, k] (global expert ids), wts f32[n, k] -> out f32[n, H] = the routed sum over the
    experts held here (overwritten)."""
    out[:] = 0
    held = range(experts.offset, experts.offset + len(experts.down))
    for e in (e for e in np.unique(idx) if e in held):
        tok, slot = np.nonzero(idx == e)
        e = e - experts.offset
        gate_up = x[tok] @ experts.weight(e, "gate_up").T                # [m, 2I]
        h = silu_mul_ref(gate_up, np.empty((len(tok), gate_up.shape[1] // 2), np.float32))
        out[tok] += (h @ experts.weight(e, "down").T) * wts[tok, slot][:, None]
    return out


# --- sampling: argmax at temperature 0, else Gumbel-max; the noise of id v is a pure function of (seed, seq, position,
# v), so no generator state, and kernels/sample.py computes the same numbers on the device

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    z = z + _GOLD
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def unit(z, odd=0):
    """Hashes z u64[...] -> u f32 = (k + 1/2) 2^-23 from 23 of their bits k (63-41 where odd is 0, 31-9 where it
    is 1): exact in float32, so 0 < u < 1. (With 24 bits, k = 2^24 - 1 rounded up to u = 1.0, an infinite Gumbel:
    that id won whatever its logit, in about 1% of the rows of a 163840-id vocabulary.)"""
    half = np.where(np.asarray(odd) != 0, z & np.uint64(0xFFFFFFFF), z >> np.uint64(32))
    return ((half >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def uniform(seed, seq, pos, vocab):
    """u f32[vocab] in (0, 1) for one (seed, seq, pos): ids 2m and 2m + 1 share the hash mix64(h ^ m) and take
    disjoint halves of it (unit), one hash per two ids."""
    with np.errstate(over="ignore"):
        h = mix64(np.uint64(seed) ^ mix64(np.uint64(seq) ^ mix64(np.uint64(pos) + np.uint64(0x5851F42D))))
        v = np.arange(vocab, dtype=np.uint64)
        z = mix64(h ^ (v >> np.uint64(1)))
    return unit(z, v & np.uint64(1))


def gumbel(seed, seq, pos, vocab):
    return -np.log(-np.log(uniform(seed, seq, pos, vocab)))


def sample_ref(logits, temperature, seed, seq, pos, out):
    """logits f32[n, V], seq i32[n], pos i32[n] -> out i32[n]. Lowest index wins exact ties."""
    if temperature == 0:
        out[:] = np.argmax(logits, axis=-1)
        return out
    for i in range(logits.shape[0]):
        g = gumbel(seed, int(seq[i]), int(pos[i]), logits.shape[1])
        out[i] = np.argmax(logits[i] / np.float32(temperature) + g)
    return out


# --- argmax and top-k per row: larger value first, lower index first among equals ----------------------------------

def argmax_ref(logits, out):
    """logits f32[n, V] -> out i32[n]."""
    out[:] = np.argmax(logits, axis=-1)
    return out


def topk_ref(logits, k, idx_out, val_out):
    """logits f32[n, V] -> idx_out i32[n, k], val_out f32[n, k], sorted by value (lower index first on ties)."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    idx_out[:] = order
    val_out[:] = np.take_along_axis(logits, order, axis=-1)
    return idx_out, val_out



# --- the op table's host-side ops (numbaengine/backends.py NUMPY) ---------------------------------------------------
def embed_ref(table, tokens, out):
    """tokens i32[n] -> out f32[n, H] = bf16 rows of table u16[V, H]."""
    out[:] = bf16_to_f32(table[np.asarray(tokens)])
    return out


def cache_write_ref(rows, visible, latent):
    """Latent rows f32[T, D] of new tokens -> cache rows start..start+T-1 (rounded to bf16 in a bf16 cache), where
    visible bool[T, start+T] is what visibility_ref gave for them."""
    start = visible.shape[1] - len(latent)
    rows[start:start + len(latent)] = f32_to_bf16(latent) if rows.dtype == np.uint16 else latent


def cache_read_ref(rows, end, out):
    """Cache rows [0, end) -> out f32[end, D]."""
    out[:] = bf16_to_f32(rows[:end]) if rows.dtype == np.uint16 else rows[:end]
    return out


def visibility_ref(start, T, tree_mask, form=None):
    """bool[T, start+T]: every committed row, then the new rows the mask allows (causal when mask is None).
    The reference attention ops take it in both MLA forms."""
    vis = np.ones((T, start + T), bool)
    vis[:, start:] = np.tril(np.ones((T, T), bool)) if tree_mask is None else np.asarray(tree_mask, bool)
    return vis


def latent_attention_ref(q, rows, visible, scale, out):
    """Absorbed MLA: q f32[T, h, r+rope] ([q_lat | q_pe]) against cache rows [0, S) (S = visible's width) as MQA,
    keys = whole latent rows, values = their c_kv part -> out f32[T, h, r]."""
    latent = cache_read_ref(rows, visible.shape[1], np.empty((visible.shape[1], rows.shape[1]), np.float32))
    return attention_ref(q, latent[:, None, :], latent[:, None, :out.shape[-1]], visible, scale, out)


def all_reduce_ref(parts):
    """Sum of the shards' partial outputs (what NCCL computes across GPUs)."""
    return parts[0] if len(parts) == 1 else np.sum(parts, axis=0, dtype=np.float32)


def moe_shared_ref(x, idx, wts, experts, out, shared=None, after=None):
    """Routed experts (moe_ref), plus the shared expert's output when given (after: the branch that computed it,
    joined before it is read; nothing to wait for here)."""
    moe_ref(x, idx, wts, experts, out)
    if shared is not None:
        out += shared
    return out


def copy_ref(src, dst):
    dst[...] = src
    return dst


class InOrder:
    """branch() of a table that runs every op in order (the reference, the simulator): nothing to join."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def join(self):
        pass


def all_gather_cols(comm, part, out, buf):
    """Vocabulary-parallel gather: every rank's part f32[m, v] side by side -> out f32[m, size * v]
    (buf f32[size, m, v] is the collective's buffer)."""
    m, v = part.shape
    if not out.flags.c_contiguous:      # a reshape of a strided view would be a copy: the result would be lost
        raise ValueError(f"all_gather: out must be C-contiguous, got strides {out.strides}")
    if out.shape != (m, comm.size * v) or buf.shape != (comm.size, m, v):
        raise ValueError(f"all_gather: part {part.shape}, out {out.shape}, buffer {buf.shape} do not fit "
                         f"{comm.size} ranks")
    comm.all_gather(part, buf)
    out.reshape(m, comm.size, v)[...] = buf.transpose(1, 0, 2)
    return out
