"""How the target is laid out over n devices of one host, as data: which tensors split along which axis.

Attention is split by heads (q_b and kv_b by rows, o_proj by columns; q_a, kv_a (stacked into one GEMM at load)
and the norms replicated), routed experts by expert id, the router replicated, dense layer 0 and the shared expert
by their intermediate columns, and lm_head by vocabulary. Each device then holds a partial sum after attention and
after the MLP/MoE block: one all-reduce each per layer. The embedding is replicated (every device embeds its
own copy of the tokens).

A DFlash drafter splits the same way when asked (DRAFT_SPLITS: query and key/value heads by rows, o_proj by
columns, gate/up by rows, down by columns; fc and the norms replicated); numbaengine/rank_shard.py builds one
rank's split drafter. Running split drafters on several ranks needs the drafter's two all-reduces per layer,
which numbaengine/drafter.py does not issue yet: today the engine replicates its drafter.
"""
from __future__ import annotations

import re

SPLITS = [  # (pattern on the unprefixed tensor name, how it splits: axis, "expert", or None = replicated)
    (r"\.mlp\.experts\.\d+\.", "expert"),
    (r"\.self_attn\.(q_b_proj|kv_b_proj)\.weight$", 0),
    (r"\.self_attn\.o_proj\.weight$", 1),
    (r"\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", 0),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", 1),
    (r"^lm_head\.weight$", 0),
    (r"", None),
]


DRAFT_SPLITS = [  # the drafter's tensors (weights.layout.draft_tensors names), as SPLITS
    (r"\.self_attn\.(q_proj|k_proj|v_proj)\.weight$", 0),
    (r"\.self_attn\.o_proj\.weight$", 1),
    (r"\.mlp\.(gate|up)_proj\.weight$", 0),
    (r"\.mlp\.down_proj\.weight$", 1),
    (r"", None),
]


def split_rule(name: str, splits=SPLITS):
    """How tensor `name` (unprefixed) is laid out: an axis to split, "expert", or None (replicated)."""
    return next(rule for pattern, rule in splits if re.search(pattern, name))


def expert_range(cfg, rank: int, n: int) -> range:
    per = cfg.n_routed_experts // n
    return range(rank * per, (rank + 1) * per)


def local_slice(name: str, shape, cfg, rank: int, n: int):
    """The index of device `rank`'s part of tensor `name` (a tuple of slices), or None when it holds none of it."""
    rule = split_rule(name)
    if rule == "expert":
        e = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
        return (slice(None),) * len(shape) if e in expert_range(cfg, rank, n) else None
    index = [slice(None)] * len(shape)
    if rule is not None:
        part = shape[rule] // n
        index[rule] = slice(rank * part, (rank + 1) * part)
    return tuple(index)


def draft_local_slice(name: str, shape, rank: int, n: int) -> tuple:
    """The index of device `rank`'s part of drafter tensor `name` when the drafter is split n ways."""
    index = [slice(None)] * len(shape)
    rule = split_rule(name, DRAFT_SPLITS)
    if rule is not None:
        part = shape[rule] // n
        index[rule] = slice(rank * part, (rank + 1) * part)
    return tuple(index)


def check_rank(rank: int, n: int) -> None:
    """Raise a one-line error unless `rank` names a device of an n-device layout."""
    if n < 1:
        raise ValueError(f"devices: need at least one device, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"rank: {rank} is not a device of the {n}-device layout (0..{n - 1})")


def check_draft_divisible(dcfg, n: int) -> None:
    """Raise a one-line error when a drafter (drafter.DraftConfig) cannot be split n ways."""
    sizes = dict(num_attention_heads=dcfg.num_attention_heads, num_key_value_heads=dcfg.num_key_value_heads,
                 intermediate_size=dcfg.intermediate_size)
    for field, size in sizes.items():
        if size % n:
            raise ValueError(f"drafter {field}: {size} is not divisible by the {n} devices")


def check_divisible(cfg, n: int) -> None:
    """Raise a one-line error when the model cannot be split n ways."""
    if n < 1:
        raise ValueError(f"devices: need at least one device, got {n}")
    sizes = dict(num_attention_heads=cfg.num_attention_heads, n_routed_experts=cfg.n_routed_experts,
                 vocab_size=cfg.vocab_size,
                 moe_intermediate_size=cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1))
    if cfg.first_k_dense_replace:
        sizes["intermediate_size"] = cfg.intermediate_size
    for field, size in sizes.items():
        if size % n:
            raise ValueError(f"{field}: {size} is not divisible by the {n} devices")
