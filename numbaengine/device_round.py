"""DDTree rounds on the device for a batch of sequences, replayed as CUDA graphs (backends cuda and sim).

The round of numbaengine/ddtree.py (the reference: one sequence at a time, tree and walk on the host) restated
over static device buffers, so that one round is one graph launch and the host reads one small array per round:

  draft   block [bonus, MASK, ...] of every sequence -> drafter layers -> logits f32[B, Lb-1, V]
  build   per-depth top-K -> best-first tree (kernels/tree.py) -> tokens, positions, ancestor bits [B, N]
  verify  the target over all B*N tree rows at once (absorbed MLA reads each sequence's latent cache and bits)
  walk    one sample per node -> accepted path, new bonus, lengths += tau; out_tokens i32[B, L+2] for the host
  commit  accepted latent rows moved into place; their features -> the drafter context (fc, k/v per layer)

DFlash is the same round with one candidate per depth, autoregressive decoding the tree with the root alone.
Each slot keeps its own sampling temperature and seed (device arrays read by the sampling kernel per row) and its
own budget (at most the shape's), so sequences with any settings of one mode share the rounds. Prefill stays
eager (one sequence at a time, whole or in chunks between rounds). Rounds of one shape share buffers; the first
round runs eagerly (it compiles kernels and sizes scratch), the next is captured, later ones replay the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numbaengine.ddtree import MODES
from numbaengine.kernels.sample import sample
from numbaengine.kernels.tree import (
    tree_buffers,
    tree_build,
    tree_commit,
    tree_topk,
    tree_walk,
)
from numbaengine.model import LatentCache
from numbaengine.ops_cuda import LatentVis
from numbaengine.phases import span


@dataclass(frozen=True)
class Shape:
    """What a set of buffers and a captured graph are made for (sampling settings and smaller budgets are per slot)."""
    batch: int               # sequences decoded together (B)
    mode: str                # ddtree | dflash | ar
    budget: int              # drafted nodes per tree (ddtree: the most a slot may ask), chain length (dflash), 0 (ar)
    max_len: int             # committed rows a sequence may reach (its context)


class DeviceRounds:
    """Static device state of `batch` sequences and the round over it.

    Device state per sequence b: latent cache rows (one array u16[layers, B, cap, D]), lengths[b] = committed
    rows = position of the bonus token, bonus[b], budgets[b], seq_ids[b] (its noise stream), temps[b] (0: greedy)
    and seeds[b], and with a drafter its context K|V per layer f32[B, cap, 2 nkv, d] (key heads, then value
    heads). cap = max_len + room for one round's uncommitted rows.

    Slots start parked: a parked slot runs in the round with budget 0 at park_at[b] (0 when empty; a slot being
    prefilled in chunks parks at its prompt rows so far, where its round's scribbles land on rows the next chunk
    or its decoding rewrites before reading) and its output is ignored."""

    def __init__(self, target, drafter, shape: Shape, graphs=True):
        if shape.mode not in MODES:
            raise ValueError(f"mode: {shape.mode!r} is not one of {', '.join(MODES)}")
        self.shape, self.base_target, self.base_drafter = shape, target, drafter
        self.ops = ops = target.ops.fresh()          # the round's own scratch: graphs point into it
        self.target = target.with_ops(ops)
        self.drafter = drafter.with_ops(ops, self.target) if drafter is not None and shape.mode != "ar" else None
        cfg, B, V = target.cfg, shape.batch, target.cfg.vocab_size
        self.Lb = self.drafter.block_size if self.drafter is not None else 1
        L = max(self.Lb - 1, 1)                      # depths (a dummy one in ar mode: the tree is the root)
        K = {"ddtree": min(max(shape.budget, 1), V), "dflash": 1, "ar": 1}[shape.mode]
        N = shape.budget + 1
        self.cap = shape.max_len + max(N, self.Lb, L + 1)
        self.layer_ids = self.drafter.layer_ids if self.drafter is not None else ()
        F, H = len(self.layer_ids), cfg.hidden_size
        check_memory(ops, plan_bytes(target, self.drafter, B, self.cap, N, self.Lb, V))
        self.stream = ops.xp.cuda.Stream(non_blocking=True) if ops.xp is not np else None
        with self._on_stream():     # zeroed on the rounds' stream: a null-stream memset is not ordered before it
            self.cache = ops.zeros((cfg.num_hidden_layers, B, self.cap, cfg.latent_dim), np.uint16)
            self.rows = [self.cache[i] for i in range(cfg.num_hidden_layers)]
            self.lengths, self.bonus, self.budgets, self.seq_ids = (ops.zeros(B, np.int32) for _ in range(4))
            self.temps, self.seeds = ops.zeros(B, np.float32), ops.zeros(B, np.uint64)
            self.tb = tree_buffers(ops.zeros, B, L, K, N, V)
            self.logits = ops.zeros((B * N, V), np.float32)
            self.hidden = ops.zeros((F, B * N, H), np.float32)
            if self.drafter is not None:
                dc = self.drafter.cfg
                nkv = dc.num_key_value_heads
                self.ctx_kv = [ops.zeros((B, self.cap, 2 * nkv, dc.head_dim), np.float32)
                               for _ in range(dc.num_hidden_layers)]              # per row: nkv key heads, nkv values
                self.ctx_k = [kv[:, :, :nkv] for kv in self.ctx_kv]
                self.ctx_v = [kv[:, :, nkv:] for kv in self.ctx_kv]
                self.block_tokens = ops.zeros((B, self.Lb), np.int32)
                self.block_pos = ops.zeros(B * self.Lb, np.int32)
                self.kv_len = ops.zeros(B, np.int32)
                self.draft_logits = ops.zeros((B, L, V), np.float32)
                self.feats = ops.zeros((B, L + 1, F * H), np.float32)
                self.feat_pos = ops.zeros((B, L + 1), np.int32)
        self.graphs = graphs and ops.xp is not np    # the simulator has no graphs: it runs every round eagerly
        self.graph = None
        self.rounds = 0
        self.gpu_s = 0.0                             # device time of the rounds (CUDA events around each)
        self.parked, self.park_at = set(range(B)), np.zeros(B, np.int32)   # host: parked slots and their rows
        self._parked, self._uploaded = None, False     # device (slots i32[k], rows i32[k]); whether it is current
        self._events = (ops.xp.cuda.Event(), ops.xp.cuda.Event()) if self.stream is not None else None

    # --- prefill (eager, one sequence) -----------------------------------------------------------------------------

    def prefill(self, b, ids, seq_index, temperature=0.0, seed=0, budget=None, start=0) -> int:
        """Prompt ids of slot b through the target (MLA in ops.prefill_form) into its cache rows, its features into the
        drafter context, rows start.. (those before were written by prefill_part); the first token is sampled at
        the last position with the slot's temperature and seed (noise stream seq_index). The slot decodes from the
        next round with `budget` nodes per tree (default and at most the shape's). Returns the token (one host
        read)."""
        budget = self.shape.budget if budget is None else int(budget)
        if not 0 <= budget <= self.shape.budget:
            raise ValueError(f"budget: {budget} is not in 0..{self.shape.budget} (the rounds' tree size)")
        ops, T = self.base_target.ops, len(ids)
        if not 0 <= start < T:
            raise ValueError(f"prefill: start {start} is not in 0..{T - 1} (the prompt's rows not yet written)")
        with self._on_stream():
            logits = self._prompt_rows(b, ids, start, T)
            for arr, value in ((self.temps, temperature), (self.seeds, seed), (self.seq_ids, seq_index),
                               (self.lengths, T), (self.budgets, budget)):
                arr[b:b + 1] = ops.asarray(np.array([value], arr.dtype))
            sample(logits[-1:], float(temperature), int(seed), self.seq_ids[b:b + 1],
                   ops.asarray(np.array([T], np.int32)), self.bonus[b:b + 1])
            self._set_parked(b, None)
            return int(ops.to_host(self.bonus[b:b + 1])[0])

    def prefill_part(self, b, ids, start, end):
        """Prompt rows [start, end) of slot b (the earlier ones written already) into its cache and drafter context,
        nothing sampled: a long prompt goes in chunks between rounds, the last one by prefill(start=...). The slot
        stays parked at `end` meanwhile."""
        if not 0 <= start < end < len(ids):
            raise ValueError(f"prefill_part: rows [{start}, {end}) are not a piece before the last of {len(ids)}")
        with self._on_stream():
            self._prompt_rows(b, ids, start, end)
        self._set_parked(b, end)

    def _prompt_rows(self, b, ids, start, end):
        """Target forward over ids[start:end] at positions start.. after the slot's rows [0, start) -> logits
        f32[end - start, V]; latent rows and drafter context rows start..end - 1 of slot b written."""
        ops = self.base_target.ops
        tokens, positions = np.asarray(ids[start:end], np.int32), np.arange(start, end, dtype=np.int32)
        self._after_null_stream()
        cache = LatentCache([rows[b] for rows in self.rows], start)
        logits, hidden = self.base_target.forward(tokens, positions, cache, None, self.layer_ids,
                                                  form=ops.prefill_form)
        if self.drafter is not None:
            feats = ops.asarray(hidden.transpose(1, 0, 2).reshape(1, end - start, -1))   # [1, T, F*H]
            first = ops.asarray(np.array([start], np.int32))
            self._append(self.base_drafter, feats, ops.asarray(positions), first, slice(b, b + 1))
        return logits

    def _after_null_stream(self):
        """The rounds' stream waits for what the null stream holds (weights and other uploads made outside it: a
        pageable copy returns before its DMA lands, and a non-blocking stream is not ordered after the null one)."""
        if self.stream is not None:
            done = self.ops.xp.cuda.Event(disable_timing=True)
            done.record(self.ops.xp.cuda.Stream.null)
            self.stream.wait_event(done)

    def retire(self, slots):
        """Finished (or empty) slots keep running inside the graph: they are parked at an empty context before every
        round so they never outgrow their rows (their output is ignored)."""
        for b in slots:
            self._set_parked(b, 0)

    def _set_parked(self, b, rows):
        """Park slot b at `rows` committed rows, or (None) let it decode."""
        if rows is None:
            self.parked.discard(b)
        else:
            self.parked.add(b)
            self.park_at[b] = rows
        self._uploaded = False

    def _upload_parked(self):
        """The parked slots and their rows to the device when they changed (most rounds: no upload). The copy goes on
        the rounds' (non-blocking) stream: on the null stream a pageable copy may still be in flight when _park
        reads it (stale slot ids)."""
        if self._uploaded:
            return
        self._uploaded = True
        slots = sorted(self.parked)
        with self._on_stream():
            self._parked = (self.ops.asarray(np.array(slots, np.int32)),
                            self.ops.asarray(self.park_at[slots])) if slots else None

    def _park(self):
        if self._parked is not None:
            slots, rows = self._parked
            self.lengths[slots] = rows
            self.budgets[slots] = 0

    # --- one round ---------------------------------------------------------------------------------------------------

    def step(self) -> np.ndarray:
        """One round for every slot; returns out_tokens i32[B, L+2] (row b: tau, then the tau new tokens)."""
        self._upload_parked()
        with self._on_stream():
            self._park()
            if self.graphs and self.graph is None and self.rounds >= 1:
                with span("capture"):
                    self.graph = self.capture()
            if self._events:
                self._events[0].record(self.stream)
            if self.graph is not None:
                self.graph.launch(self.stream)
            else:
                self.round()
            if self._events:
                self._events[1].record(self.stream)
            self.rounds += 1
            out = self.ops.to_host(self.tb.out_tokens)
            if self._events:
                self.gpu_s += self.ops.xp.cuda.get_elapsed_time(*self._events) / 1e3
            return out

    def round(self, mark=lambda phase: None):
        """The launches of one round (eager, or recorded by capture). mark(phase) is called as each phase starts
        (tools/bench.py records events there)."""
        tb, B, N = self.tb, self.shape.batch, self.tb.tokens.shape[1]
        if self.drafter is not None:
            mark("draft")
            self._draft()
        mark("build")
        if self.drafter is not None:
            tree_topk(self.draft_logits, tb)
        tree_build(tb, self.budgets, self.lengths, self.bonus, self.seq_ids)
        mark("verify")
        self.target.forward_into(tb.tokens.reshape(-1), tb.positions.reshape(-1), self.rows,
                                 LatentVis(self.lengths, tb.ntok, tb.vis), self.logits, self.hidden, self.layer_ids)
        mark("walk")
        sample(self.logits, self.temps, self.seeds, tb.sample_seq, tb.sample_pos, tb.post, tb.sample_work, tb.ntok)
        tree_walk(tb, self.lengths, self.bonus)                      # lengths += tau, bonus = the next token
        mark("commit")
        if self.drafter is None:
            tree_commit(tb, self.cache)
            return
        F, H = self.hidden.shape[0], self.hidden.shape[2]
        tree_commit(tb, self.cache, self.hidden.reshape(F, B, N, H), self.feats, self.feat_pos)
        self._append(self.drafter, self.feats, self.feat_pos.reshape(-1), tb.start, slice(None))

    def _draft(self):
        """Drafter block of every sequence over its context -> draft_logits f32[B, Lb-1, V] (slots 1..Lb-1)."""
        d, ops, B, Lb = self.drafter, self.ops, self.shape.batch, self.Lb
        nh, hd = d.cfg.num_attention_heads, d.cfg.head_dim
        ops.block_inputs(self.bonus, self.lengths, d.mask_id, self.block_tokens, self.block_pos, self.kv_len)
        h = self.target.embed(self.block_tokens.reshape(-1), ops.scratch("d.h", (B * Lb, d.cfg.hidden_size)))

        def attend(i, q, kv):          # block keys go right after the committed context, then attend to it all
            ops.write_rows(kv, self.ctx_kv[i], self.lengths)
            o = ops.scratch("d.o", (B, Lb, nh, hd))
            return ops.kv_attention(q.reshape(B, Lb, nh, hd), self.ctx_k[i], self.ctx_v[i], self.kv_len, d.scale,
                                    o).reshape(B * Lb, nh, hd)

        x = d.block(h, self.block_pos, attend).reshape(B, Lb, -1)[:, 1:]            # slots 1.. are the drafts
        if B > 1:                      # rows of several blocks: contiguous for the lm_head GEMM (one row at B = 1)
            x = ops.copy(x, ops.scratch("d.slots", x.shape))
        self.target.lm_head(x.reshape(B * (Lb - 1), -1), self.draft_logits.reshape(B * (Lb - 1), -1))

    def _append(self, drafter, feats, positions, start, slots):
        """Drafter context rows start[b].. of `slots` from target features feats f32[b, P, F*H] at positions
        i32[b*P] (rows past a sequence's tau land beyond its length and are overwritten later)."""
        nb, P, FH = feats.shape
        drafter.context_kv(feats.reshape(nb * P, FH), positions,
                           lambda i, kv: drafter.ops.write_rows(kv, self.ctx_kv[i][slots], start))

    # --- graphs ------------------------------------------------------------------------------------------------------

    def capture(self):
        """Record one round as a CUDA graph. Everything it touches exists already (the eager round made it); a
        round that allocated, synchronized or copied from the host during capture is an error."""
        pool = self.ops.xp.get_default_memory_pool()
        before = pool.total_bytes()
        self.stream.begin_capture()
        try:
            self.round()
        finally:
            graph = self.stream.end_capture()
        if pool.total_bytes() != before:
            raise RuntimeError("capture: a round allocated device memory while being captured (a buffer is missing "
                               "from DeviceRounds or an op made a temporary)")
        graph.upload(self.stream)
        return graph

    def _dot(self) -> str:
        dot = self.graph.debug_dot_str()
        return dot.decode() if isinstance(dot, bytes) else dot

    def kernel_nodes(self) -> list:
        """Kernel names in the captured round's DOT dump (numba's mangled names, CuPy's elementwise kernels)."""
        if self.graph is None:
            return []
        import re
        return re.findall(r"_Z\w+|cupy_\w+", self._dot())

    def graph_depth(self) -> int:
        """Nodes on the longest dependency chain of the captured round: what its launch latencies add up along
        (parallel branches, ops.branch(), make it shorter than the node count)."""
        if self.graph is None:
            return 0
        import collections
        import re
        succ, preds = collections.defaultdict(list), collections.Counter()
        for a, b in re.findall(r'"(\w+)" -> "(\w+)"', self._dot()):
            succ[a].append(b)
            preds[b] += 1
        depth = {n: 1 for n in succ if not preds[n]}
        ready = list(depth)
        while ready:                                 # Kahn's order: a node's depth is final when it is ready
            a = ready.pop()
            for b in succ[a]:
                depth[b] = max(depth.get(b, 1), depth[a] + 1)
                preds[b] -= 1
                if not preds[b]:
                    ready.append(b)
        return max(depth.values(), default=1)

    def _on_stream(self):
        import contextlib
        return self.stream if self.stream is not None else contextlib.nullcontext()


class Replicated:
    """The same DeviceRounds on every rank of several devices (numbaengine/devices.py), driven together: each call
    runs on all ranks at once (a thread per device); the host gets rank 0's answer after checking that every rank
    computed the same (the tree work is replicated, so they must commit identical tokens)."""

    def __init__(self, ranks, shape: Shape, graphs=True):
        self.ranks = ranks
        self.devs = ranks.run(lambda r: DeviceRounds(ranks.targets[r], ranks.drafters[r], shape, graphs))

    def prefill(self, b, ids, seq_index, temperature=0.0, seed=0, budget=None, start=0) -> int:
        return self._agree(self.ranks.run(lambda r: self.devs[r].prefill(b, ids, seq_index, temperature, seed, budget,
                                                                         start)), "prefill")

    def prefill_part(self, b, ids, start, end):
        self.ranks.run(lambda r: self.devs[r].prefill_part(b, ids, start, end))

    def step(self) -> np.ndarray:
        return self._agree(self.ranks.run(lambda r: self.devs[r].step()), "round")

    def retire(self, slots):
        if slots:                                    # retire([]) changes nothing: spare the thread round trip
            self.ranks.run(lambda r: self.devs[r].retire(slots))

    def __getattr__(self, name):                     # shape, tb, graph, gpu_s, kernel_nodes, ...: rank 0's
        return getattr(self.__dict__["devs"][0], name)

    def _agree(self, answers, what):
        for r, a in enumerate(answers[1:], 1):
            if not np.array_equal(a, answers[0]):
                raise RuntimeError(f"{what}: device {self.ranks.devices[r]} committed other tokens than device "
                                   f"{self.ranks.devices[0]} (ranks out of step)")
        return answers[0]


def plan_bytes(target, drafter, B, cap, N, Lb, V) -> dict:
    """Device bytes the round's buffers need, by role (weights are resident already)."""
    cfg = target.cfg
    F = len(drafter.layer_ids) if drafter is not None else 0
    plan = {"latent cache": cfg.num_hidden_layers * B * cap * cfg.latent_dim * 2,
            "verify logits": B * N * V * 4, "verify activations": B * N * cfg.hidden_size * 4 * (F + 24)}
    if drafter is not None:
        dc = drafter.cfg
        plan["drafter context"] = 2 * dc.num_hidden_layers * B * cap * dc.num_key_value_heads * dc.head_dim * 4
        plan["draft logits"] = B * (Lb - 1) * V * 4
    return plan


def check_memory(ops, plan):
    """Clear error when the round's buffers cannot fit in the free device memory."""
    if ops.xp is np:
        return
    free = ops.xp.cuda.runtime.memGetInfo()[0]
    need = sum(plan.values())
    if need > 0.9 * free:
        top = max(plan, key=plan.get)
        raise MemoryError(f"memory: decoding needs {need / 2**30:.2f} GiB of buffers ({top}: {plan[top] / 2**30:.2f} "
                          f"GiB) but {free / 2**30:.2f} GiB are free: lower max_context, the batch or the budget")
