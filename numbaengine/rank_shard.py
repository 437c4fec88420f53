"""One rank's shard of a synthetic K2-shaped model, made in memory on the backend's device (NumPy or CuPy).

What rank r of an n-device layout holds (numbaengine/parallel.py: its heads, 1/n of every MoE layer's experts, 1/n
of the vocabulary and of the dense and shared MLP columns, the replicated q_a/kv_a, norms and router), generated
slice by slice under weights.synth's counter scheme: every value is a hash of (seed, tensor name, element index),
so rank r's shard equals local_slice of the whole synthetic model with the same seed (written to disk by
write_target(..., scheme="counter")) without that model or any host file ever existing. The drafter comes
replicated or split like the target (parallel.DRAFT_SPLITS).

One rank of n alone has no peers: its collectives are a StandInComm, which does this rank's local work only
(see there). That is what one GPU of eight computes per round, minus the time of the all-reduces themselves.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np

from numbaengine.checkpoint import load_target_weights
from numbaengine.drafter import Drafter, parse_draft_config
from numbaengine.parallel import (
    check_divisible,
    check_draft_divisible,
    check_rank,
    draft_local_slice,
    local_slice,
)
from numbaengine.weights.layout import target_tensors
from numbaengine.weights.synth import counter_slice, draft_specs

BYTES = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8, "F8_E4M3": 1}
ALL_REDUCE_STAND_INS = ("none", "copy")


class StandInComm:
    """The collectives of rank `rank` of `size` devices when the other ranks do not exist, same interface as
    devices.NcclComm. all_reduce: "none" leaves this rank's partial sum in place (no work: the round then times the
    local work alone); "copy" also copies x once into a buffer of its size (one small kernel per all-reduce: its
    launch and bytes, not NCCL's latency). all_gather writes this rank's part into every rank's slot (the bytes a
    gather delivers), so the vocabulary-parallel logits are this rank's slice repeated: defined, deterministic
    values, and greedy tokens fall in this rank's slice."""

    def __init__(self, rank: int, size: int, all_reduce: str = "none"):
        check_rank(rank, size)
        if all_reduce not in ALL_REDUCE_STAND_INS:
            raise ValueError(f"all-reduce stand-in: {all_reduce!r} is not one of {', '.join(ALL_REDUCE_STAND_INS)}")
        self.rank, self.size, self.mode = rank, size, all_reduce
        self._bufs = {}              # (shape, dtype) -> copy target, made in the first (eager) round

    def all_reduce(self, x):
        """x f32 (any shape): this rank's partial sum stays in place."""
        if self.mode == "copy":
            key = (x.shape, x.dtype.str)
            if key not in self._bufs:
                self._bufs[key] = x.copy()
            self._bufs[key][...] = x
        return x

    def all_gather(self, part, buf):
        """buf [size, *part.shape] <- part in every slot."""
        buf[...] = part[None]
        return buf

    def describe(self) -> str:
        what = {"none": "no work (this rank's partial sums stay in place)",
                "copy": "one device copy of the same bytes per all-reduce"}[self.mode]
        return (f"rank {self.rank} of {self.size} alone: all-reduce = {what}; all-gather = this rank's vocabulary "
                "slice copied into every rank's slot")


class SynthSource:
    """A stand-in for weights.shards.Checkpoint over a counter-scheme synthetic model (specs {name: (shape,
    dtype)}): get_checked returns a LazyTensor whose slices are made when indexed, on xp (numpy or cupy; 1-D
    tensors, a few KB, always on the host: the loader reads the router bias and weight_shape there and the op
    table's upload moves them). `slicer(name, shape)`: the index to return instead of a LazyTensor (the drafter,
    whose loader does not slice). Names may carry `prefix` (a k25 wrapper's "language_model.")."""

    def __init__(self, specs: dict, seed: int, group: int = 32, xp=np, slicer=None, prefix: str = ""):
        self.specs, self.seed, self.group, self.xp, self.slicer, self.prefix = specs, seed, group, xp, slicer, prefix

    def get_checked(self, name, shape, dtype):
        name = name.removeprefix(self.prefix)
        want, have = self.specs[name][1], dtype if isinstance(dtype, tuple) else (dtype,)
        lazy = LazyTensor(self, name)
        if self.slicer is None:
            if tuple(shape) != self.specs[name][0] or want not in have:
                raise ValueError(f"{name}: synthetic {self.specs[name]} where the loader expects {shape} {dtype}")
            return lazy
        part = lazy[self.slicer(name, self.specs[name][0])]
        if tuple(part.shape) != tuple(shape):
            raise ValueError(f"{name}: this rank's slice is {tuple(part.shape)}, the loader expects {tuple(shape)}")
        return part


