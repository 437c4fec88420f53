"""Engine: load a target (and optionally a DFlash drafter) on a backend, then run prefill and generation."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from numbaengine import generate as gen
from numbaengine.backends import get_ops
from numbaengine.budget import AUTO, reference_costs
from numbaengine.checkpoint import load_target_weights
from numbaengine.config import load_config
from numbaengine.drafter import load_drafter
from numbaengine.model import Target
from numbaengine.phases import span
from numbaengine.rounds import PREFILL_CHUNK, DeviceSlots, HostRounds
from numbaengine.tokenizer import load_tokenizer
from numbaengine.weights import SHIPPED_PAIR
from numbaengine.weights.shards import Checkpoint


def check_weights_fit(ops, dirs, devices=None):
    """A clear error before uploading weights that cannot fit: their file bytes per device against the free
    memory of each device (None: the current one; FP8 checkpoints need twice that: they become bf16 at load)."""
    need = sum(f.stat().st_size for d in dirs for f in Path(d).glob("*.safetensors")) / len(devices or [0])
    cuda = ops.xp.cuda
    for device in devices or [None]:
        with cuda.Device(device) if device is not None else contextlib.nullcontext():
            free = cuda.runtime.memGetInfo()[0]
        if need > 0.95 * free:
            raise MemoryError(f"memory: the weights need at least {need / 2**30:.1f} GiB per GPU but "
                              f"{free / 2**30:.1f} GiB are free{'' if device is None else f' on GPU {device}'}: "
                              "shard over more devices (devices=[...]) or free the GPU")


class Engine:
    def __init__(self, cfg, target: Target, drafter=None, tokenizer=None, backend="numpy", max_context=4096,
                 ranks=None):
        self.cfg, self.target, self.drafter, self.tokenizer = cfg, target, drafter, tokenizer
        self.backend, self.max_context = backend, max_context
        self.ranks = ranks           # kernel backends over a device list: every rank (numbaengine/devices.py)
        self.rounds_cache = {}       # kernel backends: DeviceRounds (buffers + captured graph) of the last shape
        self.costs = None            # numpy, budget "auto": the reference round timed at its first use
        self.overlap = True          # kernel backends: launch the next round before the host handles this one's
        #                              tokens (rounds.DeviceSlots.overlap, where its measurement is)

    @classmethod
    def load(cls, model_dir=None, draft_dir=None, backend="auto", max_context=4096, cache_dtype="bf16",
             devices=None) -> "Engine":
        """Load the checkpoint at model_dir (and the drafter at draft_dir) for `backend` (numpy, sim, cuda, auto).
        No model_dir: the shipped toy pair (numbaengine/weights/default, target and drafter).
        `devices`: the GPUs to shard over, one rank (thread, op table, NCCL communicator) per GPU; None: the
        current GPU alone. On the numpy backend a list gives a simulated layout of that many devices."""
        with span("load"):
            if model_dir is None:
                model_dir, draft_dir = SHIPPED_PAIR / "target", draft_dir or SHIPPED_PAIR / "draft"
            model_dir = Path(model_dir)
            if not model_dir.is_dir():
                raise FileNotFoundError(f"model directory not found: {model_dir}")
            ops = get_ops(backend)
            cfg = load_config(model_dir)
            if devices is not None:
                from numbaengine.devices import check_devices
                devices = check_devices(devices, ops.name)
            n = 1 if devices is None else len(devices)
            if ops.name == "cuda":
                check_weights_fit(ops, [model_dir] + ([Path(draft_dir)] if draft_dir is not None else []), devices)
            if devices is not None and ops.name != "numpy":
                from numbaengine.devices import load_ranks
                ranks = load_ranks(cfg, model_dir, draft_dir, ops.name, devices, cache_dtype)
                return cls(cfg, ranks.targets[0], ranks.drafters[0], load_tokenizer(model_dir), ops.name, max_context,
                           ranks)
            ckpt = Checkpoint(model_dir)
            target = Target(cfg, [load_target_weights(cfg, ckpt, rank, n) for rank in range(n)], ops, cache_dtype)
            drafter = load_drafter(draft_dir, target, ops) if draft_dir is not None else None
            return cls(cfg, target, drafter, load_tokenizer(model_dir), ops.name, max_context)

    def forward_logits(self, token_ids) -> np.ndarray:
        """Logits f32[T, vocab] of every position of `token_ids` from one prefill (the backend's prefill_form MLA) on
        a fresh cache."""
        tokens = np.asarray(token_ids, np.int32)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("token_ids: expected a non-empty 1-D list of token ids")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            raise ValueError(f"token_ids: ids must be in [0, {self.cfg.vocab_size})")
        def prefill(target):
            cache = target.new_cache(len(tokens))
            logits, _ = target.forward(tokens, np.arange(len(tokens), dtype=np.int32), cache,
                                       form=target.ops.prefill_form)
            return target.ops.to_host(logits)
        if self.ranks is not None:               # every rank runs it (collectives); all hold the same logits
            return self.ranks.run(lambda r: prefill(self.ranks.targets[r]))[0]
        with self.blas_threads():
            return prefill(self.target)

    def blas_threads(self):
        """Decode-sized matmuls run faster on one BLAS thread: on a 2-core machine with another busy process,
        17x384 @ 384x4096 took 3.7 ms on one thread and 15 ms on OpenBLAS's default two."""
        return threadpool_limits(1, "blas") if self.backend == "numpy" else contextlib.nullcontext()

    def rounds(self, batch, chunk=None, graphs=True, cost_table=None, auto=False):
        """The round over `batch` sequences on this backend (numbaengine/rounds.py): numpy, the reference round on
        the host; the kernel backends, the slots of one DeviceRounds (kept in rounds_cache per Shape), prompts
        prefilled in pieces of `chunk` tokens (None: whole), the round captured as a CUDA graph when `graphs`
        (cuda). cost_table: budget "auto"'s seconds per batch and tree size (None: numpy, with `auto` (runs of budget
        auto will come), the reference round timed on this CPU at the first use; kernel backends, measured from the
        rounds' graphs when they are made)."""
        if self.backend == "numpy":
            if auto and cost_table is None and self.drafter is not None:
                self.costs = self.costs or reference_costs(self.target, self.drafter, self.target.ops)
            return HostRounds(self.target, self.drafter, self.max_context,
                              table=cost_table if cost_table is not None else self.costs)
        return DeviceSlots(self.target, self.drafter, self.max_context, batch, chunk, self.rounds_cache, self.ranks,
                           graphs, table=cost_table, overlap=self.overlap)

    def generate(self, prompt, max_new_tokens, mode="ddtree", budget=16, temperature=0.0, seed=0, stop=None,
                 on_round=None, cost_table=None, prefill_chunk=PREFILL_CHUNK) -> gen.Result:
        """Decode one prompt (text or token ids): `ar`, `dflash` (chain) or `ddtree` (tree of `budget` nodes, or
        budget "auto": the size chosen each round, see generate_batch)."""
        return self.generate_batch([prompt], max_new_tokens, mode, budget, temperature, seed, stop, on_round,
                                   cost_table, prefill_chunk=prefill_chunk)[0]

    def generate_batch(self, prompts, max_new_tokens, mode="ddtree", budget=16, temperature=0.0, seed=0, stop=None,
                       on_round=None, cost_table=None, graphs=True,
                       prefill_chunk=PREFILL_CHUNK) -> list[gen.Result]:
        """Decode several prompts together, each with its own cache and tree (generate.generate_on over `rounds`).
        On the kernel backends (cuda, sim) all sequences run in one batched round on the device
        (numbaengine/device_round.py), captured as a CUDA graph on cuda unless graphs is False. budget "auto": each
        round's tree size from the drafter's probabilities and `cost_table` (a budget.CostTable; None: see
        rounds()). prefill_chunk: prompt tokens per prefill piece on the kernel backends (the server's
        --prefill-chunk; None: whole prompts)."""
        auto = budget == AUTO and mode == "ddtree"
        with self.blas_threads():
            rounds = self.rounds(len(prompts), prefill_chunk, graphs=graphs, cost_table=cost_table if auto else None,
                                 auto=auto)
            return gen.generate_on(rounds, self.tokenizer, prompts, max_new_tokens, mode, budget, temperature, seed,
                                   stop, on_round)
