"""MoE: the sigmoid router with grouped top-k, and the routed experts (INT4 W4A16 or bf16).

Router (MODEL.md section 4): s = sigmoid(x @ Wg^T) in float32; choice = s + bias picks the experts (lower index
wins ties); weights = s at the picks, normalized, times routed_scaling_factor.
Experts: y = sum_j w_j * down(silu(gate(x)) * up(x)); gate and up are stacked as one [2I, H] matrix per expert.
"""
from dataclasses import dataclass

import numpy as np

from kernels.act import silu_mul_ref
from weights.dtypes import bf16_to_f32
from weights.int4 import dequant_int4


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
        """Expert e's gate_up or down matrix as f32[out, in]."""
        w = getattr(self, which)[e]
        if not self.int4:
            return bf16_to_f32(w)
        return dequant_int4(w, getattr(self, which + "_scale")[e], self.group)


def _stable_topk(v, k):
    """Indices of the k largest values of v, larger first, lower index first among equals."""
    return np.argsort(-v, kind="stable")[:k]


def router_ref(x, w_gate, bias, top_k, n_group, topk_group, norm_topk, scaling, idx_out, w_out):
    """x f32[n, H], w_gate u16[E, H], bias f32[E] -> idx_out i32[n, k], w_out f32[n, k]."""
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float32) @ bf16_to_f32(w_gate).T)))   # [n, E]
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