class LazyTensor:
    """A tensor of a SynthSource that exists only as its slices: self[index] makes that slice."""

    def __init__(self, source: SynthSource, name: str):
        self.source, self.name = source, name
        self.shape = source.specs[name][0]

    def __getitem__(self, index):
        s = self.source
        xp = s.xp if len(self.shape) > 1 else np
        return counter_slice(s.specs, self.name, index, s.seed, s.group, xp=xp)


def rank_target_weights(cfg, seed: int, rank: int, n: int, xp=np):
    """Rank `rank` of n's shard of the counter-scheme synthetic target (checkpoint.TargetWeights), read through the
    checkpoint loader from a SynthSource. xp numpy: the host records the loader gives for a checkpoint file; cupy:
    device records (contiguous arrays, routed experts as kernels.moe.DeviceExperts) that the cuda table's upload
    keeps as they are."""
    check_rank(rank, n)
    check_divisible(cfg, n)
    source = SynthSource(target_tensors(cfg), seed, cfg.quant.group_size, xp, prefix=cfg.prefix)
    weights = load_target_weights(cfg, source, rank, n)
    if xp is np:
        return weights
    from numbaengine.kernels.moe import device_experts
    for layer in weights.layers:                     # one layer's host-form experts at a time become device ones
        layer.attn = _contiguous(layer.attn, xp)
        if layer.moe is not None:
            layer.moe.experts = device_experts(layer.moe.experts, xp.ascontiguousarray, xp=xp)
    return _contiguous(weights, xp)


def _contiguous(record, xp):
    """Device arrays of a weight record made contiguous (w_uk and w_uv are transposed views of kv_b)."""
    if isinstance(record, xp.ndarray):
        return xp.ascontiguousarray(record)
    if isinstance(record, list):
        return [_contiguous(r, xp) for r in record]
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return dataclasses.replace(record, **{f.name: _contiguous(getattr(record, f.name), xp)
                                              for f in dataclasses.fields(record)})
    return record


