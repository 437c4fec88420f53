"""The two implementations of a decoding round over a set of sequences, behind the small interface that the one
decoding loop (numbaengine/generate.py `decode`) drives:

  fits(run, busy)      may `run` join the runs `busy` (those being prefilled or decoding)?
  begin(run, busy)     a place for it: its cache rows (run.limit) and, on the device, its slot
  piece(run)           prompt tokens of its next prefill piece
  fill(run, n)         prefill n more prompt tokens; True once the prompt is complete (run.seq holds the bonus)
  step(runs, timer)    one round of every decoding run -> {id(run): RoundOut | the exception that run raised}
  retire(runs)         finished runs give their places back

and the attributes target, drafter, max_context and PHASES (the round's timer phases).

HostRounds runs the reference round (numbaengine/ddtree.py decode_round) on the host, one sequence after another.
DeviceSlots runs the slots of one DeviceRounds (numbaengine/device_round.py) together: one graph launch and one
small host read per round (budget "auto": the size chosen from the last round's drafts, so also one launch; two
after a probe, when there is no last round to choose from). Both run budget "auto" (numbaengine/budget.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

from numbaengine.budget import (
    AUTO,
    LADDER,
    Calibration,
    Coast,
    CostTable,
    Picks,
    auto_round,
    choose_rect,
    hindsight,
    observe,
    reference_costs,
    root_choice,
    settle,
    tree_rows,
)
from numbaengine.ddtree import Params, RoundOut, Seq, decode_round, prefill

PREFILL_CHUNK = 512      # prompt tokens per prefill piece on the kernel backends, for Engine.generate and the server
#                          alike (so a request's pieces, and so its tokens, do not depend on who asks); the server
#                          prefills at most this many between two rounds. Not timed against other sizes


@dataclass(eq=False)
class Run:
    """One sequence: its prompt and settings, its place in the rounds, its output so far."""
    ids: list                          # prompt token ids (checked by generate.prompt_ids)
    max_new: int                       # output tokens at most (exact)
    stop: set                          # token ids that end the output (kept)
    p: Params = Params()               # mode, temperature, seed
    budget: int | str = 16             # ddtree: drafted nodes per round, or "auto"
    index: int = 0                     # noise stream: the batch index in generate, 0 for a server request
    limit: int = 0                     # cache rows (begin): prompt + max_new + one round's tree, capped by the context
    slot: int = 0                      # device slot (begin)
    filled: int = 0                    # prompt tokens prefilled
    seq: Seq | None = None             # the round's state, once the prompt is prefilled
    tokens: list = field(default_factory=list)
    taus: list = field(default_factory=list)
    stop_reason: str | None = None     # "stop" | "length" | "context" | "error" | "cancelled" once finished
    picks: Picks | None = None         # budget "auto": the sizes chosen for it
    owner: object = None               # what the caller keeps with it (the server's Live)


def tree_width(mode, budget, drafter):
    """Drafted nodes per round: the budget (ddtree), the chain Lb-1 (dflash), none (ar)."""
    return {"ddtree": budget, "dflash": drafter.block_size - 1 if drafter is not None else 0, "ar": 0}[mode]


def ends(run: Run, tokens) -> bool:
    """Whether pushing this round's tokens (generate.push, before it) ends run: a stop token, max_new reached, or no
    cache row left for the next bonus (run.seq already committed). The server's stop strings and cancellations
    are not foreseen: an overlapped round runs for nothing then."""
    return (len(run.tokens) + len(tokens) >= run.max_new or not run.stop.isdisjoint(tokens)
            or run.seq.start >= run.limit)


def left_of(runs, outs=None) -> list[int]:
    """Tokens each run has still to make (after this round's outs, when given): budget auto's drain rule."""
    return [max(1, r.max_new - len(r.tokens) - (len(outs[id(r)].tokens) if outs else 0)) for r in runs]


def cache_rows(run: Run, width, max_context) -> int:
    """The rows a sequence's cache gets: prompt + output + one round's tree, capped by the context."""
    return min(max_context, len(run.ids) + run.max_new + width)


# --- the host: the reference round, one sequence at a time -----------------------------------------------------------

class HostRounds:
    """Host sequences, each with its own cache; any mix of settings runs in one round (one sequence after another,
    a failure isolated to its sequence). Budget "auto" (ddtree): each round the sizes are chosen together for all
    the runs from their drafts and `table` (budget.auto_round), the calibration carried over rounds; ragged: the
    batch total shared by path probability, else the device's rectangle rule (every run gets the size)."""
    PHASES = ("draft", "build", "verify", "walk", "commit")

    def __init__(self, target, drafter, max_context, ops=None, table=None, ragged=True):
        self.target, self.drafter, self.max_context = target, drafter, max_context
        self.ops = ops if ops is not None else target.ops
        self.table, self.cal, self.ragged = table, Calibration(), ragged
        self.table_from = "given"
        self.coasts = {}                            # auto: Params -> (its group's cost row, their Coast)
        self.drain = False                          # auto: the runs decoding are the whole batch (budget.pick)
        self.picks = []                             # every auto run's Picks: each gets the batch's calibration
        self.pending = []                           # auto: probes whose trees settle later (budget.Hindsight)

    def auto(self, run) -> bool:
        return run.budget == AUTO and run.p.mode == "ddtree"

    def width(self, run) -> int:
        return max(self.table.sizes) if self.auto(run) else tree_width(run.p.mode, run.budget, self.drafter)

    def fits(self, run, busy) -> bool:
        return True

    def begin(self, run, busy):
        if self.auto(run) and self.table is None:           # the reference round timed now (about half a second)
            self.table, self.table_from = reference_costs(self.target, self.drafter, self.ops), "measured"
        run.limit = cache_rows(run, self.width(run), self.max_context)
        run.picks = Picks(table_from=self.table_from) if self.auto(run) else None
        if run.picks is not None:
            self.picks.append(run.picks)

    def piece(self, run) -> int:
        """The whole prompt: the host prefills it in one forward."""
        return len(run.ids) - run.filled

    def fill(self, run, n) -> bool:
        run.seq = prefill(run.index, run.ids, self.target, self.drafter_of(run), self.ops, run.p, run.limit)
        run.filled = len(run.ids)
        return True

    def drafter_of(self, run):
        return self.drafter if run.p.mode != "ar" else None

    def room(self, run) -> int:
        """This round's tree size: the width, shrunk near a full cache."""
        return min(self.width(run), run.seq.cache.max_len - run.seq.start - 1)

    def step(self, runs, timer) -> dict:
        """A round of every run: fixed budgets one sequence at a time, auto runs one auto_round per group of equal
        settings (the choice is shared, the samples keyed by each run's settings)."""
        out, auto = {}, {}
        for r in runs:
            if self.auto(r):
                auto.setdefault(r.p, []).append(r)
                continue
            try:
                out[id(r)] = decode_round([r.seq], [self.room(r)], self.target, self.drafter_of(r), self.ops, r.p,
                                          timer)[0]
            except Exception as e:                  # noqa: BLE001 - isolated per sequence
                out[id(r)] = e
        for group in auto.values():
            try:
                out |= self.auto_step(group, timer)
            except Exception as e:                  # noqa: BLE001 - isolated per group
                out |= {id(r): e for r in group}
        if self.pending:
            self.cal, self.pending = settle(self.cal, self.pending, out)
        for picks in self.picks if auto else ():
            picks.cal = self.cal
        return out

    def auto_step(self, runs, timer) -> dict:
        p, row = runs[0].p, self.table.listed(len(runs))            # the cost row the group's rounds pay
        was, coast = self.coasts.get(p, (None, Coast()))
        rooms = [self.room(r) for r in runs]
        choice, outs, probed, coast = auto_round([r.seq for r in runs], rooms, self.target, self.drafter, self.ops, p,
                                                 timer, self.table, self.cal, self.ragged,
                                                 coast if was == row else Coast(), left_of(runs) if self.drain else None)
        self.coasts[p] = (row, coast)
        for i, r in enumerate(runs):
            r.picks.add(choice, i)
        if probed is not None:
            h = hindsight(runs, *tree_rows(probed), rooms, self.table.sizes)
            if h is not None:
                self.pending.append(h)
        return {id(r): out for r, out in zip(runs, outs)}

    def retire(self, runs):
        self.picks = [p for p in self.picks if all(p is not r.picks for r in runs)]


# --- the device: slots of one DeviceRounds ---------------------------------------------------------------------------

@dataclass
class DeviceSlots:
    """`batch` slots of one DeviceRounds (Replicated over `ranks`), made for the mode and tree width of the run that
    finds the slots empty: runs of that mode with any temperature, seed and a budget up to that width share the
    rounds (budget "auto" runs share rounds made for auto), and so do ar runs in ddtree rounds (a slot budget of 0:
    the root alone) and fixed budgets in auto rounds (a slot budget capping the chosen size) (`fits`). A round
    covers the smallest bucket of slots holding every decoding one (slots are handed out lowest first), each bucket
    its own captured graph. A prompt is prefilled in pieces ending at multiples of `chunk` tokens (None: whole),
    the same pieces whatever else runs, so the output does not depend on the load. `cache` keeps the DeviceRounds (buffers, graphs and, for auto,
    the measured cost table) of the last Shape between uses: one resident at a time, they are large. Each
    sequence's tau is cut to its cache rows (run.limit), as the host round shrinks its last trees.

    Budget "auto": each round the probe's trees at the largest ladder size give every slot's expected acceptance;
    the ladder size with the most expected tokens per second of `table` (None: measured from these rounds' graphs
    when they are made, DeviceRounds.costs, and kept in the kernel cache folder: numbaengine/cost_store.py) runs
    (budget.choose_rect, the rectangle rule); the calibration is carried over rounds."""
    target: object
    drafter: object
    max_context: int
    batch: int
    chunk: int | None = None
    cache: dict = field(default_factory=dict)
    ranks: object = None                 # several devices (numbaengine/devices.py): one replica of the round each
    graphs: bool = True                  # capture the round as a CUDA graph (cuda)
    table: CostTable | None = None       # budget auto: seconds per bucket and ladder size (None: measured)
    ladder: tuple = LADDER               # budget auto: the sizes chosen among
    cost_reps: int = 3                   # budget auto: timed runs per bucket and size when measuring the table
    overlap: bool = True                 # launch the next round before the host handles this one's tokens (step).
    #                                      H200, shipped pair, tools.bench, tokens/s on against off (two calls on one
    #                                      machine): ar batch 1 / 8 / 32 / 128 2,923 / 19,672 / 60,151 / 168,412
    #                                      against 2,768 / 20,012 / 53,651 / 130,380; ddtree-16 4,609 / 11,883 /
    #                                      37,647 / 58,242 against 4,575 / 12,817 / 36,252 / 61,460
    ahead: list | None = None            # overlap: the runs of the round launched ahead, not yet read
    dev: object = None
    free: list = field(default_factory=list)
    # budget auto: the calibrations of a probe's drafts (cal: every prefix size of its trees, in hindsight) and of
    # sizes chosen from the round before's drafts (cal_lagged: they foretell the next round differently; the sizes
    # that ran) are kept on the rounds (dev.learned), so a later run on
    # them goes on learning from them; the coast is not (H100, shipped pair, the coast carried into the next batch
    # too: batch 1 probed 11 times in 504 rounds and chose the root alone every time, 0.60 of ddtree-16; the call
    # before, each run probing first: 0.67)
    cal: Calibration = field(default_factory=Calibration)
    cal_lagged: Calibration = field(default_factory=Calibration)
    coast: Coast = field(default_factory=Coast)   # rounds left without a probe (budget.Coast)
    coasting: int = 0                             # the cost row (bucket) the coast was chosen for
    next: tuple | None = None                     # budget auto: (ids of the runs, Choice) for the next round, chosen
    #                                               from this round's drafts: it runs as one scored graph, no probe
    ahead_choice: object = None                   # budget auto: the Choice of the round launched ahead
    probed: object = None                         # budget auto: the scores probe() returned this round (else None)
    pending: list = field(default_factory=list)   # budget auto: probes whose trees settle later (budget.Hindsight)
    picks: list = field(default_factory=list)
    drain: bool = False                  # budget auto: the runs decoding are the whole batch, none joins when one
    #                                      ends (generate_on): sizes chosen for the soonest end (budget.pick)
    PHASES = ("round", "gpu")            # gpu: the device time of the rounds (CUDA events), part of "round"

    def auto(self, run) -> bool:
        return run.budget == AUTO and run.p.mode == "ddtree"

    def width(self, run) -> int:
        return max(self.ladder) if self.auto(run) else tree_width(run.p.mode, run.budget, self.drafter)

    def shape(self, run):
        from numbaengine.device_round import Shape
        return Shape(self.batch, run.p.mode, self.width(run), self.max_context,
                     tuple(self.ladder) if self.auto(run) else ())

    def fits(self, run, busy) -> bool:
        """Whether run can join the busy runs' rounds: the same mode and kind of budget with a tree no wider, or an
        ar run in ddtree rounds (its slot's trees are the root alone: ar's round), or a fixed budget in auto rounds
        (its slot's trees get at most that many nodes, and each round's chosen size at most)."""
        return not busy or self.joins(run)

    def joins(self, run) -> bool:
        """Whether run can take a slot of the rounds made now (fits' rule)."""
        shape = self.dev.shape if self.dev is not None else None
        if shape is None:
            return False
        if shape.mode == "ddtree" and (run.p.mode == "ar" or (shape.ladder and run.p.mode == "ddtree")):
            return self.width(run) <= shape.budget
        return run.p.mode == shape.mode and bool(shape.ladder) == self.auto(run) and self.width(run) <= shape.budget

    def begin(self, run, busy):
        """A slot for run; rounds made for its shape when there are none, or when no run is busy and run cannot join
        the rounds made (a server keeps its warmed-up rounds, graphs captured, for every run that fits them)."""
        if self.dev is None or (not busy and not self.joins(run)):
            self.build(self.shape(run))
        run.limit = cache_rows(run, self.width(run), self.max_context)
        run.slot = self.free.pop(0)
        table_from = "given" if self.table is not None else getattr(self.dev, "table_from", "measured")
        run.picks = Picks(table_from=table_from) if self.auto(run) else None
        if run.picks is not None:
            self.picks.append(run.picks)

    def build(self, shape):
        """The rounds of `shape`: the cached ones (every slot parked) or new ones in place of the cached; for auto
        with no table given, their cost table read from the kernel cache folder or measured now (every slot is
        parked) and saved there (numbaengine/cost_store.py)."""
        from numbaengine.cost_store import rounds_key, table_for
        from numbaengine.device_round import DeviceRounds, Replicated
        if self.ahead is not None and self.dev is not None:
            self.dev.finish()                        # the round launched ahead is done before any slot is reset
            self.ahead = None
        self.dev = self.cache.get(shape)
        if self.dev is None:
            self.cache.clear()                       # free the old buffers first
            self.dev = (DeviceRounds(self.target, self.drafter, shape, self.graphs) if self.ranks is None
                        else Replicated(self.ranks, shape, self.graphs))
            self.cache[shape] = self.dev
        self.dev.retire(list(range(shape.batch)))
        if shape.ladder:                             # what earlier runs on these rounds learned (their last step)
            self.cal, self.cal_lagged = getattr(self.dev, "learned", (Calibration(), Calibration()))
        if shape.ladder and self.table is None and getattr(self.dev, "table", None) is None:
            key = rounds_key(self.target, self.drafter, shape, self.ranks, self.graphs)
            self.dev.table, self.dev.table_from = table_for(key, lambda: self.dev.costs(self.cost_reps))
        self.free = list(range(shape.batch))

    def piece(self, run) -> int:
        """Prompt tokens of run's next prefill piece: up to the next multiple of chunk."""
        if self.chunk is None:
            return len(run.ids) - run.filled
        return min(len(run.ids), (run.filled // self.chunk + 1) * self.chunk) - run.filled

    def fill(self, run, n) -> bool:
        """Prefill the next n prompt tokens of run; True once the prompt is complete (its first token sampled)."""
        if self.dev is None:
            raise RuntimeError("the device rounds failed while this prompt was being prefilled")
        end = run.filled + n
        if end < len(run.ids):
            self.dev.prefill_part(run.slot, run.ids, run.filled, end)
            run.filled = end
            return False
        budget = self.width(run) if self.dev.shape.mode == "ddtree" else None      # an ar run in ddtree rounds: 0
        bonus = self.dev.prefill(run.slot, run.ids, run.index, run.p.temperature, run.p.seed, budget, run.filled)
        run.seq, run.filled = Seq(run.index, None, None, len(run.ids), bonus), end
        return True

    def step(self, runs, timer) -> dict:
        """One round of the bucket holding every decoding slot; out_tokens row b: tau, then the tau new tokens.
        With `overlap` (one device), a round launched ahead by the last step is read instead (its runs: a run that
        joined since gets no out this time), and the next round of the runs that go on is launched before this
        returns (the slots of those that end parked first), so the GPU decodes while the host handles these tokens:
        fixed budgets, and budget auto's rounds whose size is known (coasting, or chosen from this round's
        drafts)."""
        gpu0 = self.dev.gpu_s
        members, ladder = runs, self.dev.shape.ladder
        try:
            with timer("round"):
                self.probed = None
                if self.ahead is not None:
                    members, self.ahead = self.ahead, None
                    choice, out = self.ahead_choice, self.dev.finish()
                elif ladder:
                    choice, out = self.auto_step(runs)
                else:
                    out = self.dev.step()
        except Exception:
            self.drop()
            raise
        timer.add("gpu", self.dev.gpu_s - gpu0)
        rows = out.tolist()                          # one conversion for every slot (Python ints)
        if members is not runs:                      # a round launched ahead: its runs still decoding
            live = {id(r) for r in runs}
            members = [r for r in members if id(r) in live]
        outs = {id(r): self.commit(r, rows[r.slot]) for r in members}
        if ladder:
            self.coast = self.coast.after(choice)
            self.next = self.choose_next(members, outs, choice)
        ended = {id(r) for r in members if ends(r, outs[id(r)].tokens)}
        going = [r for r in runs if id(r) not in ended]
        if self.overlap and self.ranks is None and going and self.ahead_ok(ladder, going):
            if ended:                                # parked first: the round launched ahead leaves their slots be
                self.dev.retire([r.slot for r in runs if id(r) in ended])
            try:
                with timer("round"):
                    if not ladder:
                        self.dev.start()
                    elif self.coast.left:
                        self.ahead_choice = root_choice(len(going))
                        self.dev.start(0)
                    else:
                        self.ahead_choice, self.next = self.next[1], None
                        self.dev.start(self.ahead_choice.size, scored=self.ahead_choice.size > 0)
            except Exception:
                self.drop()
                raise
            self.ahead = going
        if ladder:                                   # (after the launch: the GPU does not wait for the bookkeeping)
            if choice.lagged:
                self.cal_lagged = observe(self.cal_lagged, choice, [outs[id(r)].tau for r in members])
            if self.pending:
                self.cal, self.pending = settle(self.cal, self.pending, outs)
            for i, r in enumerate(members):
                if r.picks is not None:              # (not an ar or fixed-budget run sharing the auto rounds)
                    r.picks.add(choice, i)
            for picks in self.picks:
                picks.cal = self.cal
            self.dev.learned = (self.cal, self.cal_lagged)
        return outs

    def ahead_ok(self, ladder, going) -> bool:
        """Whether the next round of the runs `going` on may be launched now: fixed budgets, or auto rounds of the
        same cost row whose coast goes on or whose size is chosen already (self.next, for these runs)."""
        return not ladder or (self.coasting == self.cost_row() and bool(
            self.coast.left or (self.next is not None and self.next[0] == [id(r) for r in going])))

    def choose_next(self, members, outs, choice):
        """Budget auto, after a round that drafted (not coasting): the next round's choice from this round's node
        scores for the runs that go on, each with the cache rows it has left then, and the calibration before this
        round's. The drafts are one round old when that round runs: the calibration (observe) learns what they
        foretell about it. None while coasting."""
        from numbaengine.device_round import buckets
        if not choice.probed or self.coast.left:
            return None
        going = [r for r in members if not ends(r, outs[id(r)].tokens)]
        if not going:
            return None
        scores = self.probed if self.probed is not None else self.dev.scores()      # (a probe's: read already)
        rooms = [max(0, min(self.width(r), r.limit - r.seq.start - 1)) for r in going]
        table = self.table if self.table is not None else self.dev.table
        top = max(r.slot for r in going) + 1
        bucket = next(n for n in buckets(self.batch) if n >= top)
        choice = choose_rect(scores[[r.slot for r in going], 1:], rooms, table, self.cal_lagged, bucket,
                             left_of(going, outs) if self.drain else None)
        return [id(r) for r in going], replace(choice, lagged=True)

    def cost_row(self) -> int:
        """The cost table's batch that the next round pays (its bucket of slots)."""
        table = self.table if self.table is not None else self.dev.table
        return table.listed(self.dev.bucket())

    def auto_step(self, runs):
        """Budget auto: the size chosen from the last round's drafts (self.next) as one scored graph; without one
        (the first round, after a coast, or other runs than those it was chosen for) the probe, the choice from each
        run's pops (cut to its cache rows), that size's verify; while coasting, the root alone without the probe."""
        row = self.cost_row()
        if self.coasting != row:                     # the rounds pay another cost row: probe now
            self.coast, self.coasting, self.next = Coast(), row, None
        if self.coast.left:
            return root_choice(len(runs)), self.dev.step(0)
        if self.next is not None and self.next[0] == [id(r) for r in runs]:
            choice, self.next = self.next[1], None
            return choice, self.dev.step(choice.size, scored=choice.size > 0)
        scores = self.probed = self.dev.probe()
        rooms = [max(0, min(self.width(r), r.limit - r.seq.start - 1)) for r in runs]
        table = self.table if self.table is not None else self.dev.table
        choice = choose_rect(scores[[r.slot for r in runs], 1:], rooms, table, self.cal, scores.shape[0],
                             left_of(runs) if self.drain else None)
        out = self.dev.step(choice.size)
        tokens, parents = self.dev.probe_trees()                   # (the verify leaves the probe's trees be)
        rows = [r.slot for r in runs]
        h = hindsight(runs, tokens[rows], parents[rows], scores[rows], rooms, table.sizes)
        if h is not None:
            self.pending.append(h)
        return choice, out

    def drop(self):
        """Forget the rounds (after a failure, or before others are made): a round still running is waited for
        first, so that no buffer it writes is handed out again under it."""
        if self.ahead is not None and self.dev is not None:
            with contextlib.suppress(Exception):        # its failure is not this call's
                self.dev.finish()
        self.ahead = None
        self.cache.clear()                           # rebuilt for the next run
        self.dev = None

    def commit(self, run, row) -> RoundOut:
        """Row [tau, tokens...] of the round's output (a list) -> run's RoundOut, tau cut to its cache rows."""
        tau = min(row[0], run.limit - run.seq.start)
        tokens = row[1:tau + 1]
        run.seq.start += tau
        run.seq.bonus = tokens[-1] if tokens else run.seq.bonus
        return RoundOut(None, None, tokens, tau)

    def retire(self, runs):
        slots = [r.slot for r in runs]
        self.picks = [p for p in self.picks if all(p is not r.picks for r in runs)]
        if self.dev is not None and slots:
            self.dev.retire(slots)
            self.free = sorted(set(self.free) | set(slots))
