"""DDTree rounds on the device for a batch of sequences, replayed as CUDA graphs (backends cuda and sim).

The round of numbaengine/ddtree.py (the reference: one sequence at a time, tree and walk on the host) restated
over static device buffers, so that one round is one graph launch and the host reads one small array per round:

  draft   block [bonus, MASK, ...] of every sequence -> drafter layers -> logits f32[n, Lb-1, V]
  build   per-depth top-K -> best-first tree (kernels/tree.py) -> tokens, positions, ancestor bits [n, N]
  verify  the target over all n*N tree rows at once (absorbed MLA reads each sequence's latent cache and bits)
  walk    one sample per node -> accepted path, new bonus, lengths += tau; out_tokens i32[n, L+2] for the host
  commit  accepted latent rows moved into place; their features -> the drafter context (fc, k/v per layer)

DFlash is the same round with one candidate per depth, autoregressive decoding the tree with the root alone.
Each slot keeps its own sampling temperature and seed (device arrays read by the sampling kernel per row) and its
own budget (at most the shape's), so sequences with any settings of one mode share the rounds.

Batch buckets: a round covers the slots [0, n) for the smallest bucket n (1, 2, 4, ..., batch) that holds every
decoding slot (slots are handed out lowest first), so a lightly loaded server runs small rounds. Each bucket has
its own buffers and graph (a Plan); the slot state (caches, lengths, settings) is shared, the plans view prefixes.

Budget "auto" (ddtree, Shape.ladder): a scored round is one graph: it drafts, takes the top-K and builds every
slot's tree at the largest ladder size, writing each node's path log-probability (the scores), then verifies, walks
and commits the prefix of that tree at the size chosen for it. The host reads the scores with the round's tokens and
picks the next round's size from them (numbaengine/budget.py: the rectangle rule, every slot gets that size since
verify rows are n x (size + 1) whatever the shares), so the size of round t + 1 comes from round t's drafts and the
next round is launched before the host handles this one's tokens. The first round, one after a coast and one after
the batch changed have no such scores: a probe graph (draft, top-K, tree) and, after the host's choice, a verify
graph of that size. Size 0 without a probe is the root alone (a coasting round): its row's target features wait in
a backlog (up to BACKLOG rows per slot) instead of going through the drafter's context projections every round, and
the next probe first writes them into the drafter context (FLUSH, a plan per depth: as many rows as the size-0 rounds
since the last flush). The cost table comes from timing the scored graphs (DeviceRounds.costs).

Prefill: one sequence at a time, whole or in pieces between rounds; a piece of up to 512 tokens is one graph launch
on a staging slot (PrefillPlan), then its rows are copied into the sequence's slot. A plan's first run is eager (it
compiles kernels and sizes scratch), the next is captured, later ones replay the graph.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from numbaengine.budget import COAST_MAX, CostTable
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
    """What a set of slots and its plans are made for (sampling settings and smaller budgets are per slot)."""
    batch: int               # slots: sequences decoded together at most (rounds cover a bucket of them)
    mode: str                # ddtree | dflash | ar
    budget: int              # drafted nodes per tree (ddtree: the most a slot may ask), chain length (dflash), 0 (ar)
    max_len: int             # committed rows a sequence may reach (its context)
    ladder: tuple = ()       # ddtree budget "auto": the tree sizes chosen among each round (budget = the largest)


def buckets(batch) -> tuple:
    """Round sizes over the slots: the powers of two below batch, then batch."""
    return tuple(1 << i for i in range(max(batch - 1, 0).bit_length()) if 1 << i < batch) + (batch,)


PROBE, VERIFY, SCORED = ("draft", "build"), ("build", "verify"), ("probe", "build", "verify")   # budget auto's stages
FLUSH = ("flush",)           # budget auto: the coast's backlog of target features into the drafter context
BACKLOG = COAST_MAX + 1      # backlog rows per slot: a probe's size-0 verify, then a coast of COAST_MAX rounds
FLUSH_DEPTHS = tuple(sorted({min(2 ** k + 1, BACKLOG) for k in range(COAST_MAX.bit_length())}))
#                              backlog rows per slot a flush plan writes: a probe's size-0 round and a coast of 2^k
#                              rounds leave 2^k + 1, so a flush runs the drafter's context projections over those
#                              rows only (auto's batch-128 decode of 64 tokens a prompt, H100: 126 ms flushing all
#                              65 at every probe, 72 ms with these depths, 76 ms without a backlog)


class Plan:
    """Buffers and captured graph of the rounds over slots [0, n) with trees of N nodes (N - 1 drafted at most).

    stages: "draft" (drafter block -> draft_logits -> per-depth top-K), "build" (trees), "verify" (target, walk,
    commit). A fixed-budget plan runs all three; budget auto has one probe per bucket (draft, build at the largest
    size, node scores) and per ladder size a verify plan (build, verify) sharing the probe's draft buffers, run
    after the probe, and a scored plan ("probe", build, verify) whose graph runs the probe and the verify in one;
    a flush plan (FLUSH) writes the coasting rounds' backlog into the drafter context before a probe.
    Each plan has its own op table (its scratch: a graph points into it, so no other plan may grow it)."""

    def __init__(self, rounds: DeviceRounds, n, N, stages, draft: Plan | None = None):
        self.n, self.N, self.stages, self.probe = n, N, stages, draft
        self.ops = ops = rounds.base_target.ops.fresh()
        self.target = rounds.base_target.with_ops(ops)
        d = rounds.base_drafter if rounds.shape.mode != "ar" else None
        self.drafter = d.with_ops(ops, self.target) if d is not None else None
        cfg, V, Lb = self.target.cfg, self.target.cfg.vocab_size, rounds.Lb
        L, F, H = max(Lb - 1, 1), len(rounds.layer_ids), cfg.hidden_size
        self.graph, self.rounds = None, 0
        if stages == FLUSH:                         # N: the plan's depth (FLUSH_DEPTHS); rows per slot to write
            with rounds.on_stream():
                self.count = ops.zeros(n, np.int32)
                if N < BACKLOG:                     # the first N backlog rows of each slot, contiguous
                    self.feats = ops.zeros((n, N, rounds.backlog.shape[2]), np.float32)
                    self.feat_pos = ops.zeros((n, N), np.int32)
            return
        check_memory(ops, plan_bytes(self.target, self.drafter, n, 0, N, Lb, V,
                                     verify="verify" in stages, draft=draft is None))
        with rounds.on_stream():
            if draft is None:                       # its own drafter block and top-K lists
                self.tb = tree_buffers(ops.zeros, n, L, rounds.K, N, V)
                if self.drafter is not None:
                    self.block_tokens = ops.zeros((n, Lb), np.int32)
                    self.block_pos = ops.zeros(n * Lb, np.int32)
                    self.kv_len = ops.zeros(n, np.int32)
                    self.draft_logits = ops.zeros((n, L, V), np.float32)
            else:                                   # the probe's top-K lists (its drafter block ran before)
                self.tb = tree_buffers(ops.zeros, n, L, rounds.K, N, V, topk=draft.tb)
                self.draft_logits = getattr(draft, "draft_logits", None)
            if "verify" in stages:
                self.logits = ops.zeros((n * N, V), np.float32)
                self.hidden = ops.zeros((F, n * N, H), np.float32)
                if self.drafter is not None:
                    self.feats = ops.zeros((n, L + 1, F * H), np.float32)
                    self.feat_pos = ops.zeros((n, L + 1), np.int32)


class PrefillPlan:
    """Buffers and captured graph of a prompt piece of up to T tokens into the staging slot: tokens, positions and
    the rows before it uploaded together (inputs i32[2T + 1]); a shorter piece is padded (its padding rows land
    past the piece, where the next piece or the decoding rewrites them before reading)."""

    def __init__(self, rounds: DeviceRounds, T):
        self.T, self.graph, self.rounds = T, None, 0
        self.ops = ops = rounds.base_target.ops.fresh()
        self.target = rounds.base_target.with_ops(ops)
        self.drafter = rounds.base_drafter.with_ops(ops, self.target) if rounds.drafter is not None else None
        cfg, F = self.target.cfg, len(rounds.layer_ids)
        check_memory(ops, {"prefill logits": T * cfg.vocab_size * 4,
                           "prefill activations": T * cfg.hidden_size * 4 * (2 * F + 24)})
        with rounds.on_stream():
            self.inputs = ops.zeros(2 * T + 1, np.int32)
            self.tokens, self.positions, self.start = self.inputs[:T], self.inputs[T:2 * T], self.inputs[2 * T:]
            self.ntok = ops.asarray(np.array([T], np.int32))
            self.logits = ops.zeros((T, cfg.vocab_size), np.float32)
            self.hidden = ops.zeros((F, T, cfg.hidden_size), np.float32)
            self.feats = ops.zeros((1, T, F * cfg.hidden_size), np.float32) if self.drafter is not None else None


class DeviceRounds:
    """Static device state of `batch` slots and the rounds over them.

    Device state per slot b: latent cache rows (one array u16[layers, B, cap, D]), lengths[b] = committed
    rows = position of the bonus token, bonus[b], budgets[b], seq_ids[b] (its noise stream), temps[b] (0: greedy)
    and seeds[b], and with a drafter its context K|V per layer f32[B, cap, 2 nkv, d] (key heads, then value
    heads). cap = max_len + room for one round's uncommitted rows. Budget auto with a drafter also keeps the
    coasting rounds' features: backlog f32[B, BACKLOG, F*H] of context rows ctx_from[b] .. lengths[b] - 1 (their
    positions in backlog_pos), the rows not yet in the drafter context.

    Slots start parked: a parked slot runs in the round with budget 0 at park_at[b] (0 when empty; a slot being
    prefilled in chunks parks at its prompt rows so far, where its round's scribbles land on rows the next chunk
    or its decoding rewrites before reading) and its output is ignored; rounds cover the bucket of slots
    [0, n) holding every slot that is not parked.

    Prompt pieces of up to max(prefill_rows) tokens (kernel MLA in the absorbed form) run as captured graphs on a
    staging slot (index `batch`, outside every round) that mirrors the slot being prefilled: its earlier rows are
    copied in when another slot was staged last, each piece's rows copied out to the slot after it (a few
    launches of a few bytes per row). So a prompt is a few graph launches whichever slot it goes to."""

    prefill_rows = (8, 32, 128, 512)   # prefill graph sizes: a piece runs in the smallest that holds it (padded),
    #                                    longer pieces eagerly; Engine.generate and the server cut prompts in pieces of
    #                                    rounds.PREFILL_CHUNK = 512. Not timed against other ladders

    def __init__(self, target, drafter, shape: Shape, graphs=True):
        if shape.mode not in MODES:
            raise ValueError(f"mode: {shape.mode!r} is not one of {', '.join(MODES)}")
        if shape.ladder and (shape.mode != "ddtree" or max(shape.ladder) != shape.budget):
            raise ValueError(f"ladder {shape.ladder}: budget auto needs mode ddtree and budget = its largest size")
        self.shape, self.base_target, self.base_drafter = shape, target, drafter
        self.drafter = drafter if shape.mode != "ar" else None
        self.target, ops = target, target.ops
        cfg, B, V = target.cfg, shape.batch, target.cfg.vocab_size
        self.Lb = self.drafter.block_size if self.drafter is not None else 1
        L = max(self.Lb - 1, 1)                      # depths (a dummy one in ar mode: the tree is the root)
        self.K = {"ddtree": min(max(shape.budget, 1), V), "dflash": 1, "ar": 1}[shape.mode]
        N = shape.budget + 1
        self.cap = shape.max_len + max(N, self.Lb, L + 1)
        self.layer_ids = self.drafter.layer_ids if self.drafter is not None else ()
        FH = len(self.layer_ids) * cfg.hidden_size
        coasts = bool(shape.ladder) and self.drafter is not None
        check_memory(ops, plan_bytes(target, self.drafter, B, self.cap, N, self.Lb, V)
                     | ({"coast backlog": B * BACKLOG * (FH + 1) * 4} if coasts else {}))
        self.stream = ops.xp.cuda.Stream(non_blocking=True) if ops.xp is not np else None
        with self.on_stream():      # zeroed on the rounds' stream: a null-stream memset is not ordered before it
            self.cache = ops.zeros((cfg.num_hidden_layers, B + 1, self.cap, cfg.latent_dim), np.uint16)   # +staging
            self.cache32 = self.cache.view(np.uint32)                    # bf16 pairs (the commit kernel's view)
            self.rows = [self.cache[i] for i in range(cfg.num_hidden_layers)]
            self.lengths, self.bonus, self.budgets, self.seq_ids = (ops.zeros(B, np.int32) for _ in range(4))
            self.temps, self.seeds = ops.zeros(B, np.float32), ops.zeros(B, np.uint64)
            self.ctx_kv = []                         # the drafter context per layer (none in ar mode)
            if self.drafter is not None:
                dc = self.drafter.cfg
                nkv = dc.num_key_value_heads
                self.ctx_kv = [ops.zeros((B + 1, self.cap, 2 * nkv, dc.head_dim), np.float32)
                               for _ in range(dc.num_hidden_layers)]              # per row: nkv key heads, nkv values
                self.ctx_k = [kv[:, :, :nkv] for kv in self.ctx_kv]
                self.ctx_v = [kv[:, :, nkv:] for kv in self.ctx_kv]
            self.backlog = self.backlog_pos = self.ctx_from = None
            if coasts:                               # coasting rounds keep their features for the next probe
                self.backlog = ops.zeros((B, BACKLOG, FH), np.float32)
                self.backlog_pos = ops.zeros((B, BACKLOG), np.int32)
                self.ctx_from = ops.zeros(B, np.int32)    # first context row not yet in the drafter context
        self.graphs = graphs and ops.xp is not np    # the simulator has no graphs: it runs every round eagerly
        self.plans = {}                              # (n, N, stages) -> Plan
        self.prefill_plans = {}                      # T -> PrefillPlan
        self.staged = None                           # (slot, rows): the staging slot holds that slot's rows [0, rows)
        self.plan = None                             # the latest round's (verify) plan
        self.table = None                            # budget auto: the cost table of these rounds (costs())
        self.rounds = 0
        self.gpu_s = 0.0                             # device time of the rounds (CUDA events around each)
        self.parked, self.park_at = set(range(B)), np.zeros(B, np.int32)   # host: parked slots and their rows
        self._parked, self._uploaded = None, False     # device (slots i32[k], rows i32[k]); whether it is current
        self._timed = []                             # (start, end) CUDA events of launches not yet added to gpu_s
        self._event_pairs = []                       # CUDA event pairs reused by launch (a round: one or two)

    # the latest round's buffers (tools read them)
    tb = property(lambda self: self.current().tb)
    logits = property(lambda self: self.current().logits)
    draft_logits = property(lambda self: self.current().draft_logits)
    graph = property(lambda self: self.current().graph)
    ops = property(lambda self: self.current().ops)

    def current(self) -> Plan:
        """The latest round's plan (before any round: the plan of a round over every slot)."""
        return self.plan if self.plan is not None else self.get_plan(self.shape.batch, self.shape.budget + 1)

    def get_plan(self, n, N, stages=("draft", "build", "verify")) -> Plan:
        """The plan of rounds over slots [0, n) with N-node trees, made at its first use."""
        key = (n, N, stages)
        if key not in self.plans:
            draft = self.get_plan(n, self.shape.budget + 1, PROBE) if stages in (VERIFY, SCORED) else None
            self.plans[key] = Plan(self, n, N, stages, draft)
        return self.plans[key]

    def bucket(self) -> int:
        """Slots [0, n) the next round covers: the smallest bucket holding every slot that is not parked."""
        live = [b for b in range(self.shape.batch) if b not in self.parked]
        top = max(live, default=0) + 1
        return next(n for n in buckets(self.shape.batch) if n >= top)

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
        with self.on_stream():
            logits = self._prompt_rows(b, ids, start, T)
            settings = ((self.temps, temperature), (self.seeds, seed), (self.seq_ids, seq_index), (self.lengths, T),
                        (self.budgets, budget)) + (((self.ctx_from, T),) if self.ctx_from is not None else ())
            for arr, value in settings:              # a scalar fill each: no host copy (the server's prefills)
                arr[b:b + 1] = value
            sample(logits[-1:], float(temperature), int(seed), self.seq_ids[b:b + 1], self.lengths[b:b + 1],
                   self.bonus[b:b + 1])
            self._set_parked(b, None)
            return int(ops.to_host(self.bonus[b:b + 1])[0])

    def prefill_part(self, b, ids, start, end):
        """Prompt rows [start, end) of slot b (the earlier ones written already) into its cache and drafter context,
        nothing sampled: a long prompt goes in chunks between rounds, the last one by prefill(start=...). The slot
        stays parked at `end` meanwhile."""
        if not 0 <= start < end < len(ids):
            raise ValueError(f"prefill_part: rows [{start}, {end}) are not a piece before the last of {len(ids)}")
        with self.on_stream():
            self._prompt_rows(b, ids, start, end)
        self._set_parked(b, end)

    def _prompt_rows(self, b, ids, start, end):
        """Target forward over ids[start:end] at positions start.. after the slot's rows [0, start) -> logits
        f32[end - start, V]; latent rows and drafter context rows start..end - 1 of slot b written. Through a
        prefill graph on the staging slot where one holds the piece, else eagerly into the slot."""
        T, ops = end - start, self.base_target.ops
        size = next((n for n in self.prefill_rows if n >= T), None)
        if size is None or start + size > self.cap or ops.prefill_form != "absorbed":
            return self._prompt_rows_eager(b, ids, start, end)
        plan = self.prefill_plans.get(size)
        if plan is None:
            plan = self.prefill_plans[size] = PrefillPlan(self, size)
        self._stage(b, start)
        inputs = np.zeros(2 * size + 1, np.int32)
        inputs[:T], inputs[size:2 * size], inputs[2 * size] = ids[start:end], np.arange(start, start + size), start
        self._after_null_stream()
        plan.inputs[...] = ops.asarray(inputs)
        self.launch(plan, lambda: self._prefill_run(plan), timed=False)
        S = self.shape.batch                         # the piece's rows into the slot
        self.cache[:, b, start:end] = self.cache[:, S, start:end]
        for kv in self.ctx_kv:
            kv[b, start:end] = kv[S, start:end]
        self.staged = (b, end)
        return plan.logits[:T]

    def _stage(self, b, start):
        """The staging slot holds slot b's rows [0, start) (copied in when another slot or prompt was staged)."""
        if start == 0 or self.staged == (b, start):
            return
        S = self.shape.batch
        self.cache[:, S, :start] = self.cache[:, b, :start]
        for kv in self.ctx_kv:
            kv[S, :start] = kv[b, :start]

    def _prefill_run(self, plan: PrefillPlan):
        """The launches of a prefill graph: the target over the piece's T rows on the staging slot, their features
        into its drafter context."""
        S = self.shape.batch
        plan.target.forward_into(plan.tokens, plan.positions, [r[S] for r in self.rows],
                                 LatentVis(plan.start, plan.ntok, None), plan.logits, plan.hidden, self.layer_ids)
        if plan.drafter is not None:
            F, T, H = plan.hidden.shape
            plan.ops.copy(plan.hidden.transpose(1, 0, 2), plan.feats.reshape(T, F, H))
            self._append(plan.drafter, plan.feats, plan.positions, plan.start, slice(S, S + 1))

    def _prompt_rows_eager(self, b, ids, start, end):
        """_prompt_rows launch by launch, straight into slot b."""
        ops = self.base_target.ops
        if self.staged is not None and self.staged[0] == b:          # the staging slot no longer mirrors it
            self.staged = None
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
            if self._null_done is None:
                self._null_done = self.base_target.ops.xp.cuda.Event(disable_timing=True)
            self._null_done.record(self.base_target.ops.xp.cuda.Stream.null)
            self.stream.wait_event(self._null_done)

    _null_done = None

    def retire(self, slots):
        """Finished (or empty) slots stay in the rounds of their bucket: they are parked at an empty context before
        every round so they never outgrow their rows (their output is ignored)."""
        for b in slots:
            self._set_parked(b, 0)
            if self.staged is not None and self.staged[0] == b:
                self.staged = None

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
        with self.on_stream():
            self._parked = (self.base_target.ops.asarray(np.array(slots, np.int32)),
                            self.base_target.ops.asarray(self.park_at[slots])) if slots else None

    def _park(self):
        self._upload_parked()
        if self._parked is not None:
            slots, rows = self._parked
            self.lengths[slots] = rows
            if self.ctx_from is not None:
                self.ctx_from[slots] = rows          # nothing of a parked slot is in the backlog
            self.budgets[slots] = 0

    # --- one round ---------------------------------------------------------------------------------------------------

    def step(self, size=None, scored=False) -> np.ndarray:
        """One round over the bucket of decoding slots; returns out_tokens i32[n, L+2] (row b: tau, then the tau new
        tokens). Budget auto: the round's second half, after probe(), with the ladder size chosen for it; size 0
        without a probe (the root alone: a coasting round); or, scored, a whole round of that size whose probe runs
        in the same graph (scores() reads its node scores after)."""
        self.start(size, scored)
        return self.finish()

    def start(self, size=None, scored=False):
        """step's launches without waiting for them: the round runs while the host goes on; finish() reads it."""
        with self.on_stream():
            if not self.shape.ladder:
                self._park()
                plan = self.get_plan(self.bucket(), self.shape.budget + 1)
            elif size == 0 and self._probed is None:       # coasting: the root alone, no draft (budget.Coast)
                self._park()
                plan = self.get_plan(self.bucket(), 1, VERIFY)
                self._add_backlog_row()
            elif scored:
                if size not in self.shape.ladder or not size or self._probed is not None:
                    raise ValueError(f"step: a scored round needs a size of {self.shape.ladder[1:]} and no probe "
                                     f"pending, got {size}")
                self._park()
                self._flush_backlog(self.bucket())          # (rounds choose a scored size only after drafting)
                plan = self.get_plan(self.bucket(), size + 1, SCORED)
            else:
                if size not in self.shape.ladder or self._probed is None:
                    raise ValueError(f"step: budget auto needs probe() first and a size of {self.shape.ladder} (or "
                                     f"size 0 alone), got {size}")
                plan, self._probed = self.get_plan(self._probed, size + 1, VERIFY), None
                if size == 0:
                    self._add_backlog_row()
            self.launch(plan)
            self.plan = plan
            self.rounds += 1

    def finish(self) -> np.ndarray:
        """out_tokens of the round start() launched (waits for it)."""
        with self.on_stream():
            out = self.base_target.ops.to_host(self.plan.tb.out_tokens)
            self._add_gpu_time()
            return out

    def scores(self) -> np.ndarray:
        """After a scored round (or probe() and its step): its probe's node scores f64[n, N], as probe() returns."""
        with self.on_stream():
            return self.base_target.ops.to_host(self.plan.probe.tb.scores)

    def probe(self) -> np.ndarray:
        """Budget auto, the first half of a round over the bucket of decoding slots: draft, top-K and every slot's
        tree at the largest ladder size; returns scores f64[n, N] (node i's path log-probability in pop order, the
        root 0, -inf past the slot's tree). step(size) finishes the round."""
        if not self.shape.ladder:
            raise ValueError("probe: only rounds made for budget auto (Shape.ladder) have a probe")
        with self.on_stream():
            self._park()
            n = self.bucket()
            self._flush_backlog(n)
            plan = self.get_plan(n, self.shape.budget + 1, PROBE)
            self.launch(plan)
            self._probed, self._probe_plan = n, plan
            scores = self.base_target.ops.to_host(plan.tb.scores)
            self._add_gpu_time()
            return scores

    def probe_trees(self) -> tuple:
        """After probe() (and its step: the verify leaves them be): its trees, tokens and parents i32[n, N] in pop
        order, as scores; budget auto's hindsight (budget.Hindsight). Read before the next round drafts."""
        if self._probe_plan is None:
            raise ValueError("probe_trees: no probe has run")
        tb, ops = self._probe_plan.tb, self.base_target.ops
        with self.on_stream():
            return ops.to_host(tb.tokens), ops.to_host(tb.parents)

    def _flush_backlog(self, n):
        """Before a round that drafts over slots [0, n): the rows coasting rounds left in the backlog (a size-0 round
        since the last flush) into the drafter context (FLUSH), by the flush plan of the smallest depth holding
        them."""
        if self._backlog_rows:
            depth = next(d for d in FLUSH_DEPTHS if d >= self._backlog_rows)
            self.launch(self.get_plan(n, depth, FLUSH))
            self._backlog_rows = 0

    def _add_backlog_row(self):
        """A size-0 round was launched: each slot's committed row waits in the backlog (auto rounds with a drafter)."""
        if self.ctx_from is not None:
            if self._backlog_rows >= BACKLOG:
                raise RuntimeError(f"budget auto: more than {BACKLOG} size-0 rounds without a flush")
            self._backlog_rows += 1

    _probed = None                                   # the bucket probed and not yet stepped
    _probe_plan = None                               # the latest probe's plan (probe_trees)
    _backlog_rows = 0                                # size-0 rounds since the last flush: rows per slot at most

    def launch(self, plan, body=None, timed=True):
        """One run of a plan (body: its launches, default run(plan)): eager the first time, captured the second, the
        graph replayed after; timed (into gpu_s) by CUDA events on cuda."""
        body = body or (lambda: self.run(plan))
        if self.graphs and plan.graph is None and plan.rounds >= 1:
            with span("capture"):
                plan.graph = self.capture(plan, body)
        events = None
        if self.stream is not None and timed:
            if len(self._timed) == len(self._event_pairs):       # (a failed round left its events unread)
                self._event_pairs.append((plan.ops.xp.cuda.Event(), plan.ops.xp.cuda.Event()))
            events = self._event_pairs[len(self._timed)]
            events[0].record(self.stream)
        if plan.graph is not None:
            plan.graph.launch(self.stream)
        else:
            body()
        if events is not None:
            events[1].record(self.stream)
            self._timed.append(events)
        plan.rounds += 1

    def _add_gpu_time(self):
        """Device seconds of the launches since the last call (their events have completed: the host read waited)."""
        if not self._timed:
            return
        xp = self.base_target.ops.xp
        for a, b in self._timed:
            self.gpu_s += xp.cuda.get_elapsed_time(a, b) / 1e3
        self._timed.clear()

    def round(self, mark=lambda phase: None):
        """The launches of one round of the latest plan (eager; tools/bench.py records events at each mark)."""
        self.run(self.current(), mark)

    def run(self, plan: Plan, mark=lambda phase: None):
        """The launches of a plan's stages (eager, or recorded by capture). mark(phase) is called as each phase
        starts."""
        if plan.stages == FLUSH:
            mark("draft")
            self._flush(plan)
            return
        n, N, tb = plan.n, plan.N, plan.tb
        lengths, bonus = self.lengths[:n], self.bonus[:n]
        if "probe" in plan.stages:
            self.run(plan.probe, mark)
        if "draft" in plan.stages and plan.drafter is not None:
            mark("draft")
            self._draft(plan)
        mark("build")
        if "draft" in plan.stages and plan.drafter is not None:
            tree_topk(plan.draft_logits, tb)
        tree_build(tb, self.budgets[:n], lengths, bonus, self.seq_ids[:n])
        if "verify" not in plan.stages:
            return
        mark("verify")
        plan.target.forward_into(tb.tokens.reshape(-1), tb.positions.reshape(-1), [r[:n] for r in self.rows],
                                 LatentVis(lengths, tb.ntok, tb.vis), plan.logits, plan.hidden, self.layer_ids)
        mark("walk")
        sample(plan.logits, self.temps[:n], self.seeds[:n], tb.sample_seq, tb.sample_pos, tb.post, tb.sample_work,
               tb.ntok)
        tree_walk(tb, lengths, bonus)                                 # lengths += tau, bonus = the next token
        mark("commit")
        if plan.drafter is None:
            tree_commit(tb, self.cache32[:, :n])
            return
        F, H = plan.hidden.shape[0], plan.hidden.shape[2]
        hidden, ctx_from = plan.hidden.reshape(F, n, N, H), self.ctx_from[:n] if self.ctx_from is not None else None
        if ctx_from is not None and N == 1:          # coasting: the rows wait in the backlog for the next probe
            tree_commit(tb, self.cache32[:, :n], hidden, self.backlog[:n], self.backlog_pos[:n], ctx_from, True)
            return
        tree_commit(tb, self.cache32[:, :n], hidden, plan.feats, plan.feat_pos, ctx_from)
        self._append(plan.drafter, plan.feats, plan.feat_pos.reshape(-1), tb.start, slice(0, n))

    def _flush(self, plan: Plan):
        """The backlog's rows (context rows ctx_from[b] .. lengths[b] - 1 of slots [0, n), those that coasting
        rounds committed) into the drafter context, then ctx_from = lengths: a probe's first launches."""
        n, depth, xp = plan.n, plan.N, plan.ops.xp
        lengths, ctx_from = self.lengths[:n], self.ctx_from[:n]
        xp.subtract(lengths, ctx_from, out=plan.count)
        xp.clip(plan.count, 0, depth, out=plan.count)
        feats, pos = self.backlog[:n], self.backlog_pos[:n]
        if depth < BACKLOG:
            feats, pos = plan.ops.copy(feats[:, :depth], plan.feats), plan.ops.copy(pos[:, :depth], plan.feat_pos)
        self._append(plan.drafter, feats, pos.reshape(-1), ctx_from, slice(0, n), plan.count)
        plan.ops.copy(lengths, ctx_from)

    def _draft(self, plan: Plan):
        """Drafter block of slots [0, n) over their context -> draft_logits f32[n, Lb-1, V] (slots 1..Lb-1)."""
        d, ops, n, Lb = plan.drafter, plan.ops, plan.n, self.Lb
        nh, hd = d.cfg.num_attention_heads, d.cfg.head_dim
        lengths = self.lengths[:n]
        ops.block_inputs(self.bonus[:n], lengths, d.mask_id, plan.block_tokens, plan.block_pos, plan.kv_len)
        h = plan.target.embed(plan.block_tokens.reshape(-1), ops.scratch("d.h", (n * Lb, d.cfg.hidden_size)))

        def attend(i, q, kv):          # block keys go right after the committed context, then attend to it all
            ops.write_rows(kv, self.ctx_kv[i][:n], lengths)
            o = ops.scratch("d.o", (n, Lb, nh, hd))
            return ops.kv_attention(q.reshape(n, Lb, nh, hd), self.ctx_k[i][:n], self.ctx_v[i][:n], plan.kv_len,
                                    d.scale, o).reshape(n * Lb, nh, hd)

        x = d.block(h, plan.block_pos, attend).reshape(n, Lb, -1)[:, 1:]            # slots 1.. are the drafts
        if n > 1:                      # rows of several blocks: contiguous for the lm_head GEMM (one row at n = 1)
            x = ops.copy(x, ops.scratch("d.slots", x.shape))
        plan.target.lm_head(x.reshape(n * (Lb - 1), -1), plan.draft_logits.reshape(n * (Lb - 1), -1))

    def _append(self, drafter, feats, positions, start, slots, count=None):
        """Drafter context rows start[b].. of `slots` from target features feats f32[b, P, F*H] at positions
        i32[b*P] (rows past a sequence's tau land beyond its length and are overwritten later; count i32[b]: only
        the first count[b] rows are written)."""
        nb, P, FH = feats.shape
        drafter.context_kv(feats.reshape(nb * P, FH), positions,
                           lambda i, kv: drafter.ops.write_rows(kv, self.ctx_kv[i][slots], start, count))

    # --- budget auto: the cost of a round ----------------------------------------------------------------------------

    def costs(self, reps=3, context=16) -> CostTable:
        """Seconds of one auto round per bucket and ladder size on this device: that size's scored graph and the
        host reads (size 0: the verify graph alone, a round without drafting: budget.Coast), the best of `reps`
        after the eager run and the capture, with every slot of the bucket drafting full trees at `context`
        committed rows (zero rows: attention reads them all the same). The probe path's graphs (probe, then the
        size's verify) are made and captured here too, untimed, so no round captures later. Needs every slot
        parked; all are parked again after."""
        if not self.shape.ladder:
            raise ValueError("costs: only rounds made for budget auto (Shape.ladder) choose among sizes")
        if len(self.parked) != self.shape.batch:
            raise RuntimeError("costs: the rounds are measured with no sequence decoding (every slot parked)")
        warm, seconds, context = (2 if self.graphs else 1), {}, min(context, self.shape.max_len)
        with span("costs"):
            for n in buckets(self.shape.batch):
                row = []
                for depth in FLUSH_DEPTHS if self.ctx_from is not None else ():  # the flushes made and captured
                    for _ in range(warm):
                        self._dummy_slots(n, context)
                        self.launch(self.get_plan(n, depth, FLUSH))
                for size in self.shape.ladder:
                    for _ in range(warm if size else 0):   # the probe path (first rounds) made and captured too
                        self._dummy_slots(n, context)
                        self.probe()
                        self.step(size)
                    best = float("inf")
                    for i in range(warm + max(reps, 1)):
                        self._dummy_slots(n, context)
                        t0 = time.perf_counter()
                        self.step(size, scored=size > 0)     # size 0: a round without drafting, as coasting runs it
                        if size:
                            self.scores()
                        best = best if i < warm else min(best, time.perf_counter() - t0)
                    row.append(best)
                seconds[n] = tuple(row)
            self.retire(range(self.shape.batch))
        cfg = self.base_target.cfg
        return CostTable(self.shape.ladder, seconds, model=f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                         f"vocab {cfg.vocab_size}", device=device_name(self.base_target.ops))

    def _dummy_slots(self, n, context):
        """Slots [0, n) decoding from `context` zero rows (bonus token 1, greedy, full budget): what costs() times."""
        ops = self.base_target.ops
        with self.on_stream():
            for arr, value in ((self.lengths, context), (self.bonus, 1), (self.budgets, self.shape.budget),
                               (self.temps, 0.0), (self.seq_ids, 0)):
                arr[:n] = ops.asarray(np.full(n, value, arr.dtype))
        for b in range(self.shape.batch):
            self._set_parked(b, None if b < n else 0)

    # --- graphs ------------------------------------------------------------------------------------------------------

    def capture(self, plan, body):
        """Record one run of the plan (body()) as a CUDA graph. Everything it touches exists already (the eager run
        made it); a run that allocated, synchronized or copied from the host during capture is an error."""
        pool = plan.ops.xp.get_default_memory_pool()
        before = pool.total_bytes()
        self.stream.begin_capture()
        try:
            body()
        finally:
            graph = self.stream.end_capture()
        if pool.total_bytes() != before:
            raise RuntimeError("capture: a round allocated device memory while being captured (a buffer is missing "
                               "from the Plan or an op made a temporary)")
        graph.upload(self.stream)
        return graph

    def _dot(self) -> str:
        dot = self.graph.debug_dot_str()
        return dot.decode() if isinstance(dot, bytes) else dot

    def kernel_nodes(self) -> list:
        """Kernel names in the latest plan's captured graph (numba's mangled names, CuPy's elementwise kernels)."""
        if self.graph is None:
            return []
        import re
        return re.findall(r"_Z\w+|cupy_\w+", self._dot())

    def graph_depth(self) -> int:
        """Nodes on the longest dependency chain of the latest plan's graph: what its launch latencies add up along
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

    def on_stream(self):
        return self.stream if self.stream is not None else contextlib.nullcontext()


def device_name(ops) -> str:
    if ops.xp is np:
        return "simulator" if ops.name == "sim" else "cpu"
    xp = ops.xp
    name = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


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

    def step(self, size=None, scored=False) -> np.ndarray:
        return self._agree(self.ranks.run(lambda r: self.devs[r].step(size, scored)), "round")

    def scores(self) -> np.ndarray:
        return self._agree(self.ranks.run(lambda r: self.devs[r].scores()), "scores")

    def probe(self) -> np.ndarray:
        return self._agree(self.ranks.run(lambda r: self.devs[r].probe()), "probe")

    def probe_trees(self) -> tuple:
        return self.devs[0].probe_trees()                # (probe's scores agreed: the same trees)

    def costs(self, reps=3, context=16) -> CostTable:
        """Rank 0's table; every rank runs the same rounds (their collectives pair up)."""
        return self.ranks.run(lambda r: self.devs[r].costs(reps, context))[0]

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


def plan_bytes(target, drafter, B, cap, N, Lb, V, verify=True, draft=True) -> dict:
    """Device bytes of the buffers, by role (weights are resident already): the slots' state (cap > 0: latent cache
    and drafter context of B slots) and a plan's buffers over B slots with N-node trees (its verify, its draft)."""
    cfg = target.cfg
    F = len(drafter.layer_ids) if drafter is not None else 0
    plan = {"latent cache": cfg.num_hidden_layers * B * cap * cfg.latent_dim * 2}
    if verify:
        plan |= {"verify logits": B * N * V * 4, "verify activations": B * N * cfg.hidden_size * 4 * (F + 24)}
    if drafter is not None:
        dc = drafter.cfg
        plan["drafter context"] = 2 * dc.num_hidden_layers * B * cap * dc.num_key_value_heads * dc.head_dim * 4
        plan["draft logits"] = B * (Lb - 1) * V * 4 if draft else 0
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