def local_draft_config(dcfg, n: int):
    """The DraftConfig one rank of an n-way split drafter runs: 1/n of the heads, key/value heads and MLP."""
    check_draft_divisible(dcfg, n)
    return dataclasses.replace(dcfg, num_attention_heads=dcfg.num_attention_heads // n,
                               num_key_value_heads=dcfg.num_key_value_heads // n,
                               intermediate_size=dcfg.intermediate_size // n)


def rank_drafter(draft_cfg: dict, seed: int, rank: int, n: int, ops, target) -> Drafter:
    """Rank `rank`'s part of the counter-scheme synthetic drafter of config dict `draft_cfg` (synth.draft_config),
    split n ways (n = 1: replicated, the whole drafter), bound to `target`. A split drafter computes its heads' and
    MLP columns' partial sums and all-reduces each layer's attention and MLP output (ops.all_reduce: NCCL across
    ranks, the stand-in on one rank alone)."""
    check_rank(rank, n)
    local = local_draft_config(parse_draft_config(draft_cfg), n)
    source = SynthSource(draft_specs(draft_cfg), seed, xp=getattr(ops, "xp", np),
                         slicer=lambda name, shape: draft_local_slice(name, shape, rank, n))
    drafter = Drafter(local, source, ops, target)
    drafter.split = n > 1
    return drafter


def shard_bytes(cfg, rank: int, n: int, kv_b_copies: bool = True) -> dict:
    """Device bytes of rank `rank`'s target shard, by part (weight_shape tensors are checked and dropped at load;
    kv_b_copies: w_uk and w_uv held as contiguous copies of kv_b, as the kernel table's upload does)."""
    parts = dict.fromkeys(("routed experts", "attention", "dense+shared mlp", "router", "embedding", "lm_head",
                           "norms"), 0)
    for name, (shape, dtype) in target_tensors(cfg).items():
        index = local_slice(name, shape, cfg, rank, n)
        if index is None or name.endswith("weight_shape"):
            continue
        size = math.prod(len(range(*s.indices(d))) for s, d in zip(index, shape)) * BYTES[dtype]
        parts[_part(name)] += size * (2 if kv_b_copies and name.endswith("kv_b_proj.weight") else 1)
    return parts


def _part(name: str) -> str:
    for key, part in ((".experts.", "routed experts"), ("self_attn.", "attention"), ("mlp.gate.", "router"),
                      (".mlp.", "dense+shared mlp"), ("embed_tokens", "embedding"), ("lm_head", "lm_head")):
        if key in name and not name.endswith("layernorm.weight"):
            return part
    return "norms"


def draft_bytes(draft_cfg: dict, n: int) -> int:
    """Device bytes of one rank's drafter split n ways (n = 1: replicated)."""
    return sum(math.prod(len(range(*s.indices(d))) for s, d in zip(draft_local_slice(name, shape, 0, n), shape))
               * BYTES[dtype] for name, (shape, dtype) in draft_specs(draft_cfg).items())


SCRATCH_ALLOWANCE = 4 << 30     # kernel scratch, MoE workspaces, gathers and the generator's row blocks (an allowance)


def memory_plan(cfg, draft_cfg: dict, rank: int, n: int, splits, cases, max_context: int) -> dict:
    """Device bytes of a bench run of rank `rank` of n, by part: its target shard, the larger of the drafters asked
    for (splits: False replicated, True split; one resident at a time), the round buffers of the largest case
    (device_round.plan_bytes; cases (mode, batch, budget), one case's buffers resident at a time) and
    SCRATCH_ALLOWANCE."""
    from numbaengine.device_round import plan_bytes
    plan = {f"target shard {k}": v for k, v in shard_bytes(cfg, rank, n).items()}
    drafted = any(mode != "ar" for mode, _, _ in cases)
    plan["drafter"] = max((draft_bytes(draft_cfg, n if split else 1) for split in splits), default=0) * drafted
    dcfg = parse_draft_config(draft_cfg)
    buffers = 0
    for mode, batch, budget in cases:
        width = {"ddtree": budget, "dflash": dcfg.block_size - 1, "ar": 0}[mode]
        lb = dcfg.block_size if mode != "ar" else 1
        drafter = None
        if mode != "ar":
            local = local_draft_config(dcfg, n) if all(splits) else dcfg
            drafter = SimpleNamespace(cfg=local, layer_ids=dcfg.target_layer_ids)
        cap = max_context + max(width + 1, lb, 2)
        buffers = max(buffers, sum(plan_bytes(SimpleNamespace(cfg=cfg), drafter, batch, cap, width + 1, lb,
                                              cfg.vocab_size).values()))
    plan["round buffers (largest case)"] = buffers
    plan["scratch allowance"] = SCRATCH_ALLOWANCE
    return plan


def check_fits(need: dict, free: int, what: str) -> None:
    """One-line MemoryError when the bytes of `need` ({part: bytes}) exceed 95% of `free`."""
    total = sum(need.values())
    if total > 0.95 * free:
        top = sorted(need, key=need.get, reverse=True)[:3]
        raise MemoryError(f"memory: {what} needs {total / 2**30:.1f} GiB ("
                          + ", ".join(f"{k} {need[k] / 2**30:.1f}" for k in top)
                          + f") but {free / 2**30:.1f} GiB are free: fewer layers, a smaller batch or context, "
                          "or a split drafter")


def rank_target(cfg, seed: int, rank: int, n: int, ops):
    """A model.Target over rank `rank`'s shard on op table `ops` (whose comm decides what its collectives do)."""
    from numbaengine.model import Target
    return Target(cfg, [rank_target_weights(cfg, seed, rank, n, getattr(ops, "xp", np))], ops)


@dataclasses.dataclass
class RankEngine:
    """An Engine over rank `rank` of `of` devices alone (its collectives: `comm`, a StandInComm)."""
    engine: object
    rank: int
    of: int
    seed: int
    comm: StandInComm


def rank_engine(cfg, seed: int, rank: int, n: int, backend: str, max_context: int,
                all_reduce: str = "none") -> RankEngine:
    """Rank `rank` of n's shard on `backend` (numpy, cuda) as an Engine with no drafter (set_drafter adds one)."""
    from numbaengine.devices import rank_ops
    from numbaengine.engine import Engine
    from numbaengine.tokenizer import IdTokenizer
    comm = StandInComm(rank, n, all_reduce)
    ops = rank_ops(backend, comm)
    engine = Engine(cfg, rank_target(cfg, seed, rank, n, ops), None, IdTokenizer(), ops.name, max_context)
    return RankEngine(engine, rank, n, seed, comm)


def set_drafter(shard: RankEngine, draft_cfg: dict, split: bool) -> Drafter:
    """Give the engine of `shard` its drafter (seed + 1), replicated or split like the target; the previous
    drafter and the captured rounds are dropped first (one drafter in device memory at a time)."""
    engine = shard.engine
    engine.drafter = None
    engine.rounds_cache.clear()
    n = shard.of if split else 1
    engine.drafter = rank_drafter(draft_cfg, shard.seed + 1, shard.rank % n, n, engine.target.ops, engine.target)
    return engine.drafter
