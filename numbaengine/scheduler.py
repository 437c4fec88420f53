"""Continuous batching: one engine thread runs the decoding loop (numbaengine/generate.py `decode`); requests join
between rounds (prefill, then the next round) and leave as soon as they finish, hit a stop string, fail or are
cancelled.

A request decodes as Engine.generate would decode it alone: sequence index 0 and its own seed key its sampling
noise, its cache has generate's size, and its round sees only its own tree. On numpy each sequence runs its own
decode_round (HostRounds: they are sequential there anyway); on the kernel backends the requests share the slots of
one DeviceRounds (DeviceSlots): any temperature, seed and budget up to the running tree size join it, and so do ar
requests in ddtree rounds and fixed budgets in auto rounds (DeviceSlots.fits); any other waits until that batch
drains. Between two rounds at most
`prefill_chunk` prompt tokens are prefilled, so a long prompt (prefilled in pieces on the kernel backends) does not
stall the running decodes for long.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from numbaengine import generate as gen
from numbaengine.ddtree import Params
from numbaengine.rounds import PREFILL_CHUNK, Run
from numbaengine.tokenizer import TextStream


class QueueFull(Exception):
    """More requests are waiting than the scheduler accepts (HTTP 429)."""


@dataclass(eq=False)
class Request:
    ids: list                          # prompt token ids, checked by generate.prompt_ids
    max_tokens: int
    mode: str = "ddtree"
    budget: int = 16
    temperature: float = 0.0
    seed: int = 0
    stop_ids: list | None = None       # token ids that end the output (kept); None: the checkpoint's eos ids
    stop_strings: tuple = ()           # the text ends before the first one found
    emit: Callable = print             # emit(Update), called on the engine thread
    cancelled: bool = False
    decode: bool = True                # the engine thread makes each update's text (settle); False (no stop
    #                                    strings): updates carry the new token ids and the receiver makes the text
    #                                    (Receiver), off the engine thread's path between two rounds


@dataclass
class Update:
    """What one prefill or round did for a request."""
    text: str = ""                     # text added since the last update
    tokens: int = 0                    # completion tokens so far
    finish_reason: str | None = None   # "stop" | "length" once finished
    error: str | None = None           # the engine failed this request (finish_reason is "error")
    ids: list | None = None            # Request.decode False: the token ids added since the last update (no text)


@dataclass(eq=False)
class Live:
    """A request in the batch: its sequence (prefill progress, output) and the text sent so far."""
    req: Request
    run: Run
    stream: TextStream | None = None   # the output's text
    seen: int = 0                      # tokens the last update covered (no stop string in their text)
    sent: int = 0                      # characters sent
    picked: int = 0                    # budget auto: entries of run.picks already in the round stats


@dataclass
class AutoPick:
    """One budget-auto sequence in one round: the tree size chosen and its drafts, expected and accepted."""
    size: int                          # the round's ladder size (drafted nodes per sequence)
    expected: float                    # accepted drafts the drafter's probabilities expected
    calibrated: float                  # the same, calibrated by past rounds (what the choice weighed)
    accepted: int                      # drafts the target accepted: tau - 1 (tau >= 1)


@dataclass
class RoundStats:
    seconds: float
    taus: list                         # tokens committed per sequence
    batch: int                         # sequences in the round
    queued: int                        # requests waiting after it
    auto: list = field(default_factory=list)     # an AutoPick per budget-auto sequence of the round


class Scheduler:
    """The engine thread and its queue. submit() and cancel() are called from any thread."""

    def __init__(self, engine, max_batch=8, max_queue=64, on_round=None, fail_ids=None, prefill_chunk=PREFILL_CHUNK,
                 rounds=None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be a positive number of tokens, got {prefill_chunk!r}")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.prefill_chunk = prefill_chunk
        self.rounds = rounds if rounds is not None else engine.rounds(max_batch, prefill_chunk)
        self.on_round = on_round or (lambda stats: None)
        self.fail_ids = fail_ids           # test hook: a request with exactly these prompt ids fails in its round
        self.pending, self.active = deque(), set()     # queued; admitted and not finished (Live)
        self.picks = []                    # the AutoPicks of the round being reported
        self.cond, self.stopping = threading.Condition(), False
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def submit(self, req: Request):
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise QueueFull(f"{len(self.pending)} requests are queued (--max-queue {self.max_queue})")
            self.pending.append(req)
            self.cond.notify()

    def cancel(self, req: Request):
        """The request leaves before the next round (or the queue now); it gets no more updates."""
        with self.cond:
            req.cancelled = True
            if req in self.pending:
                self.pending.remove(req)

    def close(self, timeout=None):
        """Finish what is queued and running, then end the engine thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout)

    def load(self) -> dict:
        return dict(active=len(self.active), queued=len(self.pending), max_batch=self.max_batch)

    # --- the engine thread: generate.decode with the queue as its admission ---------------------------------------

    def _loop(self):
        with self.engine.blas_threads():     # the BLAS threads Engine.generate decodes with
            gen.decode(self.rounds, [], self._report, gen.Timer(()), self._admit, self.prefill_chunk, self._stats)

    def _admit(self, waiting, live) -> list | None:
        """Before each pass: cancelled runs end; queued requests take free places, in order, while the rounds take
        them (begun, prefilled by the loop). Blocks while there is nothing to do; None once stopping and drained."""
        for run in waiting + live:
            if run.owner.req.cancelled:
                self._end(run, "cancelled")
        with self.cond:
            while not waiting and not live and not self.pending:
                if self.stopping:
                    return None
                self.cond.wait()
        new = []
        while True:
            busy = [r for r in waiting + live if r.stop_reason is None] + new
            with self.cond:
                if not self.pending or len(busy) >= self.max_batch:
                    return new
                run = self._run(self.pending[0])
                if not self.rounds.fits(run, busy):
                    return new
                self.pending.popleft()
            try:
                gen.check_args(run.p.mode, run.budget, run.max_new, run.p.temperature, self.engine.drafter)
                self.rounds.begin(run, busy)
            except Exception as e:      # noqa: BLE001 - one request's fault fails only that request
                run.owner.req.emit(Update(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                continue
            self.active.add(run.owner)
            new.append(run)

    def _run(self, req: Request) -> Run:
        stop = set(self.engine.cfg.eos_ids if req.stop_ids is None else (int(t) for t in req.stop_ids))
        run = Run(req.ids, req.max_tokens, stop, Params(req.mode, float(req.temperature), int(req.seed)), req.budget)
        run.owner = Live(req, run)
        return run

    def _report(self, run, out):
        """Send the update of a prefill or round (or its exception); a finished sequence (stop token, length, context,
        stop string), a failed or a cancelled one ends."""
        x = run.owner
        if out is not None and not isinstance(out, Exception):
            self._pick(x, out.tau)
        try:
            if out is not None and x.req.ids == self.fail_ids:
                raise RuntimeError("injected fault (--fail-prompt)")
            if isinstance(out, Exception):
                raise out
            if x.req.cancelled:
                self._end(run, "cancelled")
                return
            update = settle(self.engine.tokenizer, x) if x.req.decode else new_ids(x)
            if update.finish_reason is not None:
                self.active.discard(x)
            x.req.emit(update)
        except Exception as e:          # noqa: BLE001 - isolated to this request
            self._end(run, "error")
            with contextlib.suppress(Exception):     # an emit that failed too: the engine thread goes on
                x.req.emit(Update(tokens=len(run.tokens), finish_reason="error", error=f"{type(e).__name__}: {e}"))

    def _end(self, run, reason):
        run.stop_reason = reason
        self.active.discard(run.owner)

    def _pick(self, x: Live, tau):
        """The round's new entry of an auto run's Picks (one per round), with the drafts it accepted."""
        picks = x.run.picks
        if picks is None or len(picks.choices) == x.picked:
            return
        size, expected, calibrated = picks.since(x.picked)
        x.picked = len(picks.choices)
        self.picks.append(AutoPick(size, expected, calibrated, max(tau - 1, 0)))

    def _stats(self, outs, seconds):
        taus = [o.tau for o in outs.values() if not isinstance(o, Exception)]
        picks, self.picks = self.picks, []
        self.on_round(RoundStats(seconds, taus, len(outs), len(self.pending), picks))


def finish_of(run) -> str | None:
    return None if run.stop_reason is None else ("length" if run.stop_reason in ("length", "context") else "stop")


def new_ids(x: Live) -> Update:
    """The Update of a request whose receiver makes the text: the tokens added since the last update."""
    ids, x.seen = x.run.tokens[x.seen:], len(x.run.tokens)
    return Update(tokens=x.seen, finish_reason=finish_of(x.run), ids=ids)


class Receiver:
    """The text of a Request.decode = False stream, made where its updates arrive: settle over the ids received so
    far (no stop strings: only a character split between tokens is held back)."""

    def __init__(self, tokenizer, req: Request):
        self.tokenizer, self.x = tokenizer, Live(req, Run([], 0, set()))

    def text(self, u: Update) -> Update:
        """u with its ids made text (an update without ids, such as an error, as it is)."""
        if u.ids is None:
            return u
        run = self.x.run
        run.tokens += u.ids
        run.stop_reason = u.finish_reason                  # None, "length" or "stop": what finish_of gives back
        return settle(self.tokenizer, self.x)


def settle(tokenizer, x: Live) -> Update:
    """The Update for a sequence's tokens so far. A stop string ends it: the tokens are cut after the one that
    completed it and the text before it. Unfinished, text that may still change is held back: a trailing U+FFFD
    (a character split between tokens) and a tail that could begin a stop string.

    Incremental (x.stream decodes only recent tokens): a stop string is looked for from the last stop length - 1
    characters of the text the previous update had settled on (the earlier text held none) and, when found, the
    tokens that completed it from those that update had not seen (a stop string free of U+FFFD found in the text
    of the first k tokens lies in text the later tokens do not change)."""
    run, stops = x.run, x.req.stop_strings
    s = x.stream = x.stream or TextStream(tokenizer)
    n, longest = len(run.tokens), max(map(len, stops), default=0)
    lo = max(0, len(s.stable) - max(longest - 1, 0))             # text before lo: searched already
    new = s.peek(run.tokens, n)
    cut = first_stop(s.stable[lo:] + new, stops)
    if cut >= 0:
        k = next(k for k in range(x.seen + 1, n + 1) if first_stop(s.stable[lo:] + s.peek(run.tokens, k), stops) >= 0)
        run.tokens[k:], run.stop_reason = [], "stop"
        head, tail, end = s.stable, new, lo + cut               # the text is head + tail; it ends at `end`
    else:
        s.update(run.tokens, new)
        head, tail = s.stable, s.pending
        end = len(head) + len(tail)
    x.seen = len(run.tokens)
    finish = finish_of(run)
    if finish is None:                                           # held back: only the end of the text may go
        last = head[max(0, len(head) - longest):] + tail
        end -= len(last) - len(held(last, stops))
    delta = (head[x.sent:] + tail[max(0, x.sent - len(head)):])[:end - x.sent] if end > x.sent else ""
    x.sent += len(delta)
    return Update(delta, len(run.tokens), finish)


def first_stop(text, stops) -> int:
    """Index of the earliest stop string in text, -1 when none occurs."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def held(text, stops) -> str:
    """text without a trailing U+FFFD run and without its longest tail that is a proper prefix of a stop string."""
    text = text.rstrip("\ufffd")
    tail = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[:len(text) - tail]
